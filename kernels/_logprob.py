"""Per-token log-probability and entropy from hidden states and the LM head, never holding the
full ``[T, V]`` logits: 16k tokens × 152k vocabulary are 9.3 GiB in fp32 per copy, and a naive
``log_softmax`` + entropy forward and backward keeps several.

Two backends behind one function, ``fused_logprob_entropy``:

- **triton**: bf16/fp16 inputs take the GEMM path (``_logprob_gemm``): ``chunk_size`` tokens at
  a time, cuBLAS GEMMs with fp32 output for the products and Triton row kernels for the
  log-sum-exp, entropy and ``dL/dz``. fp32 inputs (and bf16/fp16 where torch lacks fp32-output
  GEMMs) take the tile kernel (``_logprob_triton``): logits live only in registers, tile by tile
  (forward: online log-sum-exp over vocabulary tiles; backward: recomputed tiles, atomics into
  the gradients), with IEEE fp32 dots.
- **torch** (``_ChunkedLogprobEntropy``): ``chunk_size`` tokens at a time against the whole
  vocabulary; at most ``chunk_size × V`` logits exist, in the forward *and* the backward (the
  autograd function saves only its inputs and recomputes each chunk's logits).

Math, with ``z = h Wᵀ / τ`` and ``p = softmax(z)`` (see ``reference.logprob_entropy``)::

    logprob = z[y] - logsumexp(z)                 dlogprob/dz = onehot(y) - p
    entropy = -Σ_j p_j log p_j                    dentropy/dz = -p ⊙ (log p + entropy)

The logprob is ``log_softmax(logits / temperature)`` over the full vocabulary, exactly what the
engines record for a token sampled at temperature ``τ``.
"""

from __future__ import annotations

import torch

from ._logprob_gemm import GemmLogprobEntropy, gemm_path_available
from ._triton import Backend, use_triton


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


class FusedLogprobEntropy(torch.autograd.Function):
    """The Triton path as an autograd function: saves its inputs plus ``lse`` and the entropy
    (``[T]`` each), nothing of size ``V``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):  # type: ignore[override]
        from ._logprob_triton import logprob_entropy_forward

        hidden, weight = hidden.contiguous(), weight.contiguous()
        targets = targets.contiguous()
        logprob, entropy, lse = logprob_entropy_forward(hidden, weight, targets, temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature = temperature
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):  # type: ignore[override]
        from ._logprob_triton import logprob_entropy_backward

        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_logprob is None:
            grad_logprob = torch.zeros_like(lse)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse)
        grad_hidden, grad_weight = logprob_entropy_backward(
            hidden,
            weight,
            targets,
            lse,
            entropy,
            grad_logprob,
            grad_entropy,
            ctx.temperature,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
        )
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy at every position, without the full logits.

    ``hidden [T, H]`` (final normed hidden states), ``weight [V, H]`` (the LM head),
    ``targets [T]`` integer ids, ``mask [T]`` bool (optional): masked positions are not computed,
    return 0 and get no gradient. Returns ``(logprob [T], entropy [T])`` in float32 (float64 for
    float64 inputs); differentiable in ``hidden`` and ``weight``.

    ``backend``: ``auto`` runs the Triton backend on CUDA and the chunked torch path elsewhere;
    ``triton`` / ``torch`` force one (``triton`` on CPU needs ``TRITON_INTERPRET=1``, for tests).
    float64 always takes the torch path. ``chunk_size`` tokens are processed at a time by the
    torch path and by the Triton backend's GEMM path (bf16/fp16): at most ``chunk_size × V``
    logits exist at once.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [T, H], weight [V, H], targets [T]; got hidden "
            f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[1]} != weight's {weight.shape[1]}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if mask is not None and mask.shape != targets.shape:
        raise ValueError(f"mask {tuple(mask.shape)} != targets {tuple(targets.shape)}")
    if not temperature > 0 or chunk_size <= 0:
        raise ValueError(f"temperature and chunk_size must be > 0: {temperature}, {chunk_size}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden on {hidden.device}, weight on {weight.device}")
    triton_path = use_triton(backend, hidden.device, "fused_logprob_entropy")
    if triton_path and (hidden.dtype not in _TRITON_DTYPES or weight.dtype != hidden.dtype):
        if backend == "triton":
            raise ValueError(
                f"the Triton path takes hidden and weight of one dtype among "
                f"{[str(d) for d in _TRITON_DTYPES]}, got {hidden.dtype} and {weight.dtype}"
            )
        triton_path = False
    vocab = weight.shape[0]
    rows = None
    if mask is not None:
        rows = mask.bool().nonzero().squeeze(1)
        hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)
    targets = targets.long()
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        bad = targets[(targets < 0) | (targets >= vocab)][0].item()
        raise ValueError(f"target id {bad} is outside the vocabulary [0, {vocab})")
    if triton_path and gemm_path_available(hidden.dtype, hidden.device):
        lp, ent = GemmLogprobEntropy.apply(
            hidden, weight, targets, float(temperature), int(chunk_size)
        )
    elif triton_path:
        lp, ent = FusedLogprobEntropy.apply(hidden, weight, targets, float(temperature))
    else:
        lp, ent = _ChunkedLogprobEntropy.apply(
            hidden, weight, targets, float(temperature), int(chunk_size)
        )
    if rows is None:
        return lp, ent
    n = mask.shape[0]  # type: ignore[union-attr]
    zeros = lp.new_zeros(n)
    return zeros.index_put((rows,), lp), zeros.index_put((rows,), ent)
