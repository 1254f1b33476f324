"""Which objectives are correct for off-policy samples: ``check_in_flight_objective``.

A sample is off-policy when the policy that sampled it is not the learner's current one: the
loop trains on samples up to ``max_version_lag`` versions old, and under the engine's
``in_flight: partial`` rule one trajectory's tokens come from several versions. The objective
that stays correct there is the decoupled PPO objective (Hilton et al. 2022, "Batch
size-invariance for policy optimization"; as AReaL uses it for interruptible generation, Fu et
al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning"): three policies per
token, the *behaviour* policy that sampled it (its logprob is the rollout's, recorded per
token), the *proximal* policy the ratio is clipped around (the learner's own weights before the
update: ``old_logprobs: recompute``), and π_θ. Each token's term is weighted by
``π_prox / π_behav`` (here truncated at ``tis_cap``: ``policy_loss``'s TIS weight, computed per
token from the rollout logprobs). With ``old_logprobs: rollout`` the ratio would be clipped
around a mixture of stale policies, and without the IS weight the gradient would follow the
behaviour policies' token distribution uncorrected; both are refused here.
"""

from __future__ import annotations

from typing import Literal

from agentrl._config import short_repr
from agentrl._errors import ConfigError

from ._config import AlgorithmConfig

InFlightRule = Literal["finish", "abort", "partial"]
IN_FLIGHT_RULES: tuple[str, ...] = ("finish", "abort", "partial")


def check_in_flight_objective(
    in_flight: str, algorithm: AlgorithmConfig, *, max_version_lag: int = 0
) -> None:
    """Refuse an objective that is wrong for the samples the loop will train on.

    ``in_flight``: the engine's rule (``engine.in_flight``); ``max_version_lag``: how many
    versions older than the learner a consumed sample may be (0: synchronous training). Under
    ``partial`` or a lag above 0 the algorithm needs ``old_logprobs: recompute`` and a
    ``tis_cap`` (the decoupled objective, see the module docs); ``ConfigError`` naming the
    fields otherwise. Synchronous ``finish``/``abort`` training accepts every objective."""
    if in_flight not in IN_FLIGHT_RULES:
        raise ConfigError(
            f"engine.in_flight: expected one of {', '.join(IN_FLIGHT_RULES)}, "
            f"got {short_repr(in_flight)}"
        )
    if max_version_lag < 0:
        raise ConfigError(f"max_version_lag must be >= 0, got {max_version_lag}")
    if in_flight == "partial":
        why = "engine.in_flight: partial continues trajectories across weight versions"
    elif max_version_lag > 0:
        why = f"max_version_lag: {max_version_lag} trains on samples from older versions"
    else:
        return
    missing = []
    if algorithm.old_logprobs != "recompute":
        missing.append(
            f"algorithm.old_logprobs: recompute (got {algorithm.old_logprobs!r}: the ratio "
            "must be clipped around one proximal policy, the learner's own before the update)"
        )
    if algorithm.tis_cap is None:
        missing.append(
            "algorithm.tis_cap (e.g. 2.0: each token's importance weight π_prox/π_behav "
            "against the rollout's logprobs, truncated)"
        )
    if missing:
        raise ConfigError(
            f"{why}; its objective is decoupled PPO, which needs " + " and ".join(missing)
        )
