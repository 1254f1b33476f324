"""The engine's fused elementwise kernels (RMSNorm with its residual add, rotary embedding,
SiLU·mul) against float64 references, each within the error of its fp32 arithmetic plus one
rounding to the output dtype."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES, needs_triton
from numerics import assert_within, gamma, to64, unit_roundoff

from agentrl.kernels import _fused_ops as fused

DTYPES = [torch.float32, torch.bfloat16]
U32 = unit_roundoff(torch.float32)


def cast_error(dtype: torch.dtype, device: str) -> float:
    """Relative error of the kernels' one cast from fp32 to ``dtype``: a GPU rounds to nearest
    (``u``); Triton's interpreter truncates to bf16/fp16 (up to one ulp, ``2u``)."""
    u = unit_roundoff(dtype)
    return 2 * u if device == "cpu" and dtype != torch.float32 else u


def _tiny(dtype: torch.dtype) -> float:
    """Absolute slack for results that underflow the output dtype's normal range."""
    return torch.finfo(dtype).tiny


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "hidden"), [(5, 72), (3, 576), (0, 64)])
def test_rms_norm_with_and_without_the_residual_add(device, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3
    delta = torch.randn(rows, hidden, generator=gen)
    if rows:  # rows where eps matters: all zeros (x + delta too), and a mean square near eps
        x[0], delta[0] = 0.0, 0.0
        x[-1], delta[-1] = x[-1] * 1e-3, delta[-1] * 1e-3
    x, delta = x.to(dtype).to(device), delta.to(dtype).to(device)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype).to(device)
    eps = 1e-5
    u_out = cast_error(dtype, device)

    total, h = fused.rms_norm(x, weight, eps, delta)
    assert total.dtype == h.dtype == dtype and total.shape == h.shape == (rows, hidden)
    x64, d64, w64 = to64(x, delta, weight)
    # the sum: one fp32 addition, one rounding to the dtype
    want = x64 + d64
    assert_within(total, want, (U32 + u_out) * want.abs() + _tiny(dtype), "x + delta")

    # the norm of the rounded sum the kernel stored (what the next residual stream holds):
    # H squares summed in fp32 (any order), mean, + eps, sqrt, reciprocal, two products
    (s64,) = to64(total)
    want = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps) * w64
    bound = (gamma(hidden + 8, U32) + u_out) * want.abs() + _tiny(dtype)
    assert_within(h, want, bound, "rms_norm(x + delta)")

    none, plain = fused.rms_norm(x, weight, eps)
    assert none is None
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    assert_within(plain, want, (gamma(hidden + 8, U32) + u_out) * want.abs() + _tiny(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "dim"), [(5, 12), (3, 64)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_rotary_of_a_strided_qk_slice(device, dtype, heads, dim, index_dtype):
    """q and k heads taken as a view of a fused qkv projection (row stride wider than the
    heads), cos/sin rows looked up by position, any head count and half-width."""
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    tokens, positions_max, extra = 6, 40, 2 * dim  # ``extra``: the v columns after q and k
    qkv = torch.randn(tokens, heads * dim + extra, generator=gen).to(dtype).to(device)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)
    assert not x.is_contiguous()
    cos = torch.randn(positions_max, dim, generator=gen).to(dtype).to(device)
    sin = torch.randn(positions_max, dim, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, positions_max, (tokens,), generator=gen, dtype=index_dtype)
    out = fused.rotary(x, positions.to(device), cos, sin)
    assert out.is_contiguous() and out.shape == x.shape and out.dtype == dtype

    x64, cos64, sin64 = to64(x, cos, sin)
    c, s = cos64[positions.long()][:, None], sin64[positions.long()][:, None]
    half = dim // 2
    rotated = torch.cat([-x64[..., half:], x64[..., :half]], dim=-1)
    want = x64 * c + rotated * s
    # two fp32 products and one sum (no FMA), then one rounding to the dtype
    magnitude = (x64 * c).abs() + (rotated * s).abs()
    bound = gamma(2, U32) * magnitude + cast_error(dtype, device) * want.abs() + _tiny(dtype)
    assert_within(out, want, bound, "rotary")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "width"), [(4, 40), (2, 1500), (0, 8)])
def test_silu_mul(device, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * 10 + width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype).to(device)
    out = fused.silu_mul(gate_up)
    assert out.shape == (rows, width) and out.dtype == dtype
    (g64,) = to64(gate_up)
    gate, up = g64[:, :width], g64[:, width:]
    want = gate * torch.sigmoid(gate) * up
    # exp(-g) on a GPU is ex2.approx of -g times fp32(log2 e), documented (as __expf) within
    # 2 + floor(1.173|g|) ulps = (4 + 2.35|g|) u; 1 + e, the division and the product: three
    # more roundings
    relative = (2.35 * gate.abs() + 8) * U32 * (1 + 1e-3) + cast_error(dtype, device)
    assert_within(out, want, relative * want.abs() + _tiny(dtype), "silu(gate) * up")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_shapes_are_refused_with_the_reason(device):
    x = torch.randn(3, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[8\]"):
        fused.rms_norm(x, torch.ones(7, device=device), 1e-5)
    with pytest.raises(ValueError, match="delta must match x"):
        fused.rms_norm(x, w, 1e-5, torch.randn(3, 9, device=device))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        fused.rms_norm(x.t().contiguous().t()[:, :8], w, 1e-5)
    with pytest.raises(ValueError, match="x must be 2-D"):
        fused.rms_norm(x[None], w, 1e-5)
    with pytest.raises(ValueError, match="head_dim must be even"):
        fused.rotary(torch.randn(2, 3, 5, device=device), torch.zeros(2, dtype=torch.long), x, x)
    table = torch.randn(10, 8, device=device)
    with pytest.raises(ValueError, match="positions must be int32/int64"):
        fused.rotary(torch.randn(2, 3, 8, device=device), torch.zeros(2), table, table)
    with pytest.raises(ValueError, match=r"cos must be contiguous \[max_position, 8\]"):
        narrow = torch.randn(10, 6, device=device)
        fused.rotary(torch.randn(2, 3, 8, device=device), torch.zeros(2).long(), narrow, table)
    with pytest.raises(ValueError, match="gate_up's width must be even"):
        fused.silu_mul(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        fused.silu_mul(torch.randn(2, 8, device=device, dtype=torch.float64))


@needs_triton
def test_refused_where_triton_cannot_run(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="rms_norm cannot run here: tensors are on cpu"):
        fused.rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul cannot run here"):
        fused.silu_mul(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_probe_passes_and_catches_a_broken_kernel(device, dtype, monkeypatch):
    fused.probe(torch.device(device), dtype)
    from agentrl.kernels import _fused_ops_triton

    monkeypatch.setattr(_fused_ops_triton, "silu_mul", lambda gate_up: gate_up[:, :20] * 0)
    with pytest.raises(RuntimeError, match="fused kernels are wrong .* silu_mul is"):
        fused.probe(torch.device(device), dtype)
    monkeypatch.setattr(_fused_ops_triton, "rotary", lambda *a: 1 / 0)
    with pytest.raises(RuntimeError, match="do not run on .*ZeroDivisionError"):
        fused.probe(torch.device(device), dtype)
