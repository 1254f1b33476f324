"""Off-policy samples (an async lag, or ``in_flight: partial`` trajectories spanning versions)
need the decoupled objective: the config check refuses the others, and ``policy_loss`` with
recomputed proximal logprobs and per-token TIS computes it token by token."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import unit_roundoff

from agentrl._errors import ConfigError
from agentrl.trainer import AlgorithmConfig, check_in_flight_objective, policy_loss

HAND = 32 * 16 * unit_roundoff(torch.float64)
DECOUPLED = AlgorithmConfig(old_logprobs="recompute", tis_cap=2.0)


@pytest.mark.parametrize(
    ("in_flight", "lag", "algorithm", "match"),
    [
        ("partial", 0, AlgorithmConfig(), "old_logprobs: recompute .* and algorithm.tis_cap"),
        ("partial", 0, AlgorithmConfig(old_logprobs="recompute"), "needs algorithm.tis_cap"),
        ("finish", 1, AlgorithmConfig(), "max_version_lag: 1 .*old_logprobs: recompute"),
        ("abort", 2, AlgorithmConfig(old_logprobs="recompute"), "max_version_lag: 2 .*tis_cap"),
        ("later", 0, DECOUPLED, "engine.in_flight: expected one of finish, abort, partial"),
        ("finish", -1, DECOUPLED, "max_version_lag must be >= 0"),
    ],
)
def test_wrong_objectives_for_off_policy_samples_are_refused(in_flight, lag, algorithm, match):
    with pytest.raises(ConfigError, match=match):
        check_in_flight_objective(in_flight, algorithm, max_version_lag=lag)


@pytest.mark.parametrize("in_flight", ["finish", "abort", "partial"])
@pytest.mark.parametrize("lag", [0, 1, 3])
def test_the_decoupled_objective_is_accepted_everywhere(in_flight, lag):
    check_in_flight_objective(in_flight, DECOUPLED, max_version_lag=lag)
    check_in_flight_objective(
        in_flight, DECOUPLED.model_copy(update={"name": "gspo"}), max_version_lag=lag
    )


@pytest.mark.parametrize("in_flight", ["finish", "abort"])
@pytest.mark.parametrize(
    "algorithm", [AlgorithmConfig(), AlgorithmConfig(old_logprobs="recompute")]
)
def test_synchronous_training_accepts_every_objective(in_flight, algorithm):
    check_in_flight_objective(in_flight, algorithm)  # max_version_lag 0


def test_policy_loss_is_the_decoupled_objective_on_tokens_of_two_versions():
    """One trajectory whose first two tokens version 0 sampled and last two version 1: each
    token's term is ``min(π_prox/π_behav, C) · min(r Â, clip(r) Â)`` with ``r = π_θ/π_prox``
    and its own behaviour logprob (float64 by hand, token-mean)."""
    behaviour = [-1.2, -0.7, -2.0, -0.4]  # the rollout's logprobs: versions 0, 0, 1, 1
    proximal = [-0.9, -0.8, -1.0, -0.5]  # recomputed by the learner before the update
    current = [-0.6, -0.8, -1.3, -0.1]  # π_θ
    adv, cap, eps = 1.0, 2.0, 0.2
    want = 0.0
    for b, p, c in zip(behaviour, proximal, current, strict=True):
        weight = min(math.exp(p - b), cap)  # e^0.3, e^-0.1, e^1.0 → capped at 2, e^-0.1
        r = math.exp(c - p)
        want -= weight * min(r * adv, min(max(r, 1 - eps), 1 + eps) * adv)
    want /= 4

    def t(values, grad=False):
        return torch.tensor([values], dtype=torch.float64, requires_grad=grad)

    out = policy_loss(
        t(current, grad=True),
        t(proximal),
        torch.full((1, 4), adv, dtype=torch.float64),
        torch.ones(1, 4, dtype=torch.bool),
        surrogate="clip",
        clip_low=eps,
        rollout_logprobs=t(behaviour),
        tis_cap=cap,
        kernels="torch",
    )
    assert out.loss.item() == pytest.approx(want, abs=HAND)
    assert out.metrics.tis_clip_fraction.item() == 0.25  # the third token's weight e^1 > 2
