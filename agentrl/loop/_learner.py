"""The learner role: takes each step's groups from the buffer, decides what it trains on,
updates, and hands the weights to the checkpointer and the publisher.

Step ``s`` (the learner holds version ``v``; the engines hold ``v`` too once it is published):

1. *Admission*: the groups of steps up to ``s + k`` are started (``k = train.max_version_lag``
   in async mode, 0 in sync mode), so actors sample ahead while this step trains, never more
   than ``k`` versions ahead.
2. *Collect* the step's groups (``train.partial_groups``): wait for them (at most
   ``train.group_timeout_s`` under drop/fill; the groups still running then are cancelled);
   each group gets a *fate*: ``trained``; ``stale`` (sampled more than ``k`` versions ago, or
   by a version newer than the learner's — weights this run never published, e.g. a server
   another run updated: never trained on); ``dropped`` (a failed member, under drop/fill);
   ``timed_out``; ``filtered`` (dynamic sampling: no reward signal); ``surplus`` (DAPO
   refill: beyond ``tasks_per_step``); a trained group's trajectory the overlong filter masks
   is written as ``overlong``. With several ranks each collection gathers every rank's groups; it is
   also where a stop signal one rank received reaches all of them (``StopAgreed``).
   ``fill`` samples as many fresh tasks once in place of the dropped and timed-out groups;
   ``train.refill_rounds`` samples fresh tasks until enough groups carry a reward signal.
3. *Train* (in a worker thread: the actors keep the event loop), then *publish* version
   ``v + 1``; then the step's task slots are settled, its trajectories (each with its fate in
   ``info``) and its ledger record are written together, and last the *checkpoint* is saved
   when due (``_Runtime._commit``: it records the run files with this step in them; in sync
   mode the next step's groups are started only after it, so nothing is in flight then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from agentrl._types import Trajectory

from ._buffer import Group
from ._ranks import gather, merge_stats, rank_world


@dataclass
class GroupView:
    """A group as every rank sees it (picklable: gathered over the ranks)."""

    slot: int
    task_id: str
    version: int
    timed_out: bool
    trajectories: list[Trajectory]
    mine: bool = False
    fate: str = ""
    lag: int = 0

    @property
    def failed(self) -> bool:
        return self.timed_out or any(t.status == "error" for t in self.trajectories)

    @property
    def informative(self) -> bool:
        rewards = {float(t.reward) for t in self.trajectories if t.reward is not None}
        return len(rewards) > 1


@dataclass
class StepData:
    """What one step collected."""

    views: list[GroupView] = field(default_factory=list)
    primary: list[int] = field(default_factory=list)
    """The step's own task slots (``task_ids`` in the ledger)."""
    extra: list[int] = field(default_factory=list)
    """Slots sampled for this step in fill and refill rounds."""
    refill_rounds: int = 0
    fill_rounds: int = 0
    wait_s: float = 0.0
    sampling_s: float = 0.0
    """The wall time the step's samples had to be made in: the collection itself when
    sampling waits for the learner (sync), else the time since the previous step's collection
    ended (async: the actors sample while the learner trains). What ``gen_tokens_per_s``
    divides by."""

    @property
    def trained(self) -> list[GroupView]:
        return [v for v in self.views if v.fate == "trained"]


def assign_fates(
    views: list[GroupView],
    version: int,
    max_lag: int,
    rule: str,
    *,
    keep_informative: int | None,
    dynamic_sampling: bool = False,
) -> None:
    """Give every undecided group its fate (see the module docs). ``dynamic_sampling``: a
    group without a reward signal is ``filtered`` (the learner's dynamic sampling would train
    nothing of it); ``keep_informative``: DAPO refill — only groups with a reward signal are
    trained, at most this many in all."""
    dynamic_sampling = dynamic_sampling or keep_informative is not None
    kept = sum(1 for v in views if v.fate == "trained")
    for view in views:
        if view.fate:
            continue
        view.lag = version - view.version
        if view.timed_out:
            view.fate = "timed_out"
        elif view.lag > max_lag or view.lag < 0:  # < 0: weights this run never published
            view.fate = "stale"
        elif view.failed and rule != "wait":
            view.fate = "dropped"
        elif dynamic_sampling and not view.informative:
            view.fate = "filtered"
        elif keep_informative is not None and kept >= keep_informative:
            view.fate = "surplus"
        else:
            view.fate = "trained"
            kept += 1


class StopAgreed(Exception):
    """The ranks stop together: some were signalled (``ranks``). Raised on every rank at the
    collection where they told the others, before anything of that step is written."""

    def __init__(self, ranks: list[int]) -> None:
        names = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        super().__init__(f"{names} received a stop signal" if ranks else "a rank stopped")
        self.ranks = ranks


def views_of(
    groups: list[Group], stopping: bool = False, signalled: bool = False
) -> tuple[list[GroupView], list[int] | None]:
    """Every rank's groups (``groups`` are this rank's), in slot order, and, when some rank
    is ``stopping`` (it sends no groups), the ranks that were ``signalled`` (else None)."""
    mine = [
        GroupView(g.slot, str(g.task.id), g.version, g.timed_out, g.trajectories)
        for g in ([] if stopping else groups)
    ]
    rank = rank_world()[0]
    everyone = gather((rank, mine, stopping, signalled))
    out = []
    for owner, part, _, _ in everyone:
        for view in part:
            view.mine = owner == rank
            out.append(view)
    out.sort(key=lambda v: v.slot)
    if not any(stops for _, _, stops, _ in everyone):
        return out, None
    return out, [r for r, _, _, told in everyone if told]


async def wait_groups(groups: list[Group], timeout_s: float | None) -> None:
    """Wait for ``groups`` (at most ``timeout_s``); the ones still running then are
    cancelled and marked ``timed_out``."""
    with anyio.move_on_after(float("inf") if timeout_s is None else timeout_s):
        for group in groups:
            await group.done.wait()
    late = [g for g in groups if not g.done.is_set()]
    for group in late:
        group.timed_out = True
        group.scope.cancel()
    for group in late:
        await group.done.wait()


class LearnerRole:
    """One step at a time: admit, collect, train, publish, record, checkpoint."""

    def __init__(self, cfg: Any, learner: Any, actor: Any, buffer: Any, tasks: Any) -> None:
        self.cfg, self.learner, self.actor, self.buffer, self.tasks = (
            cfg,
            learner,
            actor,
            buffer,
            tasks,
        )
        self.max_lag = cfg.train.max_version_lag if cfg.train.mode == "async" else 0
        self.submitted = 0
        self.primary: dict[int, list[int]] = {}
        self.busy_s = 0.0
        self.sampling_started: float | None = None
        self.collected_at: float | None = None
        """When the last collection ended (None before the first: sampling starts then)."""
        alg = learner.settings.algorithm
        self.refill = cfg.train.refill_rounds if alg.dynamic_sampling else 0
        self.stop: anyio.Event | None = None
        """Several ranks: set once this rank or another was signalled (each collection is
        where they agree to stop)."""
        self.signalled: anyio.Event | None = None
        """Several ranks: this rank's own stop signal."""

    def admit(self, step: int) -> None:
        """Start the groups of every step up to ``step + k`` not started yet."""
        self.submitted = max(self.submitted, step - 1)
        last = min(step + self.max_lag, self.cfg.train.max_steps)
        if self.sampling_started is None and self.submitted < last:
            self.sampling_started = time.perf_counter()
        while self.submitted < last:
            self.submitted += 1
            self.primary[self.submitted] = self.actor.submit(
                self.submitted, self.cfg.train.tasks_per_step
            )

    async def collect(self, step: int) -> StepData:
        started = time.perf_counter()
        data = StepData(primary=self.primary.pop(step))
        block = self.buffer.block(step)
        await self._round(data, list(block.groups))
        if self.cfg.train.partial_groups == "fill":
            missing = sum(v.fate in ("dropped", "timed_out") for v in data.views)
            if missing:
                data.fill_rounds = 1
                await self._extra_round(data, step, missing)
        want = self.cfg.train.tasks_per_step
        while data.refill_rounds < self.refill:
            need = want - len(data.trained)
            if need <= 0:
                break
            data.refill_rounds += 1
            await self._extra_round(data, step, need)
        self.buffer.take(step)
        ended = time.perf_counter()
        data.wait_s = ended - started
        since = self.collected_at or self.sampling_started or started
        data.sampling_s = data.wait_s if self.max_lag == 0 else ended - since
        self.collected_at = ended
        return data

    async def _extra_round(self, data: StepData, step: int, n: int) -> None:
        before = len(self.buffer.block(step).groups)
        data.extra += self.actor.submit(step, n)
        await self._round(data, self.buffer.block(step).groups[before:])

    async def _round(self, data: StepData, groups: list[Group]) -> None:
        rule = self.cfg.train.partial_groups
        timeout_s = self.cfg.train.group_timeout_s if rule != "wait" else None
        if self.stop is None:
            await wait_groups(groups, timeout_s)
            views, _ = views_of(groups)
        else:
            views = await self._agreed_round(groups, timeout_s, self.stop)
        keep = self.cfg.train.tasks_per_step if self.refill else None
        alg = self.learner.settings.algorithm
        assign_fates(
            views,
            self.learner.version,
            self.max_lag,
            rule,
            keep_informative=keep,
            dynamic_sampling=bool(alg.dynamic_sampling),
        )
        data.views += views
        by_slot = {g.slot: g for g in groups}
        for view in views:
            if view.mine:
                group = by_slot[view.slot]
                kept = [t for t in group.trajectories if not self._overlong(t)]
                tokens = sum(sum(t.loss_mask) for t in kept)
                self.buffer.consumed(group, view.fate, view.lag, tokens=tokens)

    def _overlong(self, traj: Trajectory) -> bool:
        """Whether the algorithm's overlong filter masks ``traj`` out of training."""
        from agentrl.trainer import overlong_filter

        return bool(self.learner.settings.algorithm.overlong_filter) and (
            overlong_filter([traj]) == [0.0]
        )

    async def _agreed_round(
        self, groups: list[Group], timeout_s: float | None, stop: anyio.Event
    ) -> list[GroupView]:
        """Several ranks: wait for the groups unless ``stop`` is set first; every rank then
        learns whether any rank stops (``StopAgreed`` on all of them). The gather runs in a
        thread, so a second signal still aborts a rank that waits for the others there."""

        async def wait_then_end(scope: anyio.CancelScope) -> None:
            await wait_groups(groups, timeout_s)
            scope.cancel()

        if not stop.is_set():
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_then_end, tg.cancel_scope)
                await stop.wait()
                tg.cancel_scope.cancel()
        stopping = stop.is_set()
        signalled = self.signalled is not None and self.signalled.is_set()
        views, stopped = await anyio.to_thread.run_sync(
            views_of, groups, stopping, signalled, abandon_on_cancel=True
        )
        if stopped is not None:
            raise StopAgreed(stopped)
        return views

    async def train(self, data: StepData) -> dict[str, Any]:
        """Update on this rank's trained groups (in a worker thread); the merged statistics."""
        mine = [t for v in data.trained if v.mine for t in v.trajectories]
        t0 = time.perf_counter()
        stats = await anyio.to_thread.run_sync(self.learner.train_step, mine)
        self.busy_s += time.perf_counter() - t0
        return merge_stats(gather(stats.as_dict()))

    def settle(self, data: StepData, step: int) -> list[Trajectory]:
        """Mark the step's slots settled; its trajectories, each with its fate and step."""
        self.tasks.settle([v.slot for v in data.views])
        out = []
        for view in data.views:
            for traj in view.trajectories:
                fate = "overlong" if view.fate == "trained" and self._overlong(traj) else view.fate
                traj.info = {**traj.info, "fate": fate, "step": str(step)}
                out.append(traj)
        return out
