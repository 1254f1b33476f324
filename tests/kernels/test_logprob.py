"""fused_logprob_entropy: the Triton kernel and the chunked torch path against the float64
full-logits reference, forward and gradients."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES, needs_triton
from numerics import TF32_UNIT_ROUNDOFF, assert_within, logprob_entropy_bounds, unit_roundoff

from agentrl.kernels import (
    FusedLogprobEntropy,
    GemmLogprobEntropy,
    fused_logprob_entropy,
    reference,
)


def _inputs(gen, t, h, v, dtype, device, *, scale=1.0):
    hidden = (torch.randn(t, h, generator=gen) * scale).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype).to(device)
    targets = torch.randint(0, v, (t,), generator=gen).to(device)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def _run(fn, hidden, weight, targets, temperature, mask, g_lp, g_ent):
    lp, ent = fn(hidden, weight, targets, temperature, mask)
    (lp.double() * g_lp + ent.double() * g_ent).sum().backward()
    grads = (hidden.grad.double().clone(), weight.grad.double().clone())
    hidden.grad = weight.grad = None
    return lp.detach().double(), ent.detach().double(), grads


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "h", "v", "temperature"),
    [(37, 40, 203, 1.0), (1, 24, 70, 0.7), (65, 33, 129, 1.3)],  # none a multiple of a block
)
def test_three_way(gen, device, dtype, t, h, v, temperature):
    if device == "cuda":
        t, h, v = t * 40, h * 8, v * 100  # thousands of tokens and a real vocabulary size
    hidden, weight, targets = _inputs(gen, t, h, v, dtype, device, scale=2.0)
    mask = (torch.rand(t, generator=gen) > 0.25).to(device)
    g_lp = torch.randn(t, generator=gen, dtype=torch.float64).to(device)
    g_ent = torch.randn(t, generator=gen, dtype=torch.float64).to(device)

    def kernel(*a):  # several chunks of the GEMM path (bf16) everywhere
        chunk = 16 if device == "cpu" else 512
        return fused_logprob_entropy(*a, backend="triton", chunk_size=chunk)

    def torch_path(*a):
        return fused_logprob_entropy(*a, backend="torch", chunk_size=16)

    args = (hidden, weight, targets, temperature, mask, g_lp, g_ent)
    # the reference's gradients in float64, not rounded to the inputs' dtype
    leaves = [x.detach().double().requires_grad_() for x in (hidden, weight)]
    ref = _run(reference.logprob_entropy, *leaves, *args[2:])
    got = {"kernel": _run(kernel, *args), "torch": _run(torch_path, *args)}
    # masked rows are exactly 0 (below) and get no gradient: bound the kept rows
    keep = mask.cpu()
    u_out = 0.0 if dtype == torch.float32 else unit_roundoff(dtype)
    for name, (lp, ent, (gh, gw)) in got.items():
        # the Triton backward on a GPU rounds dL/dz to bf16 for its bf16 tl.dot; its fp32 dots
        # are input_precision="ieee". torch's fp32 GEMMs on a GPU use tf32 if allowed.
        u_dz = u_out if name == "kernel" and device == "cuda" else 0.0
        tf32 = name == "torch" and device == "cuda" and torch.backends.cuda.matmul.allow_tf32
        lp_b, ent_b, gh_b, gw_b = logprob_entropy_bounds(
            hidden.detach()[keep], weight.detach(), targets[keep], temperature,
            g_lp[keep], g_ent[keep], u_dz=u_dz, u_out=u_out,
            u_operand=TF32_UNIT_ROUNDOFF if tf32 and dtype == torch.float32 else 0.0,
        )  # fmt: skip
        assert (lp <= 0).all(), name
        assert (ent >= 0).all(), name
        assert_within(lp.cpu()[keep], ref[0].cpu()[keep], lp_b, f"{name} logprob")
        assert_within(ent.cpu()[keep], ref[1].cpu()[keep], ent_b, f"{name} entropy")
        assert_within(gh.cpu()[keep], ref[2][0].cpu()[keep], gh_b, f"{name} grad hidden")
        assert_within(gw.cpu(), ref[2][1].cpu(), gw_b, f"{name} grad weight")
        off = ~mask
        assert (lp[off] == 0).all() and (ent[off] == 0).all(), name
        assert (gh[off] == 0).all(), f"{name}: masked rows got a gradient"


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # tile kernel, GEMM path
def test_extreme_logits_stay_finite(gen, device, dtype):
    """Logits of ±thousands: the online log-sum-exp must not overflow, logprob ≤ 0, entropy ≥ 0."""
    hidden, weight, targets = _inputs(gen, 19, 32, 150, dtype, device, scale=400.0)
    weight.data[7] *= 50  # one token dominates wherever it scores high
    targets[:5] = 7
    lp, ent = fused_logprob_entropy(hidden, weight, targets, 1.0, backend="triton", chunk_size=8)
    ref_lp, ref_ent = reference.logprob_entropy(hidden.double(), weight.double(), targets)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp <= 0).all() and (ent >= 0).all()
    # fp32 logits of magnitude ~1e4 carry absolute rounding errors ~1e-3: the model scales
    ones = torch.ones(19, dtype=torch.float64)
    lp_bound, ent_bound, _, _ = logprob_entropy_bounds(hidden, weight, targets, 1.0, ones, ones)
    assert_within(lp, ref_lp, lp_bound, "logprob")
    assert_within(ent, ref_ent, ent_bound, "entropy")
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_and_fully_masked(gen, device, dtype):
    hidden, weight, targets = _inputs(gen, 9, 16, 40, dtype, device)
    none = torch.zeros(9, dtype=torch.bool, device=device)
    lp, ent = fused_logprob_entropy(hidden, weight, targets, 1.0, none, backend="triton")
    assert (lp == 0).all() and (ent == 0).all()
    (lp.sum() + ent.sum()).backward()
    assert (hidden.grad == 0).all() and (weight.grad == 0).all()
    lp, ent = fused_logprob_entropy(hidden[:0], weight, targets[:0], backend="triton")
    assert lp.shape == ent.shape == (0,)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["tiles", "gemm"])
def test_only_hidden_needs_grad(gen, device, path):
    """A frozen head (reference-style) still gets the right hidden gradient."""
    hidden, weight, targets = _inputs(gen, 21, 24, 90, torch.float32, device)
    weight = weight.detach()
    if path == "tiles":
        lp, ent = FusedLogprobEntropy.apply(hidden, weight, targets, 1.0)
    else:  # fp32 operands through the GEMM path's code (fp32 GEMMs, fp32 dL/dz)
        lp, ent = GemmLogprobEntropy.apply(hidden, weight, targets, 1.0, 8)
    lp.sum().backward()
    leaf = hidden.detach().double().requires_grad_()  # the reference's gradient in float64
    ref_lp, _ = reference.logprob_entropy(leaf, weight, targets)
    ref_lp.sum().backward()
    ones, zeros = torch.ones(21, dtype=torch.float64), torch.zeros(21, dtype=torch.float64)
    bound = logprob_entropy_bounds(hidden, weight, targets, 1.0, ones, zeros)[2]
    assert_within(hidden.grad, leaf.grad, bound, "grad hidden")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden": torch.zeros(3, 4, 5)}, "expected hidden"),
        ({"weight": torch.zeros(10, 5)}, "hidden size 4"),
        ({"targets": torch.zeros(3)}, "integer token ids"),
        ({"targets": torch.tensor([0, 1, 10])}, "target id 10 is outside"),
        ({"temperature": 0.0}, "temperature"),
        ({"mask": torch.ones(4, dtype=torch.bool)}, "mask"),
        ({"backend": "cuda"}, "backend must be one of"),
    ],
)
def test_bad_input_names_the_problem(kwargs, match):
    args = {
        "hidden": torch.zeros(3, 4),
        "weight": torch.zeros(10, 4),
        "targets": torch.tensor([0, 1, 2]),
        "temperature": 1.0,
        "mask": None,
        "backend": "torch",
    }
    args.update(kwargs)
    backend = args.pop("backend")
    with pytest.raises(ValueError, match=match):
        fused_logprob_entropy(**args, backend=backend)


def test_auto_uses_torch_on_cpu(gen, monkeypatch):
    """``auto`` never picks the interpreter: on CPU the torch path runs (and matches)."""
    import agentrl.kernels._logprob as mod

    def boom(*a, **k):
        raise AssertionError("the Triton path ran on CPU under backend='auto'")

    monkeypatch.setattr(mod.FusedLogprobEntropy, "apply", boom)
    monkeypatch.setattr(mod.GemmLogprobEntropy, "apply", boom)
    hidden, weight, targets = _inputs(gen, 11, 16, 30, torch.float32, "cpu")
    lp, _ = fused_logprob_entropy(hidden, weight, targets)
    ref, _ = reference.logprob_entropy(hidden, weight, targets)
    ones = torch.ones(11, dtype=torch.float64)
    assert_within(
        lp, ref, logprob_entropy_bounds(hidden, weight, targets, 1.0, ones, ones)[0], "logprob"
    )


def test_triton_backend_refused_where_it_cannot_run(monkeypatch):
    import agentrl.kernels._triton as tri

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="backend='triton' cannot run here"):
        tri.use_triton("triton", torch.device("cpu"), "fused_logprob_entropy")
