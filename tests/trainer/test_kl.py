"""KL estimators against their definitions (Schulman 2020) and the KL-in-reward helper."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import LAMBDA, assert_within, unit_roundoff

from agentrl.trainer import kl_estimate, kl_in_reward

HAND = 32 * 16 * unit_roundoff(torch.float64)
"""The by-hand examples: at most 32 float64 roundings, each of an intermediate of magnitude at
most 16; errors add at most linearly (Higham's γ_n)."""


def test_estimators_match_definitions_by_hand():
    # log π = -1.2, log π_ref = -0.5: log r = log π_ref - log π = 0.7, r = e^0.7
    lp, ref = torch.tensor([-1.2], dtype=torch.float64), torch.tensor([-0.5], dtype=torch.float64)
    log_r = 0.7
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(-log_r, abs=HAND)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * log_r**2, abs=HAND)
    k3 = (math.exp(log_r) - 1) - log_r
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(k3, abs=HAND)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")  # type: ignore[arg-type]


def test_estimators_elementwise_and_k3_nonnegative(rng):
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(1000, generator=gen, dtype=torch.float64) * 8
    ref = -torch.rand(1000, generator=gen, dtype=torch.float64) * 8
    log_r = ref - lp
    u = unit_roundoff(torch.float64)
    assert torch.equal(kl_estimate(lp, ref, "k1"), lp - ref)  # -fl(a - b) == fl(b - a)
    k2 = 0.5 * log_r**2
    assert_within(kl_estimate(lp, ref, "k2"), k2, 4 * u * k2, f"k2 seed={seed}")
    # the reference form here cancels: e^x, 1 and x rounded apart, ~u of each, both sides
    k3_bound = 4 * u * (log_r.exp() + 1 + log_r.abs())
    k3 = (log_r.exp() - 1 - log_r).clamp(max=10.0)  # 1-Lipschitz: the bound still holds
    assert_within(kl_estimate(lp, ref, "k3"), k3, k3_bound, f"k3 seed={seed}")
    assert (kl_estimate(lp, ref, "k3") >= 0).all(), f"seed={seed}"
    assert (kl_estimate(lp, ref, "k2") >= 0).all(), f"seed={seed}"
    assert (kl_estimate(lp, ref, "k1") < 0).any(), f"k1 is not sign-definite; seed={seed}"
    # near r = 1 the k3 form must not cancel to 0 (or negative)
    tiny = torch.tensor([-1.0], dtype=torch.float32)
    k3 = kl_estimate(tiny, tiny + 1e-4, "k3")
    x = (tiny + 1e-4).double().item() + 1.0  # log r of the fp32 values, exact in float64
    # fp32 expm1(x) - x: u of expm1 (~2u) and of x, then the subtraction's u of the result
    u = unit_roundoff(torch.float32)
    want = math.expm1(x) - x  # ≈ x²/2 ≈ 5e-9
    assert_within(k3.item(), want, u * (2 * abs(math.expm1(x)) + abs(x) + want))


def test_monte_carlo_unbiasedness(rng):
    """Sample y ~ q (the policy), estimate KL(q ‖ p): k1 and k3 are unbiased (within λ standard
    errors, λ = ``numerics.LAMBDA``), k2 is biased, by at most ``E|x|³ e^|x| / 6`` (``x = log
    r``: k3 - k2 = x³/6 + x⁴/24 + ...), which is small when p ≈ q."""
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    logits_q = torch.randn(20, generator=gen, dtype=torch.float64)
    logits_p = logits_q + 0.3 * torch.randn(20, generator=gen, dtype=torch.float64)
    log_q, log_p = logits_q.log_softmax(0), logits_p.log_softmax(0)
    true_kl = (log_q.exp() * (log_q - log_p)).sum().item()
    y = torch.multinomial(log_q.exp(), 200_000, replacement=True, generator=gen)
    for name in ("k1", "k3"):
        samples = kl_estimate(log_q[y], log_p[y], name)
        stderr = samples.std().item() / math.sqrt(samples.numel())
        assert abs(samples.mean().item() - true_kl) < LAMBDA * stderr, (
            f"{name}: {samples.mean().item()} vs KL {true_kl} (stderr {stderr}) seed={seed}"
        )
    k2 = kl_estimate(log_q[y], log_p[y], "k2")
    x, q = log_p - log_q, log_q.exp()
    bias = (q * x.abs() ** 3 * x.abs().exp()).sum().item() / 6
    stderr = k2.std().item() / math.sqrt(k2.numel())
    assert abs(k2.mean().item() - true_kl) < bias + LAMBDA * stderr, f"k2 {k2} seed={seed}"
    # the point of k3: same expectation as k1, lower variance
    assert kl_estimate(log_q[y], log_p[y], "k3").std() < kl_estimate(log_q[y], log_p[y], "k1").std()


def test_kl_in_reward_subtracts_on_masked_tokens_only():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    lp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    out = kl_in_reward(rewards, lp, ref, mask, kl_coef=0.1, estimator="k1")
    # k1 = lp - ref = [0.5, -1.0, 0.0, (masked)]
    want = [0.0 - 0.1 * 0.5, 0.0 - 0.1 * -1.0, 1.0, 0.0]
    assert out.tolist()[0] == pytest.approx(want, abs=HAND)
    assert not out.requires_grad


def test_k3_is_bounded_like_verls_low_var_kl():
    """k3 of a token far from the reference is capped at 10 (log r clamped to ±20 first), with
    no gradient there; inside the bounds it is the plain estimate with its gradient 1 - r."""
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    log_r = torch.tensor([0.5, -3.0, 3.0, -50.0, 1000.0], dtype=torch.float64)
    k3 = kl_estimate(lp, lp.detach() + log_r, "k3")
    plain = [math.expm1(0.5) - 0.5, math.expm1(-3.0) + 3.0]
    assert k3[:2].tolist() == pytest.approx(plain, rel=1e-15)
    assert k3[2:].tolist() == [10.0, 10.0, 10.0]  # e^3 - 4 ≈ 16.1; -50 → -20 → 19; 1000 → 20
    assert torch.isfinite(k3).all()
    k3.sum().backward()
    assert lp.grad[:2].tolist() == pytest.approx([1 - math.exp(0.5), 1 - math.exp(-3.0)], rel=1e-15)
    assert lp.grad[2:].tolist() == [0.0, 0.0, 0.0]
