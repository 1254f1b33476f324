"""Policy and value losses for the GRPO/PPO family, with token masks and aggregation modes.

Every loss takes per-token tensors of one shape (``[B, T]`` batch layout, ``[S, L]``, or flat
``[N]``) plus a mask; masked positions contribute nothing and get an exactly-zero gradient (they
are removed with ``torch.where``, so even a NaN there cannot leak). Sequences for the
``seq-mean-*`` modes and GSPO come from ``sequence_index`` (same shape, -1 = none); without it,
each row of the last dimension is one sequence. The fused loss kernel
(``agentrl.kernels.fused_policy_loss``) has the same contract.

``surrogate`` selects the loss family (``clip``, ``gspo``, ``cispo``); which algorithm uses which
surrogate, estimator and defaults is the table in ``_algorithms`` (printed in
``docs/reference/config.md``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentrl.kernels import MAX_LOG_RATIO as _KERNEL_MAX_LOG_RATIO
from agentrl.kernels import fused_policy_loss, sequence_segments, use_triton

from ._kl import kl_estimate
from ._names import Aggregation, KLEstimator, Surrogate

MAX_LOG_RATIO = _KERNEL_MAX_LOG_RATIO
"""Log importance ratios are clamped to ±20 before ``exp`` (e^20 ≈ 5e8): an overflow would turn
one bad token into an inf loss; inside the clamp nothing changes."""


class LossMetrics(NamedTuple):
    """Detached 0-dim tensors (no host sync: call ``.item()`` when logging). Token statistics
    are means over masked tokens; with no masked token, ratios read 1 and the rest 0."""

    policy_loss: torch.Tensor
    """The aggregated surrogate term alone (TIS weights included)."""
    kl_loss: torch.Tensor
    """The aggregated KL-to-reference term, before ``kl_coef`` (0 without ``ref_logprobs``)."""
    entropy: torch.Tensor
    clip_fraction: torch.Tensor
    """Fraction of tokens where clipping is active: the surrogate's gradient is zero (PPO
    family, GSPO) or the IS weight was clipped (CISPO)."""
    clip_fraction_low: torch.Tensor
    clip_fraction_high: torch.Tensor
    clip_fraction_dual: torch.Tensor
    """Fraction of tokens whose negative-advantage term is capped by the dual clip
    (``clip_ratio_c``); they are counted in ``clip_fraction`` too."""
    ratio_mean: torch.Tensor
    """π/π_old; for GSPO the sequence ratio s_i on each of its tokens."""
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    approx_kl: torch.Tensor
    """k3 estimate of KL(π_old ‖ π): how far this update has moved (samples from π_old)."""
    tis_weight_mean: torch.Tensor
    tis_clip_fraction: torch.Tensor
    num_tokens: torch.Tensor


class LossOutput(NamedTuple):
    loss: torch.Tensor
    """0-dim, differentiable: surrogate + kl_coef · KL - entropy_coef · entropy, aggregated."""
    metrics: LossMetrics


def _segment_sum(flat: torch.Tensor, ids: torch.Tensor, num: int) -> torch.Tensor:
    return flat.new_zeros(num + 1).index_add_(0, ids, flat)[:num]


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Aggregation = "token-mean",
    sequence_index: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar over the masked tokens.

    - ``token-mean``: ``Σ_{i,t} x / Σ_{i,t} 1`` (DAPO's token-level loss; one long answer
      weighs by its tokens).
    - ``seq-mean-token-mean``: ``1/S Σ_i (1/|o_i|) Σ_t x`` (GRPO, DeepSeekMath eq. 3).
    - ``seq-mean-token-sum``: ``1/S Σ_i Σ_t x``.
    - ``seq-mean-token-sum-norm``: ``1/(S · norm_length) Σ_i Σ_t x`` with a constant
      ``norm_length`` such as the generation budget (Dr.GRPO: no length bias).

    ``S`` counts sequences with at least one masked token. ``denominator`` replaces the local
    count (tokens for ``token-mean``, sequences otherwise) so that micro-batches of one optimizer
    step sum to the full-batch loss: pass ``PackedBatch.step_loss_tokens`` /
    ``step_sequences``.
    """
    keep = mask.bool()
    x = torch.where(keep, values, torch.zeros_like(values))
    if agg == "token-mean":
        count = keep.sum().clamp(min=1) if denominator is None else denominator
        return x.sum() / count
    ids, num = sequence_segments(values.shape, sequence_index, values.device)
    sums = _segment_sum(x.reshape(-1), ids, num)
    counts = _segment_sum(keep.reshape(-1).to(x.dtype), ids, num)
    match agg:
        case "seq-mean-token-sum":
            per_seq = sums
        case "seq-mean-token-mean":
            per_seq = sums / counts.clamp(min=1)
        case "seq-mean-token-sum-norm":
            if norm_length is None or norm_length <= 0:
                raise ValueError("seq-mean-token-sum-norm needs norm_length > 0")
            per_seq = sums / norm_length
        case _:
            raise ValueError(f"unknown aggregation {agg!r}")
    num_seqs = (counts > 0).sum().clamp(min=1) if denominator is None else denominator
    return per_seq.sum() / num_seqs


def _masked_mean(x: torch.Tensor, keep: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x, torch.zeros_like(x)).sum() / count


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    surrogate: Surrogate = "clip",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    agg: Aggregation = "token-mean",
    sequence_index: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
    norm_length: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    clip_ratio_c: float | None = None,
    kernels: str = "auto",
) -> LossOutput:
    """The policy loss to *minimize* (the negated objective), per token then aggregated.

    All tensors share one shape. ``logprobs``: log π_θ of the sampled tokens (differentiable);
    ``old_logprobs``: log π_old, the policy that sampled them (the rollout's logprobs, or the
    trainer's recomputation of them); ``advantages``: Â per token; ``mask``: bool, the combined
    loss mask. With ``r = π_θ / π_old`` (per token) and ``ε_low, ε_high`` (``clip_high`` defaults
    to ``clip_low``):

    - ``clip`` (PPO, GRPO, Dr.GRPO, DAPO, RLOO): the clipped surrogate
      ``-min(r Â, clip(r, 1-ε_low, 1+ε_high) Â)`` (PPO, Schulman et al. 2017, eq. 7; GRPO,
      Shao et al. 2024, eq. 3; DAPO's Clip-Higher is ``ε_high > ε_low``, Yu et al. 2025, §3.1).
    - ``gspo``: the same with the sequence ratio
      ``s_i = exp(1/|y_i| Σ_t log(π_θ/π_old)(y_i,t))`` (Zheng et al. 2025, "Group Sequence
      Policy Optimization"), written in its GSPO-token form ``s_i,t = sg[s_i] · π_θ(y_t) /
      sg[π_θ(y_t)]``: equal to GSPO for per-sequence advantages, and correct for per-token ones.
    - ``cispo``: ``-sg[clip(r, 1-ε_low, 1+ε_high)] Â log π_θ`` (MiniMax-M1, 2025, CISPO): a
      REINFORCE gradient with a clipped, stop-gradient IS weight, so no token's gradient is
      dropped. MiniMax sets no lower bound: use ``clip_low=1.0``.

    ``clip_ratio_c``: dual clip for ``clip`` (Ye et al. 2020, "Mastering Complex Control in MOBA
    Games with Deep RL", eq. 5): on tokens with ``Â < 0`` the term is at most ``-c Â``, so a
    token whose ratio ran far above 1 cannot dominate the loss with an unbounded gradient
    (``c > 1``; verl's ``clip_ratio_c``). Those tokens get no gradient, like clipped ones.

    ``tis_cap``: truncated importance sampling against the engine (Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training"): each token's term is
    multiplied by ``sg[min(π_old / π_rollout, C)]`` from ``rollout_logprobs``; use it when
    ``old_logprobs`` are the trainer's recomputation. ``ref_logprobs`` + ``kl_coef``: adds
    ``β · k(π_θ, π_ref)`` per token (``kl_estimate``; GRPO uses k3, eq. 4). ``entropy`` +
    ``entropy_coef``: subtracts ``c · H`` per token (an entropy bonus). The terms are aggregated
    together with ``aggregate(agg, sequence_index, denominator, norm_length)``.

    ``kernels``: ``auto`` runs ``agentrl.kernels.fused_policy_loss`` (one Triton pass, same
    result and metrics within float tolerance) on CUDA and this torch code elsewhere; ``triton``
    or ``torch`` force one.
    """
    if not logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape:
        raise ValueError(
            f"shapes differ: logprobs {logprobs.shape}, old_logprobs {old_logprobs.shape}, "
            f"advantages {advantages.shape}, mask {mask.shape}"
        )
    if surrogate not in ("clip", "gspo", "cispo"):
        raise ValueError(f"unknown surrogate {surrogate!r}; expected clip, gspo or cispo")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c!r}")
    if use_triton(kernels, logprobs.device, "policy_loss"):
        loss, stats = fused_policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            surrogate=surrogate,
            clip_low=clip_low,
            clip_high=clip_high,
            agg=agg,
            sequence_index=sequence_index,
            denominator=denominator,
            norm_length=norm_length,
            ref_logprobs=ref_logprobs,
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            entropy=entropy,
            entropy_coef=entropy_coef,
            rollout_logprobs=rollout_logprobs,
            tis_cap=tis_cap,
            clip_ratio_c=clip_ratio_c,
        )
        return LossOutput(loss, LossMetrics(*stats))
    high = clip_low if clip_high is None else clip_high
    keep = mask.bool()
    zero = torch.zeros_like(logprobs)

    def masked(x: torch.Tensor) -> torch.Tensor:
        # Mask every input *before* any arithmetic: a where() after a nonlinearity still passes
        # 0 · (NaN derivative) = NaN back to masked positions.
        return torch.where(keep, x.to(logprobs.dtype), zero)

    count = keep.sum().clamp(min=1)
    lp = masked(logprobs)
    adv = masked(advantages.detach())
    log_ratio = (lp - masked(old_logprobs.detach())).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if surrogate == "gspo":
        ids, num = sequence_segments(logprobs.shape, sequence_index, logprobs.device)
        sums = _segment_sum(log_ratio.detach().reshape(-1), ids, num)
        counts = _segment_sum(keep.reshape(-1).to(sums.dtype), ids, num)
        seq_log_ratio = torch.cat([sums / counts.clamp(min=1), sums.new_zeros(1)])[ids]
        log_ratio = masked(lp - lp.detach() + seq_log_ratio.view_as(lp))
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + high)
    if surrogate == "cispo":
        objective = -clipped_ratio.detach() * adv * lp
        low_hit = keep & (ratio < 1.0 - clip_low)
        high_hit = keep & (ratio > 1.0 + high)
    else:
        objective = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        low_hit = keep & (adv < 0) & (ratio < 1.0 - clip_low)
        high_hit = keep & (adv > 0) & (ratio > 1.0 + high)
    dual_hit = torch.zeros_like(keep)
    if clip_ratio_c is not None and surrogate == "clip":
        bound = -adv * clip_ratio_c
        dual_hit = keep & (adv < 0) & (objective > bound)
        objective = torch.where(dual_hit, bound, objective)  # a constant: no gradient there

    tis_weight = torch.ones_like(logprobs)
    if tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap needs rollout_logprobs")
        tis_log = masked(old_logprobs.detach()) - masked(rollout_logprobs.detach())
        tis_weight = torch.exp(tis_log.clamp(max=MAX_LOG_RATIO)).clamp(max=tis_cap)
        objective = objective * tis_weight

    def reduce(values: torch.Tensor) -> torch.Tensor:
        return aggregate(
            values,
            keep,
            agg=agg,
            sequence_index=sequence_index,
            denominator=denominator,
            norm_length=norm_length,
        )

    total = objective
    kl_loss = zero.sum()
    if ref_logprobs is not None:
        kl = masked(kl_estimate(lp, masked(ref_logprobs.detach()), kl_estimator))
        total = total + kl_coef * kl
        kl_loss = reduce(kl.detach())
    entropy_mean = zero.sum()
    if entropy is not None:
        ent = masked(entropy)
        total = total - entropy_coef * ent
        entropy_mean = _masked_mean(ent.detach(), keep, count)
    loss = reduce(total)

    with torch.no_grad():
        any_token = keep.any()
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        inf = torch.full_like(ratio, float("inf"))
        metrics = LossMetrics(
            policy_loss=reduce(objective.detach()),
            kl_loss=kl_loss,
            entropy=entropy_mean,
            clip_fraction=(low_hit | high_hit | dual_hit).sum() / count,
            clip_fraction_low=low_hit.sum() / count,
            clip_fraction_high=high_hit.sum() / count,
            clip_fraction_dual=dual_hit.sum() / count,
            ratio_mean=torch.where(any_token, _masked_mean(ratio, keep, count), one),
            ratio_min=torch.where(any_token, torch.where(keep, ratio, inf).min(), one),
            ratio_max=torch.where(any_token, torch.where(keep, ratio, -inf).max(), one),
            approx_kl=_masked_mean(torch.expm1(log_ratio) - log_ratio, keep, count),
            tis_weight_mean=torch.where(any_token, _masked_mean(tis_weight, keep, count), one),
            tis_clip_fraction=(keep & (tis_weight >= (tis_cap or float("inf")))).sum() / count,
            num_tokens=keep.sum(),
        )
    return LossOutput(loss, metrics)


class ValueLossOutput(NamedTuple):
    loss: torch.Tensor
    """0-dim, differentiable in ``values``."""
    clip_fraction: torch.Tensor
    """Detached: fraction of tokens where the clipped error was the larger one."""


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None = 0.2,
    agg: Aggregation = "token-mean",
    sequence_index: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> ValueLossOutput:
    """PPO critic loss ``½ max((V - R)², (V_old + clip(V - V_old, -ε, ε) - R)²)`` per token
    (the squared-error L^VF of Schulman et al. 2017, eq. 9, with the value clipping of OpenAI
    baselines' ppo2, discussed by Engstrom et al. 2020, "Implementation Matters in Deep RL");
    ``clip_range=None`` gives the plain ``½ (V - R)²``. ``returns`` = GAE's ``returns``."""
    keep = mask.bool()
    zero = torch.zeros_like(values)
    values = torch.where(keep, values, zero)  # before any arithmetic (see policy_loss)
    target = torch.where(keep, returns.detach().to(values.dtype), zero)
    error = (values - target).square()
    clip_hit = torch.zeros_like(keep)
    if clip_range is not None:
        old = torch.where(keep, old_values.detach().to(values.dtype), zero)
        clipped = old + (values - old).clamp(-clip_range, clip_range)
        clipped_error = (clipped - target).square()
        clip_hit = keep & (clipped_error > error)
        error = torch.maximum(error, clipped_error)
    per_token = torch.where(keep, 0.5 * error, zero)
    loss = aggregate(
        per_token, keep, agg=agg, sequence_index=sequence_index, denominator=denominator
    )
    return ValueLossOutput(loss, (clip_hit.sum() / keep.sum().clamp(min=1)).detach())
