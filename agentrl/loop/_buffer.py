"""The trajectory buffer between the actors and the learner, with its accounting.

Actors put finished *groups* (all samples of one task slot) into the buffer under the *block*
(the step) they were started for; the learner takes a block when it trains that step. The
buffer is bounded by construction: actors start a step's block only when the learner is at most
``max_version_lag`` steps behind it (``Actor`` admission), so (in flight + buffered) never
exceeds ``(k + 1) × tasks_per_step`` groups, plus the refills of the step being trained.

``BufferStats`` is the accounting the ledger reports: groups and tokens produced and consumed,
backlog, in flight, the version lag of what the learner took, and what it did not train on
(stale, dropped, timed out, filtered).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

from agentrl._types import Trajectory


@dataclass
class Group:
    """The samples of one task slot."""

    slot: int
    task: Any
    block: int
    """The step it was started for."""
    started_version: int
    """The engines' policy version when it started (its samples are at least this new)."""
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    trajectories: list[Trajectory] = field(default_factory=list)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)
    timed_out: bool = False

    @property
    def version(self) -> int:
        """The oldest policy version that sampled any of its tokens (staleness is measured by
        it); the start version while nothing was sampled."""
        versions = [t.policy_version for t in self.trajectories if t.num_turns > 0]
        return min(versions, default=self.started_version)

    @property
    def tokens(self) -> int:
        return sum(sum(t.loss_mask) for t in self.trajectories)


@dataclass
class Block:
    """One step's groups (its tasks, and any refill or fill groups started for it)."""

    step: int
    groups: list[Group] = field(default_factory=list)


@dataclass
class BufferStats:
    """Counters of one window: the interval's or the step's."""

    produced_groups: int = 0
    produced_tokens: int = 0
    consumed_groups: int = 0
    trained_tokens: int = 0
    fates: Counter[str] = field(default_factory=Counter)
    lags: Counter[int] = field(default_factory=Counter)
    ages: list[float] = field(default_factory=list)

    def as_dict(self, elapsed_s: float) -> dict[str, Any]:
        """Ledger fields: what the actors produced and what the learner did with it."""
        lags = sorted(self.lags.elements())
        return {
            "groups_produced": self.produced_groups,
            "generated_tokens": self.produced_tokens,
            "generated_tokens_per_s": self.produced_tokens / elapsed_s if elapsed_s > 0 else None,
            "groups_consumed": self.consumed_groups,
            "trained_tokens": self.trained_tokens,
            "groups_trained": self.fates["trained"],
            "groups_stale": self.fates["stale"],
            "groups_dropped": self.fates["dropped"],
            "groups_timed_out": self.fates["timed_out"],
            "groups_surplus": self.fates["surplus"] + self.fates["filtered"],
            "version_lag_hist": {str(k): v for k, v in sorted(self.lags.items())},
            "consumed_lag_max": lags[-1] if lags else None,
            "consumed_lag_mean": sum(lags) / len(lags) if lags else None,
            "sample_age_s_mean": sum(self.ages) / len(self.ages) if self.ages else None,
        }

    def consumed(self, group: Group, fate: str, lag: int, tokens: int) -> None:
        """``tokens``: the group's sampled tokens the learner trains on (those of trajectories
        the algorithm's overlong filter masks are not)."""
        self.consumed_groups += 1
        self.fates[fate] += 1
        if fate == "trained":
            self.lags[lag] += 1
            self.trained_tokens += tokens
            if group.finished is not None:
                self.ages.append(time.perf_counter() - group.finished)


class TrajectoryBuffer:
    """Blocks by step; groups in flight and finished; the accounting."""

    def __init__(self) -> None:
        self.blocks: dict[int, Block] = {}
        self.in_flight = 0
        self.backlog = 0
        self.windows = {"interval": BufferStats(), "step": BufferStats()}

    def block(self, step: int) -> Block:
        return self.blocks.setdefault(step, Block(step))

    def started(self, group: Group) -> None:
        self.block(group.block).groups.append(group)
        self.in_flight += 1

    def finished(self, group: Group) -> None:
        group.finished = time.perf_counter()
        self.in_flight -= 1
        if not group.timed_out:
            self.backlog += 1
            for stats in self.windows.values():
                stats.produced_groups += 1
                stats.produced_tokens += group.tokens
        group.done.set()

    def take(self, step: int) -> Block:
        """Remove the block of ``step`` (its groups leave the backlog as the learner settles
        them with ``consumed``)."""
        return self.blocks.pop(step, Block(step))

    def consumed(self, group: Group, fate: str, lag: int, *, tokens: int) -> None:
        if not group.timed_out:
            self.backlog -= 1
        for stats in self.windows.values():
            stats.consumed(group, fate, lag, tokens)

    def take_window(self, name: str) -> BufferStats:
        """The counters of window ``interval`` or ``step`` since its previous take."""
        window, self.windows[name] = self.windows[name], BufferStats()
        return window
