"""Chunked log-prob + entropy: equal to the full-logits computation, and never holding it."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_within, logprob_entropy_bounds, unit_roundoff
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl.trainer import token_logprobs_and_entropy


def naive(hidden, weight, targets, temperature=1.0):
    """The full-logits reference: [N, V] logits, log_softmax, gather."""
    logits = (hidden @ weight.T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def make(seed, n, h, v, dtype, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(n, h, generator=gen, dtype=torch.float64)).to(dtype)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden.requires_grad_(), weight.requires_grad_(), targets, gen


def bounds(hidden, weight, targets, gen, *, dtype, temperature=1.0):
    """``numerics.logprob_entropy_bounds`` at ``dtype``'s unit roundoff, for the gradient
    weights ``forward_backward`` draws from ``gen``."""
    n = hidden.shape[0]
    g_lp = torch.randn(n, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(n, generator=gen, dtype=torch.float64)
    u = unit_roundoff(dtype)
    return logprob_entropy_bounds(hidden, weight, targets, temperature, g_lp, g_ent, u=u)


def forward_backward(fn, hidden, weight, targets, gen, **kwargs):
    lp, ent = fn(hidden, weight, targets, **kwargs)
    g_lp = torch.randn(lp.shape, generator=gen, dtype=torch.float64).to(lp.dtype)
    g_ent = torch.randn(ent.shape, generator=gen, dtype=torch.float64).to(ent.dtype)
    gh, gw = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
    return lp.detach(), ent.detach(), gh, gw


@pytest.mark.parametrize("chunk_size", [1, 7, 32, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_full_logits_fp64_forward_and_gradients(rng, chunk_size, temperature):
    seed = rng.randrange(2**31)
    n, h, v = 29, 16, 53  # not multiples of any chunk size
    hidden, weight, targets, _ = make(seed, n, h, v, torch.float64)
    grads = torch.Generator().manual_seed(seed + 1)
    want = forward_backward(naive, hidden, weight, targets, grads, temperature=temperature)
    grads = torch.Generator().manual_seed(seed + 1)
    got = forward_backward(
        token_logprobs_and_entropy,
        hidden,
        weight,
        targets,
        grads,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    # two float64 evaluations: each within the float64 bound
    tol = bounds(hidden, weight, targets, torch.Generator().manual_seed(seed + 1),
                 dtype=torch.float64, temperature=temperature)  # fmt: skip
    names = ("logprob", "entropy", "d/dhidden", "d/dweight")
    for name, a, b, bound in zip(names, got, want, tol, strict=True):
        assert_within(a, b, 2 * bound, f"{name} seed={seed}")


def test_gradcheck_fp64(rng):
    seed = rng.randrange(2**31)
    hidden, weight, targets, _ = make(seed, 6, 4, 9, torch.float64)

    def fn(h, w):
        out = token_logprobs_and_entropy(h, w, targets, temperature=0.9, chunk_size=4)
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight)), f"seed={seed}"


def test_fp32_working_dtype_close_to_fp64_reference(rng):
    seed = rng.randrange(2**31)
    hidden, weight, targets, _ = make(seed, 40, 32, 200, torch.float32)
    h64 = hidden.detach().double().requires_grad_()  # the same (fp32) values
    w64 = weight.detach().double().requires_grad_()
    grads = torch.Generator().manual_seed(seed + 1)
    want = forward_backward(naive, h64, w64, targets, grads)
    grads = torch.Generator().manual_seed(seed + 1)
    got = forward_backward(
        token_logprobs_and_entropy, hidden, weight, targets, grads, chunk_size=16
    )
    assert all(t.dtype == torch.float32 for t in got)
    tol = bounds(
        hidden, weight, targets, torch.Generator().manual_seed(seed + 1), dtype=torch.float32
    )
    # the gradients come back in fp32: one more rounding each
    tol = (
        *tol[:2],
        *(
            b + unit_roundoff(torch.float32) * w.abs()
            for b, w in zip(tol[2:], want[2:], strict=True)
        ),
    )
    names = ("logprob", "entropy", "d/dhidden", "d/dweight")
    for name, a, b, bound in zip(names, got, want, tol, strict=True):
        assert_within(a, b, bound, f"{name} seed={seed}")


def test_mask_skips_positions_returns_zero_and_no_gradient(rng):
    seed = rng.randrange(2**31)
    hidden, weight, targets, gen = make(seed, 23, 8, 31, torch.float64)
    mask = torch.rand(23, generator=gen) < 0.5
    mask[0] = True
    mask[1] = False
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=5, mask=mask)
    ref_lp, ref_ent = naive(hidden, weight, targets)
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all(), f"seed={seed}"
    ones = torch.ones(23, dtype=torch.float64)
    lp_b, ent_b, _, _ = logprob_entropy_bounds(
        hidden, weight, targets, 1.0, ones, ones, u=unit_roundoff(torch.float64)
    )  # two float64 evaluations: twice one's bound
    assert_within(lp[mask], ref_lp[mask], 2 * lp_b[mask], f"logprob seed={seed}")
    assert_within(ent[mask], ref_ent[mask], 2 * ent_b[mask], f"entropy seed={seed}")
    (gh,) = torch.autograd.grad((lp + ent).sum(), hidden)
    assert (gh[~mask] == 0).all(), f"seed={seed}"
    assert (gh[mask].abs().sum(-1) > 0).all(), f"seed={seed}"
    empty = token_logprobs_and_entropy(
        hidden, weight, targets, mask=torch.zeros(23, dtype=torch.bool)
    )
    assert (empty.logprobs == 0).all() and empty.logprobs.shape == (23,)


def test_extreme_logits_never_positive_and_accurate(rng):
    seed = rng.randrange(2**31)
    hidden, weight, _, gen = make(seed, 64, 16, 50, torch.float32, scale=30.0)
    # targets = the argmax, where p ≈ 1 and rounding could push log p above 0
    targets = (hidden @ weight.T).argmax(-1)
    targets[::3] = torch.randint(0, 50, targets[::3].shape, generator=gen)  # and some unlikely
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=9)
    assert (lp <= 0).all(), f"max logprob {lp.max().item()} seed={seed}"
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all(), f"seed={seed}"
    # logits reach ~±1000 here: entropy as lse - Σ p z would lose ~1e-1 to cancellation
    ref_lp, ref_ent = naive(hidden.detach().double(), weight.detach().double(), targets)
    ones = torch.ones(64, dtype=torch.float64)
    lp_b, ent_b, _, _ = logprob_entropy_bounds(hidden, weight, targets, 1.0, ones, ones)
    assert_within(lp, ref_lp, lp_b, f"logprob seed={seed}")
    assert_within(ent, ref_ent, ent_b, f"entropy seed={seed}")


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def largest_tensor_and_saved(fn, n, h, v, chunk_size):
    hidden, weight, targets, _ = make(0, n, h, v, torch.float32)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    mode = LargestTensor()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        kwargs = {"chunk_size": chunk_size} if fn is token_logprobs_and_entropy else {}
        lp, ent = fn(hidden, weight, targets, **kwargs)
        (lp.sum() + ent.sum()).backward()
    return mode.largest, max(saved)


def test_never_materializes_full_logits():
    """Every tensor created in forward and backward, and every tensor saved for backward, is
    at most chunk × V (besides the weight's own V × H); the naive path, measured the same way,
    creates N × V, which shows the measurement can see it."""
    n, h, v, chunk = 96, 8, 500, 16
    naive_largest, naive_saved = largest_tensor_and_saved(naive, n, h, v, chunk)
    assert naive_largest >= n * v and naive_saved >= n * v
    largest, saved = largest_tensor_and_saved(token_logprobs_and_entropy, n, h, v, chunk)
    bound = max(chunk * v, v * h, n * h)
    assert largest <= bound, f"a tensor of {largest} elements (bound {bound})"
    assert saved <= max(v * h, n * h), f"saved a tensor of {saved} elements for backward"
