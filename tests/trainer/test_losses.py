"""Policy/value losses: each surrogate against a hand-computed example, aggregation modes,
masked tokens' gradients exactly zero, and the on-policy limit (plain policy gradient)."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import LAMBDA, assert_within, emulated_std, unit_roundoff

from agentrl.trainer import aggregate, policy_loss, value_loss

SURROGATES = ("clip", "gspo", "cispo")
AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


U32 = unit_roundoff(torch.float32)
"""Count / count metrics (clip fractions) are divided in torch's default dtype: one fp32
rounding."""
HAND = 32 * 16 * unit_roundoff(torch.float64)
"""The by-hand examples: a few dozen float64 roundings (at most 32), each of an intermediate
of magnitude at most 16; errors add at most linearly (Higham's γ_n)."""


def assert_float64_close(got_fn, want_fn, what: str) -> None:
    """Two float64 computations of the same quantity (``got_fn()`` and ``want_fn()``), each
    within ``LAMBDA`` times its emulated float64 rounding deviation (``numerics.emulated_std``)."""
    got, got_std = emulated_std(got_fn, emulate=torch.float64)
    want, want_std = emulated_std(want_fn, emulate=torch.float64)
    assert_within(got, want, LAMBDA * (got_std + want_std), what)


def t(values, dtype=torch.float64, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def test_clipped_surrogate_by_hand():
    lp = t([-1.0, -2.0, -0.5, -1.5], grad=True)
    old = t([-1.2, -1.5, -0.5, -2.0])
    adv = t([1.0, 1.0, -1.0, -2.0])
    mask = torch.tensor([True, True, True, False])
    out = policy_loss(lp, old, adv, mask, surrogate="clip", clip_low=0.2, agg="token-mean")
    r0, r1 = math.exp(0.2), math.exp(-0.5)  # 1.2214 (clipped to 1.2: A > 0), 0.6065 (kept)
    want = (-1.2 - r1 + 1.0) / 3
    assert out.loss.item() == pytest.approx(want, abs=HAND)
    (grad,) = torch.autograd.grad(out.loss, lp)
    # token 0: clipped → no gradient; token 1: -A r / 3; token 2: -A r / 3 = +1/3; token 3 masked
    assert grad.tolist() == pytest.approx([0.0, -r1 / 3, 1.0 / 3, 0.0], abs=HAND)
    m = out.metrics
    assert m.clip_fraction.item() == pytest.approx(1 / 3, rel=U32, abs=0)
    assert m.clip_fraction_high.item() == pytest.approx(1 / 3, rel=U32, abs=0)
    assert m.clip_fraction_low.item() == 0.0
    assert m.ratio_mean.item() == pytest.approx((r0 + r1 + 1.0) / 3, abs=HAND)
    assert m.ratio_min.item() == pytest.approx(
        r1, abs=HAND
    ) and m.ratio_max.item() == pytest.approx(r0, abs=HAND)
    k3 = [math.expm1(x) - x for x in (0.2, -0.5, 0.0)]
    assert m.approx_kl.item() == pytest.approx(sum(k3) / 3, abs=HAND)
    assert m.num_tokens.item() == 3


def test_dapo_clip_higher_is_asymmetric():
    lp = t([-1.0, -1.0], grad=True)
    old = t([-1.2, -0.7])  # log ratios 0.2 and -0.3
    adv = t([1.0, -1.0])
    mask = torch.tensor([True, True])
    out = policy_loss(lp, old, adv, mask, surrogate="clip", clip_low=0.2, clip_high=0.28)
    r0 = math.exp(0.2)  # 1.2214 < 1.28: kept; r1 = e^-0.3 = 0.7408 < 0.8 with A < 0: clipped
    assert out.loss.item() == pytest.approx((-r0 + 0.8) / 2, abs=HAND)
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad.tolist() == pytest.approx([-r0 / 2, 0.0], abs=HAND)
    assert out.metrics.clip_fraction_low.item() == 0.5
    assert out.metrics.clip_fraction_high.item() == 0.0
    # the symmetric clip would have clipped token 0 (1.2214 > 1.2)
    sym = policy_loss(lp, old, adv, mask, surrogate="clip", clip_low=0.2)
    assert sym.loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=HAND)


def test_gspo_by_hand_sequence_ratio():
    lp = t([[-1.0, -2.0], [-1.0, -2.0]], grad=True)
    old = t([[-1.1, -2.3], [-0.9, -2.0]])  # seq 0: log ratios 0.1, 0.3; seq 1: -0.1, 0.0
    adv = t([[1.0, 1.0], [-0.5, -0.5]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = policy_loss(
        lp, old, adv, mask, surrogate="gspo", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean"
    )
    s0, s1 = math.exp(0.2), math.exp(-0.05)  # geometric means: 1.2214 (clipped), 0.9512
    assert out.loss.item() == pytest.approx((-1.2 + 0.5 * s1) / 2, abs=HAND)
    (grad,) = torch.autograd.grad(out.loss, lp)
    # d/dlp_t of -A s / 2 with ds/dlp_t = s / |y|: seq 0 clipped → 0; seq 1: 0.5 · s1 / 2 / 2
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, s1 / 8, s1 / 8], abs=HAND)
    assert out.metrics.ratio_max.item() == pytest.approx(s0, abs=HAND)


def test_gspo_token_form_equals_sequence_level_gspo(rng):
    """With per-sequence advantages, the GSPO-token implementation must equal the plain
    sequence-level objective -1/G Σ_i min(s_i A_i, clip(s_i) A_i) in value and gradient."""
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(5, 7, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    seq_adv = torch.randn(5, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=gen) < 0.7
    mask[:, 0] = True

    def got() -> torch.Tensor:
        loss = policy_loss(
            lp, old, seq_adv[:, None].expand(5, 7), mask, surrogate="gspo", clip_low=0.05,
            clip_high=0.07, agg="seq-mean-token-mean",
        ).loss  # fmt: skip
        return torch.cat([loss.reshape(1), torch.autograd.grad(loss, lp)[0].reshape(-1)])

    def want() -> torch.Tensor:
        log_s = ((lp - old) * mask).sum(1) / mask.sum(1)
        s = log_s.exp()
        loss = -torch.minimum(s * seq_adv, s.clamp(0.95, 1.07) * seq_adv).mean()
        return torch.cat([loss.reshape(1), torch.autograd.grad(loss, lp)[0].reshape(-1)])

    assert_float64_close(got, want, f"loss and gradient; seed={seed}")


def test_cispo_by_hand_keeps_gradient_of_clipped_tokens():
    lp = t([-1.0, -2.0], grad=True)
    old = t([-1.5, -1.9])  # log ratios 0.5 (weight clipped to 1.2) and -0.1
    adv = t([1.0, -1.0])
    mask = torch.tensor([True, True])
    out = policy_loss(lp, old, adv, mask, surrogate="cispo", clip_low=1.0, clip_high=0.2)
    w1 = math.exp(-0.1)
    assert out.loss.item() == pytest.approx((-1.2 * 1 * -1.0 + -w1 * -1.0 * -2.0) / 2, abs=HAND)
    (grad,) = torch.autograd.grad(out.loss, lp)
    # REINFORCE with a stop-gradient weight: -w A / 2, nonzero even where the weight was clipped
    assert grad.tolist() == pytest.approx([-1.2 / 2, w1 / 2], abs=HAND)
    assert out.metrics.clip_fraction.item() == 0.5


def test_truncated_importance_sampling_by_hand():
    lp = t([-1.0, -1.0], grad=True)
    old = t([-1.0, -1.0])
    rollout = t([-1.5, -0.8])  # π_old / π_rollout = e^0.5 = 1.6487 → capped at 1.5; e^-0.2
    adv = t([1.0, 1.0])
    mask = torch.tensor([True, True])
    out = policy_loss(lp, old, adv, mask, surrogate="clip", rollout_logprobs=rollout, tis_cap=1.5)
    w1 = math.exp(-0.2)
    assert out.loss.item() == pytest.approx((-1.5 - w1) / 2, abs=HAND)
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad.tolist() == pytest.approx([-1.5 / 2, -w1 / 2], abs=HAND)
    assert out.metrics.tis_clip_fraction.item() == 0.5
    assert out.metrics.tis_weight_mean.item() == pytest.approx((1.5 + w1) / 2, abs=HAND)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(lp, old, adv, mask, tis_cap=2.0)


def test_kl_and_entropy_terms_by_hand():
    lp = t([[-1.0, -2.0, -0.3]], grad=True)
    adv = t([[0.5, 0.5, 0.5]])
    ref = t([[-1.5, -2.0, -9.0]])  # the last token is masked: its huge KL must not count
    ent = t([[2.0, 3.0, 100.0]], grad=True)
    mask = torch.tensor([[True, True, False]])
    out = policy_loss(
        lp, lp.detach(), adv, mask, surrogate="clip", agg="seq-mean-token-mean",
        ref_logprobs=ref, kl_coef=0.1, kl_estimator="k3", entropy=ent, entropy_coef=0.01,
    )  # fmt: skip
    k3 = math.exp(-0.5) - 1 + 0.5  # log r = ref - lp = -0.5 on token 0, 0 on token 1
    want = (-0.5 + 0.1 * k3 - 0.01 * 2.0 + -0.5 + 0.0 - 0.01 * 3.0) / 2
    assert out.loss.item() == pytest.approx(want, abs=HAND)
    assert out.metrics.kl_loss.item() == pytest.approx(k3 / 2, abs=HAND)
    assert out.metrics.entropy.item() == pytest.approx(2.5, abs=HAND)
    g_lp, g_ent = torch.autograd.grad(out.loss, (lp, ent))
    # d k3 / d lp = 1 - exp(ref - lp)
    assert g_lp.tolist()[0] == pytest.approx(
        [(-0.5 + 0.1 * (1 - math.exp(-0.5))) / 2, -0.5 / 2, 0.0], abs=HAND
    )
    assert g_ent.tolist() == [[-0.01 / 2, -0.01 / 2, 0.0]]


def test_aggregation_modes_by_hand():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert aggregate(x, mask, agg="token-mean").item() == pytest.approx(7 / 3, abs=HAND)
    assert aggregate(x, mask, agg="seq-mean-token-sum").item() == pytest.approx(3.5, abs=HAND)
    assert aggregate(x, mask, agg="seq-mean-token-mean").item() == pytest.approx(2.75, abs=HAND)
    got = aggregate(x, mask, agg="seq-mean-token-sum-norm", norm_length=3)
    assert got.item() == pytest.approx(7 / 6, abs=HAND)
    assert aggregate(x, mask, agg="token-mean", denominator=10).item() == pytest.approx(
        0.7, abs=HAND
    )
    assert aggregate(x, mask, agg="seq-mean-token-sum", denominator=4).item() == pytest.approx(
        1.75, abs=HAND
    )
    # the same tokens packed in one row, sequences from sequence_index
    flat = x.reshape(1, 9)
    index = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, -1]])
    for agg, want in [("seq-mean-token-sum", 3.5), ("seq-mean-token-mean", 2.75)]:
        got = aggregate(flat, mask.reshape(1, 9), agg=agg, sequence_index=index)
        assert got.item() == pytest.approx(want, abs=HAND), agg
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(x, mask, agg="seq-mean-token-sum-norm")


def test_micro_batches_with_step_denominators_sum_to_the_full_batch_loss(rng):
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(6, 5, generator=gen, dtype=torch.float64)
    old = lp + 0.2 * torch.randn(6, 5, generator=gen, dtype=torch.float64)
    adv = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) < 0.6
    mask[:, 0] = True
    for agg in AGGS:
        denominator = mask.sum() if agg == "token-mean" else 6

        def parts(agg=agg, denominator=denominator) -> torch.Tensor:
            return sum(
                policy_loss(
                    lp[rows], old[rows], adv[rows], mask[rows], agg=agg, norm_length=5,
                    denominator=denominator,
                ).loss
                for rows in (slice(0, 2), slice(2, 5), slice(5, 6))
            )  # fmt: skip

        def full(agg=agg) -> torch.Tensor:
            return policy_loss(lp, old, adv, mask, agg=agg, norm_length=5).loss

        assert_float64_close(parts, full, f"{agg}; seed={seed}")


@pytest.mark.parametrize("surrogate", SURROGATES)
@pytest.mark.parametrize("agg", AGGS)
def test_masked_tokens_get_exactly_zero_gradient(rng, surrogate, agg):
    """Poison masked positions (NaN old logprobs/advantages/ref/entropy, huge logprobs): the loss
    stays finite and their gradients are exactly 0, with every optional term switched on."""
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    mask = torch.rand(shape, generator=gen) < 0.5
    mask[:, 0] = True
    mask[1] = False  # a fully masked sequence too
    lp = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    lp = torch.where(mask, lp, 500.0).requires_grad_()
    ent = torch.rand(shape, generator=gen, dtype=torch.float64).requires_grad_()
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    poison = lambda x: torch.where(mask, x, nan)  # noqa: E731
    noise = lambda: torch.randn(shape, generator=gen, dtype=torch.float64)  # noqa: E731
    out = policy_loss(
        lp, poison(lp.detach() + 0.3 * noise()), poison(noise()), mask, surrogate=surrogate,
        clip_low=0.2, clip_high=0.28, agg=agg, norm_length=6, ref_logprobs=poison(lp.detach()
        + noise()), kl_coef=0.1, entropy=torch.where(mask, ent, nan), entropy_coef=0.01,
        rollout_logprobs=poison(lp.detach() + 0.1 * noise()), tis_cap=2.0,
    )  # fmt: skip
    assert torch.isfinite(out.loss), f"seed={seed}"
    assert all(torch.isfinite(v) for v in out.metrics), f"{out.metrics} seed={seed}"
    g_lp, g_ent = torch.autograd.grad(out.loss, (lp, ent))
    assert (g_lp[~mask] == 0).all() and (g_ent[~mask] == 0).all(), f"seed={seed}"
    assert (g_ent[mask] != 0).all(), f"seed={seed}"


@pytest.mark.parametrize("surrogate", SURROGATES)
def test_on_policy_gradient_is_the_plain_policy_gradient(rng, surrogate):
    """At ratio 1 (π_θ = π_old) every surrogate's gradient is the REINFORCE gradient
    -Â ∇log π, weighted by the aggregation: token-mean 1/N; seq-mean-token-mean 1/(S|o_i|)."""
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    mask = torch.rand(3, 5, generator=gen) < 0.7
    mask[:, 0] = True
    seq_adv = torch.randn(3, 1, generator=gen, dtype=torch.float64)
    adv = seq_adv.expand(3, 5)
    for agg in ("token-mean", "seq-mean-token-mean"):
        out = policy_loss(lp, lp.detach(), adv, mask, surrogate=surrogate, agg=agg, clip_low=0.2)

        def grad(agg=agg) -> torch.Tensor:
            loss = policy_loss(
                lp, lp.detach(), adv, mask, surrogate=surrogate, agg=agg, clip_low=0.2
            ).loss
            return torch.autograd.grad(loss, lp)[0]

        def want(agg=agg) -> torch.Tensor:
            if agg == "token-mean":
                return -adv * (mask / mask.sum())
            return -adv * (mask / mask.sum(1, keepdim=True) / 3)

        assert_float64_close(grad, want, f"{agg}; seed={seed}")
        assert out.metrics.ratio_mean.item() == 1.0  # exp(0) = 1, averaged: exact
        assert out.metrics.clip_fraction.item() == 0.0


def test_invalid_arguments_are_refused():
    x = t([-1.0])
    mask = torch.tensor([True])
    with pytest.raises(ValueError, match="unknown surrogate"):
        policy_loss(x, x, x, mask, surrogate="reinforce++")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shapes differ"):
        policy_loss(x, t([-1.0, -2.0]), x, mask)


def test_value_loss_by_hand():
    v = t([1.0, 0.85], grad=True)
    old = t([0.8, 0.9])
    returns = t([2.0, 0.0])
    mask = torch.tensor([True, True])
    out = value_loss(v, old, returns, mask, clip_range=0.1)
    # token 0: (1 - 2)² = 1 vs clipped V 0.9: (0.9 - 2)² = 1.21 → the clipped one, no gradient
    # token 1: (0.85)² vs clipped V 0.85 (inside the range): equal → the plain one
    assert out.loss.item() == pytest.approx((0.5 * 1.21 + 0.5 * 0.85**2) / 2, abs=HAND)
    (grad,) = torch.autograd.grad(out.loss, v)
    assert grad.tolist() == pytest.approx([0.0, 0.85 / 2], abs=HAND)
    assert out.clip_fraction.item() == 0.5
    plain = value_loss(v, old, returns, mask, clip_range=None)
    assert plain.loss.item() == pytest.approx((0.5 * 1.0 + 0.5 * 0.85**2) / 2, abs=HAND)


def test_value_loss_masked_positions_get_zero_gradient(rng):
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 8, generator=gen) < 0.5
    mask[:, 0] = True
    values = torch.where(mask, torch.randn(3, 8, generator=gen, dtype=torch.float64), 1e300)
    values.requires_grad_()
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    old = torch.where(mask, values.detach() + 0.1, nan)
    returns = torch.where(mask, torch.randn(3, 8, generator=gen, dtype=torch.float64), nan)
    out = value_loss(values, old, returns, mask, clip_range=0.2, agg="seq-mean-token-mean")
    assert torch.isfinite(out.loss), f"seed={seed}"
    (grad,) = torch.autograd.grad(out.loss, values)
    assert (grad[~mask] == 0).all() and torch.isfinite(grad).all(), f"seed={seed}"
