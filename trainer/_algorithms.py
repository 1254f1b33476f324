"""The algorithm table: one row per RL algorithm, the only place that names them.

A row (``AlgorithmSpec``) holds everything the config and the learner need to know about an
algorithm: its advantage estimator (a group estimator over one reward per trajectory, or GAE with
a critic), its surrogate (the loss family ``policy_loss`` computes), the defaults of the settings
``AlgorithmConfig`` leaves unset (ratio clip, aggregation, DAPO's sampling filters, the KL
coefficient), and from those what it needs: groups of samples, a critic, a frozen reference.
The config validates ``algorithm.name`` against this table, ``AlgorithmConfig.resolved()`` fills
defaults from it, the learner opens a critic and a reference and picks the estimator and the
surrogate from it, and the configuration reference (``docs/reference/config.md``) prints it.

Adding an algorithm is one ``register_algorithm`` call (a new estimator is a function
``(rewards [S], group_index [S]) -> advantages [S]``; a new surrogate also needs a branch in
``policy_loss`` and the fused kernel).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Literal, get_args

from ._names import Aggregation, Surrogate

if TYPE_CHECKING:
    import torch

GroupEstimator = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
"""``(rewards [S] float64, group_index [S] int64) -> advantages [S]``: one advantage per
trajectory, broadcast onto its sampled tokens."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: how advantages are estimated, which surrogate is minimized, the defaults of
    the settings an ``AlgorithmConfig`` leaves unset, and what the learner must open for it."""

    name: str
    """What ``algorithm.name`` says (lowercase letters, digits, ``_`` and ``-``)."""
    summary: str
    """One line for the reference: what the algorithm is, with its paper."""
    advantages: GroupEstimator | Literal["gae"]
    """A group estimator, or ``"gae"``: generalized advantage estimation over the sampled tokens
    with a learned critic (the learner then opens one)."""
    surrogate: Surrogate
    """The loss family (``policy_loss``'s ``surrogate``): ``clip`` (PPO's clipped ratio),
    ``gspo`` (the sequence-level ratio) or ``cispo`` (clipped IS-weight REINFORCE)."""
    clip_low: float
    """Default ε_low of the ratio clip."""
    clip_high: float
    """Default ε_high of the ratio clip."""
    agg: Aggregation
    """Default loss aggregation."""
    dynamic_sampling: bool = False
    """Default of ``algorithm.dynamic_sampling`` (drop groups whose rewards are all equal)."""
    overlong_filter: bool = False
    """Default of ``algorithm.overlong_filter`` (mask trajectories cut by a length limit)."""
    kl_coef: float = 0.0
    """Default β of the KL to the frozen reference (> 0: the learner opens the reference)."""

    @property
    def needs_critic(self) -> bool:
        """GAE needs a value model next to the policy."""
        return self.advantages == "gae"

    @property
    def needs_groups(self) -> bool:
        """A group estimator needs several samples per task (``rollout.group_size >= 2``)."""
        return not self.needs_critic

    @property
    def estimator_name(self) -> str:
        """How the reference names the estimator: ``gae`` or the function's name."""
        if self.advantages == "gae":
            return "gae"
        return getattr(self.advantages, "__name__", repr(self.advantages))


_SURROGATES: tuple[Surrogate, ...] = get_args(Surrogate)


class _BuiltinEstimator:
    """A group estimator of ``_advantages`` by name, imported at its first call: the table (and
    with it the config's check of ``algorithm.name``) loads without torch."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return getattr(import_module("._advantages", __package__), self.__name__)(rewards, groups)

    def __repr__(self) -> str:
        return f"<group estimator {self.__name__}>"


_GRPO = _BuiltinEstimator("grpo_advantages")
_DR_GRPO = _BuiltinEstimator("dr_grpo_advantages")
_RLOO = _BuiltinEstimator("rloo_advantages")
_lock = threading.Lock()
_table: dict[str, AlgorithmSpec] = {}


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add ``spec`` to the table. Registering an equal spec again is a no-op; another spec under
    a registered name is a ``ValueError`` (so is a malformed row)."""
    if not spec.name or not all(c.isalnum() or c in "_-" for c in spec.name):
        raise ValueError(f"algorithm name {spec.name!r}: use letters, digits, '_' and '-'")
    if spec.surrogate not in _SURROGATES:
        raise ValueError(
            f"algorithm {spec.name!r}: unknown surrogate {spec.surrogate!r} "
            f"(expected one of {', '.join(_SURROGATES)})"
        )
    if spec.advantages != "gae" and not callable(spec.advantages):
        raise ValueError(f"algorithm {spec.name!r}: advantages must be 'gae' or a function")
    if spec.clip_low <= 0 or spec.clip_high <= 0 or spec.kl_coef < 0:
        raise ValueError(f"algorithm {spec.name!r}: clips must be > 0 and kl_coef >= 0")
    with _lock:
        existing = _table.get(spec.name)
        if existing is not None and existing != spec:
            raise ValueError(f"algorithm {spec.name!r} is already registered")
        _table[spec.name] = spec
    return spec


def unregister_algorithm(name: str) -> None:
    """Remove ``name`` from the table (tests register throwaway algorithms)."""
    with _lock:
        _table.pop(name, None)


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The row for ``name``; ``ValueError`` listing the registered names otherwise."""
    try:
        return _table[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; registered: {', '.join(algorithm_names())}"
        ) from None


def algorithm_names() -> list[str]:
    """Registered names, in registration order (the built-ins first)."""
    with _lock:
        return list(_table)


for _spec in (
    AlgorithmSpec(
        name="grpo",
        summary="Group-relative advantages scaled by the group's std; clipped ratio "
        "(Shao et al. 2024, DeepSeekMath, eq. 3).",
        advantages=_GRPO,
        surrogate="clip",
        clip_low=0.2,
        clip_high=0.2,
        agg="seq-mean-token-mean",
    ),
    AlgorithmSpec(
        name="dr_grpo",
        summary="GRPO without the std division and without length normalization "
        "(Liu et al. 2025, Dr.GRPO).",
        advantages=_DR_GRPO,
        surrogate="clip",
        clip_low=0.2,
        clip_high=0.2,
        agg="seq-mean-token-sum-norm",
    ),
    AlgorithmSpec(
        name="dapo",
        summary="GRPO advantages with clip-higher, token-mean, dynamic sampling and the overlong "
        "filter (Yu et al. 2025, DAPO).",
        advantages=_GRPO,
        surrogate="clip",
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        dynamic_sampling=True,
        overlong_filter=True,
    ),
    AlgorithmSpec(
        name="gspo",
        summary="GRPO advantages with the sequence-level importance ratio "
        "(Zheng et al. 2025, GSPO).",
        advantages=_GRPO,
        surrogate="gspo",
        clip_low=3e-4,
        clip_high=4e-4,
        agg="seq-mean-token-mean",
    ),
    AlgorithmSpec(
        name="cispo",
        summary="REINFORCE with a clipped, stop-gradient IS weight; no lower bound "
        "(MiniMax-M1 2025, CISPO).",
        advantages=_GRPO,
        surrogate="cispo",
        clip_low=1.0,
        clip_high=0.28,
        agg="token-mean",
    ),
    AlgorithmSpec(
        name="rloo",
        summary="REINFORCE with a leave-one-out baseline: the clipped surrogate at ratio 1 "
        "(Ahmadian et al. 2024).",
        advantages=_RLOO,
        surrogate="clip",
        clip_low=0.2,
        clip_high=0.2,
        agg="token-mean",
    ),
    AlgorithmSpec(
        name="ppo",
        summary="GAE with a learned critic, advantages whitened over the step "
        "(Schulman et al. 2017).",
        advantages="gae",
        surrogate="clip",
        clip_low=0.2,
        clip_high=0.2,
        agg="token-mean",
    ),
):
    register_algorithm(_spec)
