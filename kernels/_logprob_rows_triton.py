"""Row kernels of the GEMM path (``_logprob_gemm``): the logits of a chunk of tokens already exist
in fp32 (a cuBLAS GEMM wrote them); one program per token walks its row once.

Forward: the online log-sum-exp of ``_logprob_triton``, kept per lane of a ``BLOCK_V`` vector
and merged across lanes at the end (no cross-lane reduction inside the loop)::

    m = max_j z_j        s = Σ_j e^(z_j - m)        u = Σ_j e^(z_j - m) (z_j - m)
    lse = m + log s      logprob = z_y - lse        entropy = log s - u / s

Merging lanes ``i`` into ``M = max_i m_i``: ``s = Σ β_i s_i``, ``u = Σ β_i (u_i + (m_i - M) s_i)``
with ``β_i = e^(m_i - M)`` — the same rescaling the online update applies.

Backward: ``dL/dz = (g_lp (onehot(y) - p) - g_H p (log p + H)) / τ`` written in the GEMM
operand dtype (the Triton tile kernel rounds it the same way before its ``tl.dot``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-1.0e30)  # a finite "-inf": (m_old - m_new) * 0 stays 0


@triton.jit
def _rows_fwd_kernel(
    LOGITS,
    TARGETS,
    LOGPROB,
    ENTROPY,
    LSE,
    vocab,
    stride,
    inv_temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    lanes = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), _NEG_BIG, dtype=tl.float32)
    s = tl.zeros((BLOCK_V,), dtype=tl.float32)
    u = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + lanes
        ok = cols < vocab
        z = tl.where(ok, tl.load(base + cols, mask=ok, other=0.0) * inv_temperature, _NEG_BIG)
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        shifted = z - m_new
        e = tl.where(ok, tl.exp(shifted), 0.0)
        u = alpha * (u + (m - m_new) * s) + e * tl.where(ok, shifted, 0.0)
        s = s * alpha + e
        m = m_new
    big_m = tl.max(m, axis=0)
    beta = tl.exp(m - big_m)
    s_all = tl.sum(beta * s, axis=0)
    u_all = tl.sum(beta * (u + (m - big_m) * s), axis=0)
    target = tl.load(TARGETS + row)
    z_target = tl.load(base + target) * inv_temperature
    log_s = tl.log(s_all)
    lse = big_m + log_s
    tl.store(LOGPROB + row, tl.minimum(z_target - lse, 0.0))  # mathematically ≤ 0
    tl.store(ENTROPY + row, tl.maximum(log_s - u_all / s_all, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _rows_bwd_kernel(
    LOGITS,
    GRAD_Z,
    TARGETS,
    LSE,
    ENTROPY,
    GRAD_LOGPROB,
    GRAD_ENTROPY,
    vocab,
    stride,
    stride_g,
    inv_temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    out = GRAD_Z + row * stride_g
    lanes = tl.arange(0, BLOCK_V)
    target = tl.load(TARGETS + row)
    lse = tl.load(LSE + row)
    entropy = tl.load(ENTROPY + row)
    g_lp = tl.load(GRAD_LOGPROB + row)
    g_ent = tl.load(GRAD_ENTROPY + row)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + lanes
        ok = cols < vocab
        log_p = tl.load(base + cols, mask=ok, other=0.0) * inv_temperature - lse
        p = tl.exp(log_p)
        onehot = tl.where(cols == target, 1.0, 0.0)
        dz = (g_lp * (onehot - p) - g_ent * p * (log_p + entropy)) * inv_temperature
        tl.store(out + cols, dz.to(GRAD_Z.dtype.element_ty), mask=ok)


def _block(vocab: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_V, num_warps). GPU: 2048 lanes, 8 warps (8 fp32 values per thread and vector).
    Interpreter: several tiles per row even for small vocabularies, so that the lane merge and
    the masked tail are exercised."""
    if device.type == "cuda":
        return 2048, 8
    return min(4096, max(16, triton.next_power_of_2(max(vocab // 4, 1)))), 4


def _launch(
    kernel: triton.JITFunction,
    logits: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    strides: tuple[int, ...],
    inv_temperature: float,
) -> None:
    """One program per row of ``logits [C, V]``: ``kernel(LOGITS, *tensors, vocab, stride,
    *strides, inv_temperature)``."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    block, warps = _block(vocab, logits.device)
    kernel[(rows,)](
        logits,
        *tensors,
        vocab,
        logits.stride(0),
        *strides,
        inv_temperature,
        BLOCK_V=block,
        num_warps=warps,
    )


def rows_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logprob: torch.Tensor,
    entropy: torch.Tensor,
    lse: torch.Tensor,
    inv_temperature: float,
) -> None:
    """Fill ``logprob``, ``entropy``, ``lse`` (fp32 ``[C]`` views) from fp32 ``logits [C, V]``."""
    _launch(_rows_fwd_kernel, logits, (targets, logprob, entropy, lse), (), inv_temperature)


def rows_backward(
    logits: torch.Tensor,
    grad_z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor,
    inv_temperature: float,
) -> None:
    """Write ``dL/dz`` of fp32 ``logits [C, V]`` into ``grad_z [C, V]`` (its own dtype)."""
    tensors = (grad_z, targets, lse, entropy, grad_logprob, grad_entropy)
    _launch(_rows_bwd_kernel, logits, tensors, (grad_z.stride(0),), inv_temperature)
