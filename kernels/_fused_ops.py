"""The embedded engine's per-layer elementwise work as one Triton kernel each, instead of the
several torch kernels each takes otherwise (a decode step of a small model is bound by its
kernel count, inside a CUDA graph too):

- ``rms_norm``: RMSNorm of each row, optionally after adding a residual branch
  (``x + delta``, rounded to ``x``'s dtype and returned too: the next residual stream);
- ``rotary``: rotary position embedding (``rotate_half`` layout) of every head of each token,
  its cos/sin rows looked up by position in the same kernel;
- ``silu_mul``: ``silu(gate) * up`` of a fused ``[gate | up]`` projection.

Each computes in fp32 and rounds once to the input's dtype (the unfused torch expressions round
after every operation in that dtype). ``triton_available(device)`` says whether they can run;
each raises ``RuntimeError`` when it cannot and ``ValueError`` on shapes it does not take.
"""

from __future__ import annotations

import torch

from ._triton import require_triton

__all__ = ["DTYPES", "probe", "rms_norm", "rotary", "silu_mul", "unsupported"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes the kernels take."""
MAX_ROW = 65536
"""Widest row (hidden size, or heads x head_dim for ``rotary``) one program holds."""


def unsupported(hidden: int, heads: int, head_dim: int) -> str | None:
    """Why a model of these shapes cannot use the kernels (``heads``: query plus KV heads, the
    ones ``rotary`` turns together), or ``None``."""
    if not 0 < hidden <= MAX_ROW:
        return f"hidden size {hidden} is not in 1..{MAX_ROW}"
    if head_dim % 2 or not 0 < heads * head_dim <= MAX_ROW:
        return f"{heads} heads of {head_dim} (rotary needs an even head_dim, <= {MAX_ROW} in all)"
    return None


def _check_rows(name: str, x: torch.Tensor, dim: int) -> None:
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} dtype must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[-1] and x.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1)")


def _load():  # noqa: ANN202
    from . import _fused_ops_triton

    return _fused_ops_triton


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta) * weight)`` for ``x [rows, hidden]`` (``delta`` of the
    same shape and dtype, or ``None``: then ``(None, rms_norm(x) * weight)``)."""
    require_triton(x.device, "rms_norm")
    _check_rows("x", x, 2)
    hidden = x.shape[1]
    if not 0 < hidden <= MAX_ROW:
        raise ValueError(f"rms_norm: hidden size must be in 1..{MAX_ROW}, got {hidden}")
    if weight.shape != (hidden,) or weight.device != x.device or weight.stride(0) != 1:
        raise ValueError(
            f"weight must be a contiguous [{hidden}] on {x.device}, got {tuple(weight.shape)} "
            f"on {weight.device}"
        )
    if delta is not None:
        _check_rows("delta", delta, 2)
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(
                f"delta must match x ({tuple(x.shape)}, {x.dtype}), got "
                f"{tuple(delta.shape)}, {delta.dtype}"
            )
    return _load().rms_norm(x, weight, eps, delta)


def rotary(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``x [tokens, heads, head_dim]`` rotated by ``cos``/``sin`` rows (``[max_position,
    head_dim]``, contiguous) at ``positions [tokens]`` (int, each below ``max_position``: not
    checked, that would read the device back); a new contiguous tensor."""
    require_triton(x.device, "rotary")
    _check_rows("x", x, 3)
    tokens, heads, dim = x.shape
    if dim % 2 or not 0 < heads * dim <= MAX_ROW:
        raise ValueError(f"rotary: head_dim must be even and heads x head_dim <= {MAX_ROW}")
    if positions.shape != (tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be int32/int64 [{tokens}], got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    if tokens and positions.stride(0) != 1:
        raise ValueError("positions must be contiguous")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != dim or not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous [max_position, {dim}]")
    return _load().rotary(x, positions, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[rows, 2 * width]``."""
    require_triton(gate_up.device, "silu_mul")
    _check_rows("gate_up", gate_up, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up's width must be even, got {gate_up.shape[1]}")
    return _load().silu_mul(gate_up)


def probe(device: torch.device, dtype: torch.dtype) -> None:
    """Launch each kernel once on small inputs of ``dtype`` on ``device`` and compare with torch
    in fp32 (a few of the dtype's ulps): ``RuntimeError`` naming what failed, so an engine can
    find out at start that the kernels do not build or run here."""
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(3, 40, generator=gen).to(dtype).to(device) for _ in range(2))
    weight = torch.ones(40, dtype=dtype, device=device)
    qk = torch.randn(3, 2, 8, generator=gen).to(dtype).to(device)
    table = torch.randn(5, 8, generator=gen).to(dtype).to(device)
    positions = torch.tensor([0, 4, 2], device=device)
    try:
        total, normed = rms_norm(x, weight, 1e-6, delta)
        rotated = rotary(qk, positions, table, table)
        activated = silu_mul(x)
    except Exception as exc:
        raise RuntimeError(f"the fused kernels do not run on {device} in {dtype}: {exc!r}") from exc
    s = x.float() + delta.float()
    c = table.float()[positions.long()][:, None]
    q = qk.float()
    half = torch.cat([-q[..., 4:], q[..., :4]], dim=-1)
    gate, up = x.float()[:, :20], x.float()[:, 20:]
    checks = {
        "rms_norm": (normed, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)),
        "rms_norm's sum": (total, s),
        "rotary": (rotated, q * c + half * c),
        "silu_mul": (activated, torch.nn.functional.silu(gate) * up),
    }
    tolerance = 8 * torch.finfo(dtype).eps
    for name, (got, want) in checks.items():
        error = (got.float() - want).abs().max().item()
        scale = max(want.abs().max().item(), 1.0)
        if not error <= tolerance * scale:  # NaN fails too
            raise RuntimeError(
                f"the fused kernels are wrong on {device} in {dtype}: {name} is {error:.3g} "
                f"off torch's fp32 result"
            )
