"""The fast Triton path of ``fused_logprob_entropy`` for bf16/fp16 inputs: cuBLAS GEMMs for the
three products and Triton row kernels for everything between them, ``chunk_size`` tokens at a
time.

Per chunk of ``C`` tokens, with ``W [V, H]`` the LM head:

- forward: ``z = h Wᵀ`` as one GEMM with fp32 output (bf16/fp16 operands, fp32 accumulation —
  ``torch.mm(..., out_dtype=torch.float32)``), then one row kernel computes ``lse``, the target's
  log-prob and the entropy (``_logprob_rows_triton``). Saved: the inputs plus ``lse`` and the
  entropy, ``[T]`` each.
- backward: the same GEMM again, the row kernel writes ``dL/dz`` in the operand dtype, then
  ``dL/dh = dz W`` (fp32 output, rounded once into the chunk's rows of the hidden gradient) and
  ``dL/dW += dzᵀ h`` (fp32 accumulator).

At most ``C × V`` fp32 logits plus ``C × V`` operand-dtype gradients exist at a time. Compared
with the all-Triton tile kernel (``_logprob_triton``) this spends ``C × V`` memory to run the
``4 T V H`` multiply-adds of the four products on cuBLAS, which is where the time goes.

On CPU (Triton's interpreter, for tests) the GEMMs run in fp32 on upcast operands: the same
exact products and fp32 accumulation, and ``dL/dz`` stays fp32.
"""

from __future__ import annotations

import functools

import torch

GEMM_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _cuda_mm_out_dtype() -> bool:
    """cuBLAS GEMMs with fp32 output from bf16/fp16 operands (``torch.mm(out_dtype=)``)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def gemm_path_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether inputs of ``dtype`` on ``device`` take this path (the Triton backend decides)."""
    if dtype not in GEMM_DTYPES:
        return False
    return device.type != "cuda" or _cuda_mm_out_dtype()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32: cuBLAS with fp32 output on CUDA, upcast operands elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _head(weight: torch.Tensor) -> torch.Tensor:
    """The head as every chunk's GEMMs take it: as is on CUDA; upcast once elsewhere (rather
    than by ``_mm_fp32`` in every chunk)."""
    return weight if weight.is_cuda else weight.float()


class GemmLogprobEntropy(torch.autograd.Function):
    """cuBLAS + row kernels as an autograd function; saves ``(hidden, weight, targets, lse,
    entropy)``, nothing of size ``V`` per token."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):  # type: ignore[override]
        from ._logprob_rows_triton import rows_forward

        hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        n = hidden.shape[0]
        out = [torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3)]
        logprob, entropy, lse = out
        w_t = _head(weight).T
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = _mm_fp32(hidden[start:end], w_t)
            rows_forward(
                z,
                targets[start:end],
                logprob[start:end],
                entropy[start:end],
                lse[start:end],
                1.0 / temperature,
            )
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):  # type: ignore[override]
        from ._logprob_rows_triton import rows_backward

        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_hidden or need_weight):
            return None, None, None, None, None
        grad_logprob = (
            torch.zeros_like(lse) if grad_logprob is None else grad_logprob.float().contiguous()
        )
        grad_entropy = (
            torch.zeros_like(lse) if grad_entropy is None else grad_entropy.float().contiguous()
        )
        n, vocab = hidden.shape[0], weight.shape[0]
        # dL/dz in the GEMM operand dtype on a GPU; fp32 on upcast operands elsewhere
        dz_dtype = hidden.dtype if hidden.is_cuda else torch.float32
        w = _head(weight)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_weight
            else None
        )
        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            h = hidden[start:end]
            z = _mm_fp32(h, w.T)
            dz = torch.empty(end - start, vocab, dtype=dz_dtype, device=hidden.device)
            rows_backward(
                z,
                dz,
                targets[start:end],
                lse[start:end],
                entropy[start:end],
                grad_logprob[start:end],
                grad_entropy[start:end],
                1.0 / ctx.temperature,
            )
            del z
            if grad_hidden is not None:
                # fp32 output, then one rounding into the hidden dtype: a bf16-output GEMM may
                # reduce its split-K partial sums in bf16 (torch's default
                # allow_bf16_reduced_precision_reduction), and this GEMM's K is the vocabulary
                grad_hidden[start:end] = _mm_fp32(dz, w)
            if grad_weight is not None:
                grad_weight += _mm_fp32(dz.T, h)
            del dz
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None
