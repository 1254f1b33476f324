"""Per-token log-probabilities and entropies from hidden states, chunked over tokens.

Full logits are ``N × V``: 8k tokens × 49k vocabulary is 1.6 GB in fp32 per copy, and autograd
would keep several copies. Here at most ``chunk_size × V`` logits exist at a time, in the forward
*and* the backward: a custom autograd function saves only its inputs and recomputes each chunk's
logits in the backward. Issue E's fused Triton kernel (``agentrl.kernels``) has the same contract
(``hidden [N, H], weight [V, H], targets [N], temperature, mask -> (logprob [N], entropy [N])``,
masked positions 0 with no gradient) and replaces this path on GPU.

Math, with ``z = h Wᵀ / τ`` and ``p = softmax(z)``::

    logprob = z[y] - logsumexp(z)                 d/dz = onehot(y) - p
    entropy = -Σ_j p_j log p_j                    d/dz = -p ⊙ (log p + entropy)

The logprob is ``log_softmax(logits / temperature)`` over the full vocabulary, exactly what the
engines record (DESIGN.md, "Logprobs and sampling").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._batch import PackedBatch, model_inputs


class TokenLogprobs(NamedTuple):
    """Per-token results, both ``[N]`` (or ``[B, T]`` from ``causal_lm_token_logprobs``) in the
    compute dtype (float32, or float64 for float64 inputs); 0 where masked."""

    logprobs: torch.Tensor
    """log π(target | context) at temperature τ; always ≤ 0."""
    entropy: torch.Tensor
    """Entropy of the temperature-τ next-token distribution, in nats."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    return (hidden.to(weight.dtype) @ weight.T) / temperature


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):  # type: ignore[override]
        dtype = _compute_dtype(hidden.dtype)
        w = weight.to(dtype)
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logp = _chunk_logits(hidden[start:end], w, temperature)
            logp -= torch.logsumexp(logp, dim=-1, keepdim=True)  # log p = z - lse, in place
            logprobs[start:end] = logp.gather(1, targets[start:end, None]).squeeze(1)
            # -Σ p log p term by term (each ≥ 0): lse - Σ p z would cancel for large logits
            entropy[start:end] = -(logp.exp() * logp).sum(-1)
            del logp
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        # mathematically log p ≤ 0 and H ≥ 0; rounding can cross by an ulp when p ≈ 1
        return logprobs.clamp_(max=0.0), entropy.clamp_(min=0.0)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = _compute_dtype(hidden.dtype)
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(w) if need_weight else None
        n, tau = hidden.shape[0], ctx.temperature
        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            h = hidden[start:end].to(dtype)
            logp = _chunk_logits(h, w, tau)
            logp -= torch.logsumexp(logp, dim=-1, keepdim=True)
            p = logp.exp()
            neg_ent = (p * logp).sum(-1, keepdim=True)  # -H
            g_lp = grad_logprobs[start:end, None].to(dtype)
            g_ent = grad_entropy[start:end, None].to(dtype)
            # z - E_p[z] = log p + H: reuse logp's memory for g_ent (log p + H) + g_lp
            logp.sub_(neg_ent).mul_(g_ent).add_(g_lp)
            grad_z = p.mul_(logp).neg_()  # -p ⊙ (g_lp + g_ent (log p + H))
            del logp
            grad_z.scatter_add_(1, targets[start:end, None], g_lp)  # + g_lp · onehot(y)
            grad_z.div_(tau)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_z @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_z.T, h)
            del grad_z, p
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: torch.Tensor | None = None,
) -> TokenLogprobs:
    """Log-prob of ``targets`` and entropy at every position, never holding more than
    ``chunk_size × V`` logits (forward and backward).

    ``hidden [N, H]`` (the final, normed hidden states), ``lm_head_weight [V, H]``,
    ``targets [N]`` int64, ``mask [N]`` bool (optional): masked positions are not computed,
    return 0 and get no gradient. Differentiable in ``hidden`` and ``lm_head_weight``; the
    arithmetic runs in float32 (float64 for float64 inputs) whatever the working dtype.
    """
    if hidden.ndim != 2 or lm_head_weight.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(lm_head_weight.shape)}, {tuple(targets.shape)}"
        )
    if temperature <= 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0: {temperature}, {chunk_size}")
    if mask is None:
        lp, ent = _ChunkedLogprobEntropy.apply(
            hidden, lm_head_weight, targets, float(temperature), int(chunk_size)
        )
        return TokenLogprobs(lp, ent)
    rows = mask.nonzero().squeeze(1)
    lp_sel, ent_sel = _ChunkedLogprobEntropy.apply(
        hidden.index_select(0, rows),
        lm_head_weight,
        targets.index_select(0, rows),
        float(temperature),
        int(chunk_size),
    )
    zeros = lp_sel.new_zeros(hidden.shape[0])
    return TokenLogprobs(zeros.index_put((rows,), lp_sel), zeros.index_put((rows,), ent_sel))


def causal_lm_token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    only_loss_tokens: bool = True,
) -> TokenLogprobs:
    """Run an HF causal LM's decoder on ``batch`` and score ``batch.targets`` chunked: results
    are ``[B, T]`` aligned with the batch (0 where not computed). With ``only_loss_tokens``
    only positions in ``batch.loss_mask`` are scored (all of them otherwise).

    Under DeepSpeed ZeRO-3 the LM head's weight is partitioned outside its module's forward:
    gather it (or register it as an external parameter) before calling this.
    """
    decoder = model.get_decoder()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    dtype = next(model.parameters()).dtype
    hidden = decoder(**model_inputs(batch, dtype=dtype)).last_hidden_state
    b, t, h = hidden.shape
    out = token_logprobs_and_entropy(
        hidden.reshape(b * t, h),
        head.weight,
        batch.targets.reshape(-1),
        temperature=temperature,
        chunk_size=chunk_size,
        mask=batch.loss_mask.reshape(-1) if only_loss_tokens else None,
    )
    return TokenLogprobs(out.logprobs.view(b, t), out.entropy.view(b, t))
