"""Actors: drive trajectory state machines on the engines, one group per task slot.

``Actor.submit(step, n)`` takes ``n`` task slots from the ``TaskLedger`` and starts their groups
(this rank's share) in the actor's task group; each finished group goes into the
``TrajectoryBuffer`` under the step it was started for. Every trajectory carries the policy
version that sampled it (``Trajectory.policy_version``, set by the rollout from the engine's
result); group ids carry the slot (``env/task@slot``), so trajectory ids are unique within a
run, and a slot's samples are seeded from the slot (a slot sampled again samples the same).

Admission (bounded staleness) is the learner's to decide (``LearnerRole`` submits step
``s + j`` only for ``j ≤ max_version_lag``); the actor runs what it is given, at most
``rollout.concurrency`` trajectories at once, and measures its busy time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from agentrl._rollout import RolloutContext, derive_seed, run_trajectory

from ._buffer import Group, TrajectoryBuffer
from ._ranks import shard
from ._tasks import TaskLedger, TaskStream


class Actor:
    def __init__(
        self,
        ctx: RolloutContext,
        stream: TaskStream,
        tasks: TaskLedger,
        buffer: TrajectoryBuffer,
    ) -> None:
        self.ctx, self.stream, self.tasks, self.buffer = ctx, stream, tasks, buffer
        self.limiter = anyio.CapacityLimiter(ctx.config.concurrency)
        if ctx.tool_limiter is None:
            ctx.tool_limiter = anyio.CapacityLimiter(ctx.config.tool_threads)
        self.version = 0
        """The policy version the engines hold (the publisher sets it)."""
        self._tg: anyio.abc.TaskGroup | None = None
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._running = 0

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Actor]:
        """The actor's task group; leaving it cancels whatever still runs (in-flight groups are
        then never settled: a resumed run samples their slots again)."""
        from agentrl._tool_process import open_tool_processes

        async with (
            open_tool_processes(self.ctx.config.tool_processes) as processes,
            anyio.create_task_group() as tg,
        ):
            self.ctx.tool_processes = processes  # isolation="process" tools' workers
            self._tg = tg
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()
                self._tg = None
                self.ctx.tool_processes = None

    def submit(self, step: int, n: int) -> list[int]:
        """Start ``n`` fresh task slots for ``step``; returns every slot (all ranks')."""
        assert self._tg is not None, "submit inside running()"
        slots = self.tasks.take(n)
        for slot in shard(slots):
            group = Group(slot, self.stream.at(slot), step, self.version)
            self.buffer.started(group)
            self._tg.start_soon(self._run_group, group)
        return slots

    async def _run_group(self, group: Group) -> None:
        self._enter()
        try:
            with group.scope:
                async with anyio.create_task_group() as tg:
                    for sample in range(self.ctx.config.group_size):
                        tg.start_soon(self._one, group, sample)
        finally:
            group.trajectories.sort(key=lambda t: t.sample_index)
            self._leave()
            self.buffer.finished(group)

    async def _one(self, group: Group, sample: int) -> None:
        task, ctx = group.task, self.ctx
        seed = derive_seed(ctx.config.seed, "train", group.slot, sample)
        group_id = f"{ctx.spec.id}/{task.id}@{group.slot}"
        traj = await run_trajectory(
            ctx, task, group_id=group_id, sample_index=sample, seed=seed, slot=self.limiter
        )
        group.trajectories.append(traj)

    def _enter(self) -> None:
        if self._running == 0:
            self._busy_since = time.perf_counter()
        self._running += 1

    def _leave(self) -> None:
        self._running -= 1
        if self._running == 0 and self._busy_since is not None:
            self._busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None

    def busy_s(self) -> float:
        """Seconds with at least one group running, since the start."""
        now = self._busy_s
        if self._busy_since is not None:
            now += time.perf_counter() - self._busy_since
        return now


def actor_context(base: RolloutContext, seed: Any) -> RolloutContext:
    """The training rollouts' context: the run's rollout config under its training seed."""
    config = base.config.model_copy(update={"seed": derive_seed(seed, "train-rollouts")})
    return dataclasses.replace(base, config=config)
