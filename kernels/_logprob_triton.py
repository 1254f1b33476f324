"""Fused linear + log-prob + entropy in Triton: the logits ``h Wᵀ / τ`` are produced tile by tile
in registers and consumed at once, so no ``[T, V]`` tensor ever exists, not even per chunk.

Forward (grid: token blocks). Each program walks the vocabulary in ``BLOCK_V`` tiles; a tile's
logits come from ``BLOCK_H``-wide ``tl.dot`` steps and update three running quantities per token
(online log-sum-exp, Milakov & Gimelshein 2018)::

    m = max_j z_j             s = Σ_j e^(z_j - m)          u = Σ_j e^(z_j - m) (z_j - m)

(rescaled by ``α = e^(m_old - m_new)`` when the max moves: ``u ← α (u + (m_old - m_new) s)``)
plus the target's logit. Then ``lse = m + log s``, ``logprob = z_y - lse`` and
``entropy = log s - u / s`` — a sum of two non-negative terms (``u ≤ 0``), no cancellation.

Backward (grid: token blocks × vocabulary blocks) recomputes its tile of logits and forms
``dL/dz = (g_lp (onehot(y) - p) - g_H p (log p + H)) / τ``, then adds ``dz W`` into the hidden
gradient and ``dzᵀ h`` into the weight gradient with fp32 atomics (Cut Cross-Entropy, Wijmans et
al. 2024, does the same). Summation order across programs is therefore not fixed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreting

_NEG_BIG = tl.constexpr(-1.0e30)  # a finite "-inf" for the running max: (m_old - m_new) * 0 stays 0


@triton.jit
def _logits_tile(
    HIDDEN,
    WEIGHT,
    rows,
    cols,
    row_ok,
    col_ok,
    num_hidden,
    stride_h,
    stride_w,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """``[BLOCK_T, BLOCK_V]`` fp32 logits (before temperature) of ``rows`` × ``cols``."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_H)
    for k0 in range(0, num_hidden, BLOCK_H):
        k_ok = (k0 + ks) < num_hidden
        h = tl.load(
            HIDDEN + rows[:, None] * stride_h + (k0 + ks)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            WEIGHT + cols[:, None] * stride_w + (k0 + ks)[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(h, tl.trans(w))
    return acc


@triton.jit
def _fused_logprob_fwd_kernel(
    HIDDEN,
    WEIGHT,
    TARGETS,
    LOGPROB,
    ENTROPY,
    LSE,
    num_tokens,
    vocab,
    num_hidden,
    stride_h,
    stride_w,
    inv_temperature,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    target = tl.load(TARGETS + rows, mask=row_ok, other=0)
    m = tl.full((BLOCK_T,), _NEG_BIG, dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    u = tl.zeros((BLOCK_T,), dtype=tl.float32)
    z_target = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        z = _logits_tile(
            HIDDEN,
            WEIGHT,
            rows,
            cols,
            row_ok,
            col_ok,
            num_hidden,
            stride_h,
            stride_w,
            BLOCK_T,
            BLOCK_V,
            BLOCK_H,
            DOT_FP32,
        )
        z = z * inv_temperature
        valid = row_ok[:, None] & col_ok[None, :]
        m_new = tl.maximum(m, tl.max(tl.where(valid, z, _NEG_BIG), axis=1))
        alpha = tl.exp(m - m_new)
        shifted = tl.where(valid, z - m_new[:, None], 0.0)
        e = tl.where(valid, tl.exp(shifted), 0.0)
        u = alpha * (u + (m - m_new) * s) + tl.sum(e * shifted, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = m_new
        hit = (cols[None, :] == target[:, None]) & valid
        z_target += tl.sum(tl.where(hit, z, 0.0), axis=1)
    s = tl.maximum(s, 1e-30)  # rows past num_tokens only; a real row has s >= 1
    log_s = tl.log(s)
    lse = m + log_s
    logprob = tl.minimum(z_target - lse, 0.0)  # mathematically ≤ 0: never let rounding cross
    entropy = tl.maximum(log_s - u / s, 0.0)
    tl.store(LOGPROB + rows, logprob, mask=row_ok)
    tl.store(ENTROPY + rows, entropy, mask=row_ok)
    tl.store(LSE + rows, lse, mask=row_ok)


@triton.jit
def _fused_logprob_bwd_kernel(
    HIDDEN,
    WEIGHT,
    TARGETS,
    LSE,
    ENTROPY,
    GRAD_LOGPROB,
    GRAD_ENTROPY,
    GRAD_HIDDEN,
    GRAD_WEIGHT,
    num_tokens,
    vocab,
    num_hidden,
    stride_h,
    stride_w,
    inv_temperature,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NEED_HIDDEN: tl.constexpr,
    NEED_WEIGHT: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < num_tokens
    col_ok = cols < vocab
    valid = row_ok[:, None] & col_ok[None, :]
    target = tl.load(TARGETS + rows, mask=row_ok, other=0)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    entropy = tl.load(ENTROPY + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(GRAD_LOGPROB + rows, mask=row_ok, other=0.0)
    g_ent = tl.load(GRAD_ENTROPY + rows, mask=row_ok, other=0.0)
    z = _logits_tile(
        HIDDEN,
        WEIGHT,
        rows,
        cols,
        row_ok,
        col_ok,
        num_hidden,
        stride_h,
        stride_w,
        BLOCK_T,
        BLOCK_V,
        BLOCK_H,
        DOT_FP32,
    )
    log_p = tl.where(valid, z * inv_temperature - lse[:, None], 0.0)
    p = tl.where(valid, tl.exp(log_p), 0.0)
    onehot = tl.where((cols[None, :] == target[:, None]) & valid, 1.0, 0.0)
    dz = g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (log_p + entropy[:, None])
    dz = tl.where(valid, dz * inv_temperature, 0.0)
    ks = tl.arange(0, BLOCK_H)
    for k0 in range(0, num_hidden, BLOCK_H):
        k_ok = (k0 + ks) < num_hidden
        if NEED_HIDDEN:
            w = tl.load(
                WEIGHT + cols[:, None] * stride_w + (k0 + ks)[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if DOT_FP32:
                dh = tl.dot(dz, w.to(tl.float32), input_precision="ieee")
            else:
                dh = tl.dot(dz.to(w.dtype), w)
            tl.atomic_add(
                GRAD_HIDDEN + rows[:, None] * num_hidden + (k0 + ks)[None, :],
                dh,
                mask=row_ok[:, None] & k_ok[None, :],
                sem="relaxed",
            )
        if NEED_WEIGHT:
            h = tl.load(
                HIDDEN + rows[:, None] * stride_h + (k0 + ks)[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if DOT_FP32:
                dw = tl.dot(tl.trans(dz), h.to(tl.float32), input_precision="ieee")
            else:
                dw = tl.dot(tl.trans(dz.to(h.dtype)), h)
            tl.atomic_add(
                GRAD_WEIGHT + cols[:, None] * num_hidden + (k0 + ks)[None, :],
                dw,
                mask=col_ok[:, None] & k_ok[None, :],
                sem="relaxed",
            )


# GPU tiles (BLOCK_T, BLOCK_V, BLOCK_H, num_warps) per input width, chosen so that neither pass
# spills registers on sm_90 (ptxas -v on the PTX Triton 3.9 emits: 64x128x64 with 4 warps spilled
# 584 B in the forward and 3.5 KB in the backward; these spill 0 B, fp32's backward 200 B).
_CUDA_TILES = {2: (64, 128, 32, 8), 4: (32, 64, 32, 4)}


def _blocks(
    device: torch.device, num_tokens: int, vocab: int, itemsize: int
) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_V, BLOCK_H, num_warps). GPU: ``_CUDA_TILES``. Interpreter: every program
    costs Python-level work, so tiles grow with the problem (up to 4096 vocabulary columns)
    while small problems still span several tiles of each kind, so that the online rescaling
    and the masked tails are exercised."""
    if device.type == "cuda":
        return _CUDA_TILES[itemsize]
    bt = min(64, max(16, triton.next_power_of_2(max(num_tokens // 2, 1))))
    bv = min(4096, max(16, triton.next_power_of_2(max(vocab // 4, 1))))
    return bt, bv, 32, 4


def _dot_fp32(dtype: torch.dtype) -> bool:
    # fp32 inputs must not silently drop to tf32; the interpreter's bf16/fp16 dot is wrong
    # (it multiplies raw bit patterns), so there every tile is upcast first.
    return dtype == torch.float32 or interpreting()


def logprob_entropy_forward(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprob, entropy, lse)``, fp32 ``[T]``; inputs contiguous, same dtype and device."""
    num_tokens, num_hidden = hidden.shape
    vocab = weight.shape[0]
    out = [torch.empty(num_tokens, dtype=torch.float32, device=hidden.device) for _ in range(3)]
    if num_tokens == 0:
        return out[0], out[1], out[2]
    bt, bv, bh, warps = _blocks(hidden.device, num_tokens, vocab, hidden.element_size())
    _fused_logprob_fwd_kernel[(triton.cdiv(num_tokens, bt),)](
        hidden,
        weight,
        targets,
        out[0],
        out[1],
        out[2],
        num_tokens,
        vocab,
        num_hidden,
        hidden.stride(0),
        weight.stride(0),
        1.0 / temperature,
        BLOCK_T=bt,
        BLOCK_V=bv,
        BLOCK_H=bh,
        DOT_FP32=_dot_fp32(hidden.dtype),
        num_warps=warps,
    )
    return out[0], out[1], out[2]


def logprob_entropy_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 gradients for ``hidden`` and ``weight`` (None where not needed)."""
    num_tokens, num_hidden = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    f32 = torch.float32
    # an unneeded gradient gets a 1-element stand-in: its kernel branch is compiled out
    grad_hidden = torch.zeros(
        *((num_tokens, num_hidden) if need_hidden else (1,)), dtype=f32, device=dev
    )
    grad_weight = torch.zeros(
        *((vocab, num_hidden) if need_weight else (1,)), dtype=f32, device=dev
    )
    if num_tokens and (need_hidden or need_weight):
        bt, bv, bh, warps = _blocks(dev, num_tokens, vocab, hidden.element_size())
        grid = (triton.cdiv(num_tokens, bt), triton.cdiv(vocab, bv))
        _fused_logprob_bwd_kernel[grid](
            hidden,
            weight,
            targets,
            lse,
            entropy,
            grad_logprob.float().contiguous(),
            grad_entropy.float().contiguous(),
            grad_hidden,
            grad_weight,
            num_tokens,
            vocab,
            num_hidden,
            hidden.stride(0),
            weight.stride(0),
            1.0 / temperature,
            BLOCK_T=bt,
            BLOCK_V=bv,
            BLOCK_H=bh,
            DOT_FP32=_dot_fp32(hidden.dtype),
            NEED_HIDDEN=need_hidden,
            NEED_WEIGHT=need_weight,
            num_warps=warps,
        )
    return (grad_hidden if need_hidden else None), (grad_weight if need_weight else None)
