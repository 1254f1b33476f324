"""Triton kernels of ``_fused_ops``: one launch for what the engine's forward otherwise runs as
several torch elementwise kernels per layer. Every kernel computes in fp32 and rounds once, to
the output's dtype. Imported on first use (``_fused_ops`` imports without Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# no FMA contraction: the numbers are those of the fp32 expressions as written, on every GPU
COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _rms_norm_kernel(
    X,
    DELTA,
    WEIGHT,
    OUT_SUM,
    OUT,
    stride_x,
    stride_delta,
    stride_sum,
    stride_out,
    n_cols,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row per program: ``s = x + delta`` rounded to ``OUT_SUM``'s dtype and stored (when
    ``HAS_DELTA``), then ``out = s * rsqrt(mean(s^2) + eps) * weight`` from that rounded ``s``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(DELTA + row * stride_delta + cols, mask=mask, other=0.0)
        s = (x + delta.to(tl.float32)).to(OUT_SUM.dtype.element_ty)
        tl.store(OUT_SUM + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    mean_square = tl.div_rn(tl.sum(x * x, axis=0), n_cols * 1.0)
    inv = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))  # correctly rounded, not approximate
    weight = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (x * inv * weight).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    X,
    POSITIONS,
    COS,
    SIN,
    OUT,
    stride_x_token,
    stride_x_head,
    stride_table,
    heads,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One token per program, every head: rotary embedding in the ``rotate_half`` layout,
    ``out[:h] = x[:h] cos[:h] - x[h:] sin[:h]``, ``out[h:] = x[h:] cos[h:] + x[:h] sin[h:]``,
    with the token's cos/sin rows looked up from its position. ``OUT`` is contiguous."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(POSITIONS + token).to(tl.int64)
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    src = X + token * stride_x_token + h * stride_x_head + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    row = position * stride_table + d
    cos1 = tl.load(COS + row, mask=d < HALF, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + row + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + row, mask=d < HALF, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + row + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    dst = OUT + token * heads * (2 * HALF) + h * (2 * HALF) + d
    kind = OUT.dtype.element_ty
    tl.store(dst, (x1 * cos1 - x2 * sin1).to(kind), mask=mask)
    tl.store(dst + HALF, (x2 * cos2 + x1 * sin2).to(kind), mask=mask)


@triton.jit
def _silu_mul_kernel(
    GATE_UP,
    OUT,
    stride_in,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
):
    """``out = silu(gate) * up`` for ``gate_up = [gate | up]`` rows; grid ``(rows, col blocks)``.
    ``silu(g) = g / (1 + exp(-g))``, the division correctly rounded; on a GPU ``exp`` is the
    hardware ``ex2`` of ``-g * log2(e)`` (relative error about ``(|g| + 2)`` fp32 ulps)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GATE_UP + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate))
    tl.store(OUT + row * stride_out + cols, (silu * up).to(OUT.dtype.element_ty), mask=mask)


def warps(block: int) -> int:
    """``num_warps`` for a program of ``block`` elements (what the launchers below use)."""
    return 1 if block <= 256 else 4 if block <= 4096 else 8


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    rows, cols = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else None
    if rows:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(rows,)](
            x,
            delta if delta is not None else x,
            weight,
            total if total is not None else out,
            out,
            x.stride(0),
            delta.stride(0) if delta is not None else 0,
            total.stride(0) if total is not None else 0,
            out.stride(0),
            cols,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=block,
            num_warps=warps(block),
            **COMPILE_OPTIONS,
        )
    return total, out


def rotary(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        block_heads = triton.next_power_of_2(heads)
        block_half = triton.next_power_of_2(dim // 2)
        _rotary_kernel[(tokens,)](
            x,
            positions,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            heads,
            HALF=dim // 2,
            BLOCK_HEADS=block_heads,
            BLOCK_HALF=block_half,
            num_warps=warps(block_heads * block_half),
            **COMPILE_OPTIONS,
        )
    return out


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows and cols:
        block = min(SILU_BLOCK, triton.next_power_of_2(cols))
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            cols,
            BLOCK=block,
            num_warps=warps(block),
            **COMPILE_OPTIONS,
        )
    return out
