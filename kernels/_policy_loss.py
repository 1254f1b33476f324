"""The fused clipped policy loss of the GRPO/PPO family: ratio, clipping (asymmetric for DAPO),
GSPO's sequence ratio, CISPO's clipped IS weight, the dual clip, truncated importance sampling,
KL k1/k2/k3 to
the reference, the entropy bonus, masking and the aggregation modes — with its gradient — in one
Triton pass over the tokens.

Every aggregation mode is a weighted sum ``Σ_t w_t · term_t`` with a per-token weight that depends
only on the mask and the sequences (token-mean ``1/N``; seq-mean-token-sum ``1/S``;
seq-mean-token-mean ``1/(S |o_i|)``; seq-mean-token-sum-norm ``1/(S L)``), so the weights are set
up in ``O(N)`` torch, and the kernel computes each term, ``w_t · ∂term_t/∂log π_θ`` and
``w_t · ∂term_t/∂H`` plus per-block partial sums of the loss and of every statistic. The loss is a
scalar, so its gradient is known in the forward: the backward only scales the saved per-token
gradients. GSPO needs each sequence's mean log-ratio first: one ``index_add`` before the pass.

The math is ``reference.policy_loss`` (per token, readable); ``agentrl.trainer.policy_loss`` is
the torch path with the same contract and metrics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import triton_available

MAX_LOG_RATIO = 20.0
K3_MAX = 10.0
"""The k3 KL estimate's upper bound (its log-ratio is clamped to ±``MAX_LOG_RATIO``), as verl's
``low_var_kl``: no gradient where either bound acts."""
_SURROGATES = ("clip", "gspo", "cispo")
_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class PolicyLossStats(NamedTuple):
    """Detached 0-dim tensors, the fields of ``agentrl.trainer.LossMetrics`` in its order."""

    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    entropy: torch.Tensor
    clip_fraction: torch.Tensor
    clip_fraction_low: torch.Tensor
    clip_fraction_high: torch.Tensor
    clip_fraction_dual: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    approx_kl: torch.Tensor
    tis_weight_mean: torch.Tensor
    tis_clip_fraction: torch.Tensor
    num_tokens: torch.Tensor


class _FusedPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprobs, entropy, grad_logprobs, grad_entropy, loss):  # type: ignore[override]
        # The pass already ran (it needs no autograd): this node only routes the saved gradients.
        ctx.save_for_backward(grad_logprobs, grad_entropy)
        ctx.shapes = (logprobs.shape, logprobs.dtype, entropy.shape, entropy.dtype)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        grad_lp, grad_ent = ctx.saved_tensors
        lp_shape, lp_dtype, ent_shape, ent_dtype = ctx.shapes
        d_lp = (
            (grad_lp * grad_loss).view(lp_shape).to(lp_dtype) if ctx.needs_input_grad[0] else None
        )
        d_ent = None
        if ctx.needs_input_grad[1] and grad_ent.numel() == ent_shape.numel():
            d_ent = (grad_ent * grad_loss).view(ent_shape).to(ent_dtype)
        return d_lp, d_ent, None, None, None


def sequence_segments(
    shape: torch.Size, sequence_index: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Flat segment id per element of a ``shape`` tensor and the number of segments ``S``; id
    ``S`` = no sequence. Sequences come from ``sequence_index`` (same shape, -1 = none), else
    each row of the last dimension is one (the loss modules' shared convention)."""
    if sequence_index is not None:
        if sequence_index.shape != shape:
            raise ValueError(
                f"sequence_index {tuple(sequence_index.shape)} != values {tuple(shape)}"
            )
        flat = sequence_index.reshape(-1).long()
        num = max(int(flat.max()) + 1 if flat.numel() else 0, 0)
        return torch.where(flat >= 0, flat, num), num
    rows = 1 if len(shape) <= 1 else shape[:-1].numel()
    per_row = shape[-1] if len(shape) else 1
    return torch.arange(rows, device=device).repeat_interleave(per_row), rows


def _weights(
    keep: torch.Tensor,
    ids: torch.Tensor | None,
    num: int,
    agg: str,
    denominator: float | torch.Tensor | None,
    norm_length: float | None,
) -> torch.Tensor:
    """Per-token aggregation weight ``w_t`` (0 where not kept), fp32."""
    kept = keep.to(torch.float32)
    if agg == "token-mean":
        count = kept.sum().clamp(min=1) if denominator is None else denominator
        return kept / count
    assert ids is not None
    counts = kept.new_zeros(num + 1).index_add_(0, ids, kept)
    counts[num] = 0  # tokens outside every sequence weigh nothing in the seq-mean modes
    seqs = (counts[:num] > 0).sum().clamp(min=1) if denominator is None else denominator
    match agg:
        case "seq-mean-token-sum":
            per_token = torch.ones_like(kept)
        case "seq-mean-token-mean":
            per_token = 1.0 / counts.clamp(min=1)[ids]
        case "seq-mean-token-sum-norm":
            if norm_length is None or norm_length <= 0:
                raise ValueError("seq-mean-token-sum-norm needs norm_length > 0")
            per_token = torch.full_like(kept, 1.0 / norm_length)
        case _:
            raise ValueError(f"unknown aggregation {agg!r}; expected one of {_AGGS}")
    in_seq = (ids < num).to(torch.float32)
    return kept * in_seq * per_token / seqs


def fused_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    surrogate: str = "clip",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    agg: str = "token-mean",
    sequence_index: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
    norm_length: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """The policy loss to minimize and its statistics, in one Triton pass (contract of
    ``agentrl.trainer.policy_loss``; see ``reference.policy_loss`` for the math).

    All per-token tensors share one shape; ``mask`` selects the loss tokens (the trajectory's loss
    mask combined with any algorithm mask). Differentiable in ``logprobs`` and ``entropy``; the
    result is fp32. Triton must be able to run on the tensors' device (CUDA, or the interpreter);
    there is no torch path here: the trainer's ``policy_loss`` is that path and dispatches here.
    """
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    tensors["mask"] = mask
    optional = {"ref_logprobs": ref_logprobs, "entropy": entropy}
    optional["rollout_logprobs"] = rollout_logprobs
    for name, t in [*tensors.items(), *optional.items()]:
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(logprobs.shape)}")
    if surrogate not in _SURROGATES:
        raise ValueError(f"unknown surrogate {surrogate!r}; expected one of {_SURROGATES}")
    if agg not in _AGGS:
        raise ValueError(f"unknown aggregation {agg!r}; expected one of {_AGGS}")
    if kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"unknown KL estimator {kl_estimator!r}; expected k1, k2 or k3")
    if tis_cap is not None and rollout_logprobs is None:
        raise ValueError("tis_cap needs rollout_logprobs")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c!r}")
    if not triton_available(logprobs.device):
        raise RuntimeError(
            "fused_policy_loss runs only in Triton (CUDA, or TRITON_INTERPRET=1); the torch path "
            "is agentrl.trainer.policy_loss"
        )
    from ._policy_loss_triton import (
        APPROX_KL,
        DUAL,
        ENTROPY,
        HIGH,
        KL,
        LOSS,
        LOW,
        POLICY,
        RATIO_MAX,
        RATIO_MIN,
        RATIO_SUM,
        TIS_CLIP,
        TIS_SUM,
        policy_loss_pass,
    )

    high = clip_low if clip_high is None else clip_high
    shape = logprobs.shape
    keep = mask.reshape(-1).bool()
    flat = {k: v.detach().reshape(-1).contiguous() for k, v in tensors.items() if k != "mask"}
    ids, num = (None, 0)
    if agg != "token-mean" or surrogate == "gspo":
        ids, num = sequence_segments(shape, sequence_index, keep.device)
    weight = _weights(keep, ids, num, agg, denominator, norm_length)
    seq_log_ratio = None
    if surrogate == "gspo":
        assert ids is not None
        log_ratio = (flat["logprobs"] - flat["old_logprobs"]).float()
        log_ratio = torch.where(keep, log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), 0.0)
        sums = log_ratio.new_zeros(num + 1).index_add_(0, ids, log_ratio)
        counts = log_ratio.new_zeros(num + 1).index_add_(0, ids, keep.float())
        means = sums / counts.clamp(min=1)
        means[num] = 0.0
        seq_log_ratio = means[ids].contiguous()
    grad_lp, grad_ent, partials = policy_loss_pass(
        flat["logprobs"],
        flat["old_logprobs"],
        flat["advantages"],
        keep.to(torch.int8).contiguous(),
        weight.contiguous(),
        seq_log_ratio,
        ref_logprobs.detach().reshape(-1).contiguous() if ref_logprobs is not None else None,
        entropy.detach().reshape(-1).contiguous() if entropy is not None else None,
        rollout_logprobs.detach().reshape(-1).contiguous()
        if rollout_logprobs is not None
        else None,
        algo=surrogate,
        kl_estimator=kl_estimator if ref_logprobs is not None else None,
        clip_low=clip_low,
        clip_high=high,
        max_log_ratio=MAX_LOG_RATIO,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        tis_cap=tis_cap,
        clip_ratio_c=clip_ratio_c if surrogate == "clip" else None,
        k3_max=K3_MAX,
    )
    totals = partials.sum(0)
    loss = _FusedPolicyLoss.apply(
        logprobs,
        entropy if entropy is not None else logprobs.new_zeros(0),
        grad_lp,
        grad_ent if grad_ent is not None else grad_lp.new_zeros(0),
        totals[LOSS],
    )
    tokens = keep.sum()
    count = tokens.clamp(min=1).float()
    one = torch.ones((), dtype=torch.float32, device=logprobs.device)
    any_token = tokens > 0
    stats = PolicyLossStats(
        policy_loss=totals[POLICY],
        kl_loss=totals[KL],
        entropy=totals[ENTROPY] / count,
        clip_fraction=(totals[LOW] + totals[HIGH] + totals[DUAL]) / count,
        clip_fraction_low=totals[LOW] / count,
        clip_fraction_high=totals[HIGH] / count,
        clip_fraction_dual=totals[DUAL] / count,
        ratio_mean=torch.where(any_token, totals[RATIO_SUM] / count, one),
        ratio_min=torch.where(any_token, partials[:, RATIO_MIN].min(), one),
        ratio_max=torch.where(any_token, partials[:, RATIO_MAX].max(), one),
        approx_kl=totals[APPROX_KL] / count,
        tis_weight_mean=torch.where(any_token, totals[TIS_SUM] / count, one),
        tis_clip_fraction=totals[TIS_CLIP] / count,
        num_tokens=tokens,
    )
    return loss, stats
