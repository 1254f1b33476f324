"""Where training tasks come from and where each one went.

``TaskStream``: the env's training tasks as an endless, reproducible stream (epoch ``e`` is the
list shuffled with ``(seed, e)``); position ``i`` of the stream is the task's *slot*, and a
slot's samples are seeded from it, so a slot sampled again (after a resume) samples the same.

``TaskLedger``: which slots were handed out and which are *settled* (trained on, or discarded
as stale, dropped as a straggler or filtered: every one written to ``trajectories.jsonl`` with
its fate). A checkpoint records the settled ones; slots handed out but not settled when it was
written (in flight, or waiting in the buffer) are handed out again by the resumed run, first.
No slot is lost and none is settled twice.
"""

from __future__ import annotations

import random
from typing import Any

from agentrl._errors import ConfigError


class TaskStream:
    """The training tasks as an endless stream: epoch ``e`` is the task list shuffled with
    ``(seed, e)``; ``cursor`` counts tasks consumed, so a resumed run continues exactly."""

    def __init__(self, tasks: list[Any], seed: int) -> None:
        if not tasks:
            raise ConfigError("the environment has no training tasks")
        self.tasks, self.seed = tasks, seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.tasks)))
            random.Random(f"agentrl-tasks/{self.seed}/{epoch}").shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def at(self, slot: int) -> Any:
        """The task at stream position ``slot``."""
        size = len(self.tasks)
        return self.tasks[self._order(slot // size)[slot % size]]

    def take(self, cursor: int, n: int) -> list[Any]:
        return [self.at(i) for i in range(cursor, cursor + n)]


class TaskLedger:
    """Slots handed out and settled. ``state()`` / ``from_state`` round-trip through a
    checkpoint: ``low`` (every slot below it settled), ``settled`` (settled slots at or above
    it) and ``next`` (the first slot never handed out)."""

    def __init__(self, low: int = 0, settled: list[int] | None = None, nxt: int | None = None):
        self.low = low
        self.settled = set(settled or ())
        self.next = max(low, nxt if nxt is not None else low)
        # handed out before the checkpoint but never settled: hand them out again, first
        self.requeued = [s for s in range(self.low, self.next) if s not in self.settled]
        self.out: set[int] = set()

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, cursor: int) -> TaskLedger:
        if not state:
            return cls(cursor)
        return cls(int(state["low"]), [int(s) for s in state["settled"]], int(state["next"]))

    def take(self, n: int) -> list[int]:
        slots = self.requeued[:n]
        del self.requeued[:n]
        while len(slots) < n:
            slots.append(self.next)
            self.next += 1
        self.out.update(slots)
        return slots

    def settle(self, slots: list[int]) -> None:
        for slot in slots:
            if slot in self.settled or slot < self.low:
                raise AssertionError(f"task slot {slot} settled twice")
            self.out.discard(slot)
            self.settled.add(slot)
        while self.low in self.settled:
            self.settled.remove(self.low)
            self.low += 1

    def state(self) -> dict[str, Any]:
        return {"low": self.low, "settled": sorted(self.settled), "next": self.next}
