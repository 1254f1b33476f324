"""The training runtime: composes the roles from the config and runs the steps.

::

    TaskStream ─► Actor ──groups──► TrajectoryBuffer ──► LearnerRole ──► Publisher ──► engines
    (TaskLedger)  (rollouts on the      (blocks by step,     (fates, update,   (weights,    ▲
                   engines, scored       accounting)           records)          versions)  │
                   by the env's          ▲                          │                       │
                   verifiers)            └──── admission: steps ≤ s + k ◄──┘  Checkpointer   │
                      └──────────────────────── samples with ◄──────────────────────────────┘

One process holds everything (colocated): the embedded engine's worker thread samples, the
learner (DeepSpeed ZeRO-3) trains in a worker thread, the actor's trajectories and the
scorers (each env's ``reward``, sandbox-backed verifiers included) run on the event loop, so a
slow verifier holds no engine slot. With ``server.urls`` the engines are servers and the
publisher writes safetensors snapshots they load from disk. ``train.mode: sync`` is the
schedule ``max_version_lag = 0`` of the same runtime.

With several processes (``torchrun``, sync mode, on one node or many) the ranks split each
step's task slots and train data-parallel; rank 0 writes the run files, which must be on a
filesystem every rank sees (checked at start). With ``server.urls`` every rank samples its share
from the same servers and rank 0 alone publishes each version to them.

Resume (``resume=True``): the newest checkpoint restores the learner (its LR schedule keeps
the length it was made for), the RNG states, the task accounting, the policy version and the
count of steps without an update; the run files are cut back to their length at that
checkpoint, unsettled task slots are sampled again, and the engines get the checkpoint's
weights before sampling. In sync mode a resumed run repeats the uninterrupted one exactly. One
process writes a run folder at a time (``_runlock``: taken before the first write, held to the
end).

Stopping: ``stop`` (set by the command's Ctrl-C handler) cancels the step in progress (its
sampling, or its evaluation); nothing of that step is written, so the run is as if it had been
killed after its last complete step; with ``checkpoint.at_stop`` that step is then saved when
no checkpoint holds it yet, from the states recorded as it ended. With several ranks a stop
takes effect at a collection (``LearnerRole``), where every rank learns of it, so all of them
drop the same step and save together; a step that is training finishes first. After
``train.max_steps_without_update`` consecutive steps that trained on nothing the loop writes the
reason into that step's record and raises ``TrainingStalled``.
"""

from __future__ import annotations

import os
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from agentrl._errors import ConfigError, WriteError
from agentrl._outfiles import is_disk_full, write_file
from agentrl._rollout import RolloutContext
from agentrl._runner import cancel_when_set

from ._actors import Actor, actor_context
from ._buffer import TrajectoryBuffer
from ._checkpointer import (
    Checkpointer,
    check_out,
    check_resume,
    checkpoint_root,
    how_to_continue,
    last_idle_steps,
    prepare_out,
    restore_files,
    schedule_note,
    set_aside,
)
from ._config import TrainConfig, dump_config
from ._evaluator import Evaluator, sandbox_metrics
from ._files import RunFiles, check_dashboard
from ._learner import LearnerRole, StopAgreed
from ._publisher import EngineWeightSink, Publisher
from ._rank_publish import wrap_for_ranks
from ._ranks import barrier, check_shared_out, gather, raise_on_every_rank, rank_world
from ._records import (
    Clock,
    TrainingStalled,
    add_learner_stats,
    stall_reason,
    step_record,
    trained_on_nothing,
)
from ._runfiles import RunFileError
from ._runlock import RunLocks, lock_checkpoint_root, lock_run_folder
from ._tasks import TaskLedger, TaskStream
from ._trackers import Trackers, check_mlflow_store, check_trackers, open_trackers


@dataclass
class TrainResult:
    out: Path
    steps: int
    """Complete steps (each in the ledger)."""
    policy_version: int
    last_record: dict[str, Any]
    interrupted: bool = False
    """``stop`` was set: the step in progress was dropped (resume from ``checkpoint``)."""
    checkpoint: Path | None = None
    """The newest checkpoint when the loop ended."""
    resumed_from: Path | None = None
    """The checkpoint a resumed run started from."""


@dataclass
class _Ended:
    """The newest complete step no checkpoint holds: what a checkpoint of it records."""

    step: int
    version: int
    tasks: dict[str, Any]
    cursor: int
    idle_steps: int
    rng: dict[str, Any]
    """The generator states as the step ended (``agentrl.trainer.rng_state``)."""


@dataclass
class _Setup:
    """What is decided before any event-loop work: the model, the learner, where to resume."""

    cfg: TrainConfig
    out: Path
    spec: Any
    model_path: str
    tokenizer: Any
    fingerprint: str
    learner: Any
    lead: bool
    resume_from: Path | None = None
    step: int = 0
    tasks_state: dict[str, Any] = field(default_factory=dict)
    cursor: int = 0
    purge_step: int | None = None
    engine_options: Any = None
    accept_lost: bool = False
    trackers: Trackers | None = None
    """The run's trackers (rank 0)."""
    lock: RunLocks | None = None
    """The run folder's and checkpoint root's locks (the process that writes the run files)."""
    train_tasks: list[Any] = field(default_factory=list)
    """The env's train split (``train.seed``)."""
    eval_tasks: list[Any] = field(default_factory=list)
    """The first ``eval.num_tasks`` tasks of ``eval.split``."""
    idle_steps: int = 0
    """Consecutive steps without an update at the checkpoint resumed from."""

    def release(self) -> None:
        """Give the run folder's and checkpoint root's locks up (the run is over)."""
        if self.lock is not None:
            self.lock.release()


async def atrain(
    cfg: TrainConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    stop: anyio.Event | None = None,
    accept_lost_records: bool = False,
) -> TrainResult:
    """Run (or resume) training into ``out``; returns a ``TrainResult``. Setting ``stop`` ends
    the run at its next safe point (``interrupted=True``; see the module docs).
    ``accept_lost_records``: on resume, a run file that lost records its checkpoint counted is
    cut to its last complete line instead of refused."""
    setup = _prepare(cfg, Path(out), resume, accept_lost_records)
    async with AsyncExitStack() as stack:
        stack.callback(setup.release)  # last: after every file of the run is closed
        if setup.trackers is not None:
            stack.callback(setup.trackers.close)  # also when the run fails before its files
        runtime = await _compose(stack, setup)
        result = await runtime.run(stop)
    if result.interrupted and runtime.world > 1:  # rank 0's files closed before any rank exits
        await anyio.to_thread.run_sync(barrier, abandon_on_cancel=True)
    return result


STOP_FILE = ".agentrl-stop"
"""Left in the run folder by a rank that received a stop signal (several ranks): the others
poll for it every ``STOP_POLL_S`` seconds while they sample."""
STOP_POLL_S = 0.5


def _prepare(cfg: TrainConfig, out: Path, resume: bool, accept_lost: bool = False) -> _Setup:
    from agentrl._env_values import check_task_ids, split_tasks
    from agentrl._models import load_tokenizer, resolve_model, tokenizer_fingerprint
    from agentrl._registry import spec as env_spec
    from agentrl.envs import check_env_sandbox
    from agentrl.trainer import init_distributed

    # everything the configuration decides is checked before the run folder is written
    spec = env_spec(cfg.env)
    check_trackers(cfg.logging.trackers)  # a missing package stops the run before the model
    check_mlflow_store(cfg.logging)
    check_dashboard(cfg.logging)
    check_env_sandbox(cfg.sandbox, cfg.env, spec.entry_point)  # before any model is loaded
    env = spec.make(**cfg.rollout.env_kwargs)  # the env's arguments, its splits
    train_tasks = split_tasks(env, spec.id, "train", cfg.train.seed)
    eval_tasks = split_tasks(env, spec.id, cfg.eval.split, cfg.train.seed)[: cfg.eval.num_tasks]
    check_task_ids(train_tasks, spec.id, "train")  # ids name trajectories and GRPO groups
    check_task_ids(eval_tasks, spec.id, cfg.eval.split)
    model_path = str(resolve_model(cfg.model))
    tokenizer = load_tokenizer(model_path)
    fingerprint = tokenizer_fingerprint(tokenizer)
    check_out(cfg, out, resume=resume)  # refused before anything is written
    dist = init_distributed(
        num_threads=cfg.train.num_threads, timeout_s=cfg.train.collective_timeout_s
    )
    _check_world(cfg, dist.world_size)
    lead = dist.rank == 0  # writes the run files
    lock = lock_run_folder(out, lead=lead)  # one writer per run folder, from here to the end
    setup = _Setup(cfg, out, spec, model_path, tokenizer, fingerprint, None, lead, lock=lock)
    setup.train_tasks, setup.eval_tasks = train_tasks, eval_tasks
    setup.accept_lost = accept_lost
    try:
        _prepare_locked(setup, resume, dist.world_size)
    except BaseException:
        setup.release()
        raise
    return setup


def _prepare_locked(setup: _Setup, resume: bool, world: int) -> None:
    cfg, out, lead = setup.cfg, setup.out, setup.lead
    # what another run may have written before the lock was taken is looked at again
    check_out(cfg, out, resume=resume)
    found = _check_resume(setup) if resume else None
    # one writer per checkpoint root too (two runs may share a checkpoint.dir), from here on
    lock_checkpoint_root(setup.lock, checkpoint_root(cfg, out), out, lead=lead)
    if not resume:  # what another run wrote there before that lock was taken
        check_out(cfg, out, resume=False)
    if found is not None and found.broken:
        barrier()  # every rank has looked before any checkpoint is moved
        if lead:
            set_aside(found.broken)
    recorded = _config_files(out) if lead and resume else {}
    if lead:
        prepare_out(cfg, out, setup.model_path, fresh=not resume)
        (out / STOP_FILE).unlink(missing_ok=True)  # an earlier stop's: seen by no rank now
    try:
        _start_locked(setup, found, resume, world)
    except BaseException:
        for name, text in recorded.items():  # a refused resume leaves the run's config as it was
            try:
                write_file(out / name, text)
            except Exception:  # a full disk: the failure that stopped the start is the one to see
                pass
        raise


def _config_files(out: Path) -> dict[str, bytes]:
    """The run's configuration files as they are (``config.yaml``, ``config.json``)."""
    found = {}
    for name in ("config.yaml", "config.json"):
        try:
            found[name] = (out / name).read_bytes()
        except OSError:
            pass
    return found


def _start_locked(setup: _Setup, found: Any, resume: bool, world: int) -> None:
    """The rest of ``_prepare_locked`` once the configuration files are written: the ranks
    check each other, the learner is made and restored, the trackers open."""
    cfg, out, lead = setup.cfg, setup.out, setup.lead
    barrier()
    check_shared_out(out, dump_config(cfg))
    options = cfg.engine
    if world > 1 and options.num_threads is None:  # the ranks share the cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        options = options.replace(num_threads=max(1, (os.cpu_count() or 1) // local))
    setup.engine_options = options
    setup.learner = _make_learner(cfg, setup.spec, setup.model_path, setup.tokenizer)
    _restore(setup, found.path if found is not None else None, resume)
    if lead:
        setup.trackers = open_trackers(
            cfg.logging,
            out,
            cfg.model_dump(mode="json"),
            resume=resume,
            purge_step=setup.purge_step,
        )
    barrier()  # the run files are ready before anyone opens them


def _check_resume(setup: _Setup) -> Any:
    """``check_resume`` on every rank; its reading of the run files (their recorded lengths,
    which may be gigabytes on a shared filesystem) on rank 0 alone, whose verdict every rank
    raises."""
    failure: RunFileError | None = None
    try:
        found = check_resume(
            setup.cfg,
            setup.out,
            setup.fingerprint,
            lead=setup.lead,
            accept_lost=setup.accept_lost,
            files=setup.lead,
        )
    except RunFileError as exc:
        failure, found = exc, None
    raise_on_every_rank(failure, RunFileError)
    return found


def _check_world(cfg: TrainConfig, world: int) -> None:
    if world > 1 and cfg.train.mode == "async" and cfg.train.max_version_lag > 0:
        raise ConfigError(
            f"train.mode=async with {world} ranks: asynchronous training runs in one process "
            "(its engines may be servers: server.urls); several ranks (torchrun, on one node or "
            "many) train in train.mode=sync, with embedded engines or with server.urls"
        )


def _make_learner(cfg: TrainConfig, spec: Any, model_path: str, tokenizer: Any) -> Any:
    from agentrl.trainer import Learner, LearnerSettings

    max_turns = cfg.rollout.max_turns or spec.max_turns
    max_new = cfg.rollout.max_new_tokens or spec.max_new_tokens
    return Learner(
        LearnerSettings(
            model_path=model_path,
            algorithm=cfg.algorithm,
            optimizer=cfg.optimizer,
            total_steps=cfg.train.max_steps,
            temperature=cfg.rollout.temperature,
            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
            packing=cfg.train.packing,
            varlen_attention=cfg.train.attention == "varlen",
            share_prefix=cfg.train.share_prefix,
            gradient_checkpointing=cfg.train.gradient_checkpointing,
            chunk_size=cfg.train.logprob_chunk_size,
            kernels=cfg.train.kernels,
            norm_length=float(max_turns * max_new),
            deepspeed=cfg.deepspeed.overrides(),
        )
    )


def _restore(setup: _Setup, resume_from: Path | None, resume: bool) -> None:
    from agentrl.trainer import load_checkpoint

    setup.purge_step = 0 if resume else None  # TensorBoard: drop the earlier run's redone steps
    if resume_from is not None:
        state = load_checkpoint(
            resume_from,
            setup.learner,
            tokenizer_fingerprint=setup.fingerprint,
            config_hash=setup.cfg.hash(),
            verify=False,  # check_resume verified it
        )
        idle = state.steps_without_update
        if setup.lead:
            if not idle:  # a checkpoint that predates the field: its step's ledger record
                idle = last_idle_steps(setup.out, state)
            restore_files(setup.out, state.file_lengths, accept_lost=setup.accept_lost)
            print(
                f"resuming from checkpoint step {state.step} ({resume_from}): policy version "
                f"{state.policy_version}, data cursor {state.data_cursor}",
                flush=True,
            )
            if note := schedule_note(setup.cfg, setup.learner):
                print(note, flush=True)
        setup.idle_steps = gather(idle)[0]  # every rank stops at the same step
        setup.step, setup.cursor, setup.tasks_state = state.step, state.data_cursor, state.tasks
        setup.purge_step = state.step + 1
        setup.resume_from = resume_from
    elif resume and setup.lead:
        restore_files(setup.out, {})  # killed before it recorded a step: start over
        print(f"--resume: {setup.out} has no checkpoint yet: starting over from step 1", flush=True)


async def _compose(stack: AsyncExitStack, setup: _Setup) -> _Runtime:
    from agentrl.envs import open_env_sandbox
    from agentrl.formats import get_format

    cfg = setup.cfg
    # the run's one sandbox (code-running envs): shared by training and evaluation
    resources = await stack.enter_async_context(
        open_env_sandbox(cfg.sandbox, cfg.env, setup.spec.entry_point)
    )
    engine, sink = await _open_engine(stack, setup)
    base = RolloutContext(
        spec=setup.spec,
        engine=engine,
        fmt=get_format("chatml-hermes", setup.tokenizer),
        config=cfg.rollout,
        tokenizer_fingerprint=setup.fingerprint,
        model_name=cfg.model,
        env_resources=resources,
    )
    files = None
    if setup.trackers is not None:
        files = RunFiles(cfg, setup.out, setup.step, setup.trackers)
    if files is not None:
        stack.callback(files.close)
    return _Runtime(setup, base, sink, files)


async def _open_engine(stack: AsyncExitStack, setup: _Setup) -> tuple[Any, EngineWeightSink]:
    from agentrl.engine import SGLangEngine, open_embedded_engine

    cfg = setup.cfg
    if cfg.server.urls:  # SGLang / agentrl serve: publish snapshots through the disk
        snapshots = cfg.server.snapshot_dir or str(setup.out / "weights")
        engine = await stack.enter_async_context(
            SGLangEngine(
                cfg.server.urls,
                max_context=cfg.rollout.max_context_tokens,
                request_timeout_s=cfg.server.request_timeout_s,
                in_flight=cfg.engine.in_flight,
                model=cfg.server.model,
                snapshot_dir=snapshots,
            )
        )
        # several ranks share the servers: rank 0 publishes, every rank waits for it
        sink = wrap_for_ranks(
            EngineWeightSink(
                engine,
                snapshot_dir=snapshots,
                model_path=setup.model_path,
                keep=cfg.server.keep_snapshots,
            )
        )
    else:
        options = setup.engine_options
        engine = await stack.enter_async_context(open_embedded_engine(setup.model_path, options))
        sink = EngineWeightSink(engine)
    # a server may hold another run's weights; the embedded engine starts from the base model
    if setup.learner.version or cfg.server.urls:
        await sink.publish(setup.learner.version, setup.learner.state_dict())
    return engine, sink


class _Runtime:
    """The roles of one run, and its step loop."""

    def __init__(self, setup: _Setup, base: RolloutContext, sink: EngineWeightSink, files: Any):
        cfg = setup.cfg
        self.setup, self.cfg, self.files = setup, cfg, files
        self.learner = setup.learner
        self.stream = TaskStream(setup.train_tasks, cfg.train.seed)
        self.tasks = TaskLedger.from_state(setup.tasks_state, setup.cursor)
        self.buffer = TrajectoryBuffer()
        ctx = actor_context(base, cfg.rollout.seed)
        self.actor = Actor(ctx, self.stream, self.tasks, self.buffer)
        self.actor.version = self.learner.version
        self.publisher = Publisher(sink, self.actor)
        self.role = LearnerRole(cfg, self.learner, self.actor, self.buffer, self.tasks)
        self.checkpointer = Checkpointer(cfg, setup.out, setup.fingerprint, setup.model_path)
        self.evaluate = Evaluator(cfg, base, setup.eval_tasks, files)
        self.resources = base.env_resources
        self.clock = Clock(self.actor, self.role)
        self.step = setup.step
        self.last: dict[str, Any] = {}
        self.idle_steps = setup.idle_steps
        self.ended: _Ended | None = None
        self.world = rank_world()[1]

    async def run(self, stop: anyio.Event | None) -> TrainResult:
        try:
            try:
                interrupted = await self._run(stop)
                if interrupted:
                    await self._save_at_stop()
            except BaseExceptionGroup as group:  # the task groups' wrapping: raise what happened
                raise _first_error(group) from None
        except WriteError as exc:  # a full disk: what is kept, and how to go on once fixed
            raise WriteError(f"{exc}. {self._after_write_error(exc)}") from exc
        return TrainResult(
            self.setup.out,
            self.step,
            self.learner.version,
            self.last,
            interrupted=interrupted,
            checkpoint=self.checkpointer.latest(),
            resumed_from=self.setup.resume_from,
        )

    async def _save_at_stop(self) -> None:
        """After a stop: save the newest complete step when no checkpoint holds it (a second
        signal abandons the write; the checkpoint before it stays, and a half-written folder
        is removed by the next save)."""
        ended = self.ended
        if ended is None:
            return
        lead = self.setup.lead
        if self.learner.version != ended.version:  # the dropped step's update had been applied
            print(
                f"no checkpoint at stop: the learner had applied the update of step "
                f"{ended.step + 1}, which was dropped, so its weights are not step {ended.step}'s",
                flush=True,
            )
            return
        if lead:
            ranks = f" (all {self.world} ranks)" if self.world > 1 else ""
            print(
                f"saving a checkpoint of step {ended.step}{ranks} before stopping "
                "(Ctrl-C or SIGTERM again abandons it)",
                flush=True,
            )

        def save() -> None:
            self.checkpointer.save(
                ended.step,
                self.learner,
                ended.tasks,
                ended.cursor,
                idle_steps=ended.idle_steps,
                rng=ended.rng,
            )

        try:
            await anyio.to_thread.run_sync(save, abandon_on_cancel=True)
        except Exception as exc:  # the run files are whole: the stop goes on without it
            rank = f"rank {rank_world()[0]}: " if self.world > 1 else ""
            print(f"{rank}no checkpoint at stop: {exc}", flush=True)
        else:
            self.ended = None

    def _after_write_error(self, exc: WriteError) -> str:
        """Where the run stands after a failed write stopped it, and how to continue it."""
        checkpoint = self.checkpointer.latest()
        where = how_to_continue(self.setup.out, self.step, checkpoint)
        when = "once there is room" if is_disk_full(exc) else "once the file can be written"
        cut = " (what was written after it is cut back)" if checkpoint is not None else ""
        return f"The run stopped with {where} {when}{cut}"

    async def _run(self, stop: anyio.Event | None) -> bool:
        """Run the steps; whether a stop ended them. One process: ``stop`` cancels the step in
        progress wherever it is. Several ranks: each rank stops at a collection, where they
        all learn of it (``StopAgreed``), so every rank drops the same step and none is left
        waiting in a collective operation."""
        intervals = self.files is not None and self.cfg.logging.interval_s > 0
        agreed = False
        async with self.actor.running(), anyio.create_task_group() as tg:
            if intervals:
                tg.start_soon(self._intervals)
            with anyio.CancelScope() as steps:
                if stop is not None and self.world == 1:
                    tg.start_soon(cancel_when_set, stop, steps)
                elif stop is not None:
                    self.role.stop, self.role.signalled = anyio.Event(), stop
                    tg.start_soon(self._share_stop, stop, self.role.stop)
                    tg.start_soon(self._watch_for_stop, self.role.stop)
                try:
                    await self._steps()
                except StopAgreed as exc:
                    agreed = True
                    if self.setup.lead and stop is not None and not stop.is_set():
                        print(f"stopping: {exc}; every rank drops the step in progress", flush=True)
            tg.cancel_scope.cancel()
            if intervals:  # the last, partial interval: a run shorter than one has a record
                self._interval()
        if self.world > 1:  # a stop after the last step's collection: the run is complete
            return agreed
        return steps.cancelled_caught or (stop is not None and stop.is_set())

    async def _share_stop(self, signalled: anyio.Event, stop: anyio.Event) -> None:
        """Several ranks: once this rank is signalled, leave a mark in the run folder (which
        every rank sees) so the others stop sampling too, instead of finishing their share of
        the step before the collection tells them."""
        await signalled.wait()
        try:
            (self.setup.out / STOP_FILE).touch()
        except OSError:
            pass  # the collection still tells them, once they have sampled
        stop.set()

    async def _watch_for_stop(self, stop: anyio.Event) -> None:
        """Several ranks: stop sampling once another rank left its mark (``_share_stop``)."""
        mark = self.setup.out / STOP_FILE
        while not stop.is_set():
            await anyio.sleep(STOP_POLL_S)
            if mark.exists():
                stop.set()

    async def _steps(self) -> None:
        if self.step == 0 and self.cfg.eval.at_start:
            record = {"step": 0, "policy_version": 0, **await self.evaluate(0)}
            if self.files is not None:
                self.files.step(record, [])
                self.files.progress.evaluated(record)
        while self.step < self.cfg.train.max_steps:
            await self._one_step(self.step + 1)
            self.step += 1

    async def _one_step(self, step: int) -> None:
        started = time.perf_counter()
        self.role.admit(step)
        data = await self.role.collect(step)
        version = self.learner.version
        with anyio.CancelScope(shield=True):  # an update is never half-applied
            stats = await self.role.train(data)
            t0 = time.perf_counter()
            published = await self.publisher.publish(self.learner)
            self.role.busy_s += time.perf_counter() - t0
        cursor = self.tasks.low
        record = step_record(
            step, self.learner.version, data, self.stream, cursor, self.cfg.train.pass_threshold
        )
        add_learner_stats(record, stats)
        record.update(self._runtime_fields(data, version, published))
        if self.cfg.eval.every_steps and step % self.cfg.eval.every_steps == 0:
            record.update(await self.evaluate(step))
        record["step_s"] = time.perf_counter() - started
        with anyio.CancelScope(shield=True):
            self._commit(step, data, record)
        if self.files is not None:
            await self.files.dashboard(step, last=step == self.cfg.train.max_steps)

    def _runtime_fields(self, data: Any, version: int, published: dict[str, Any]) -> dict[str, Any]:
        fields: dict[str, Any] = {"learner_version": version}
        fields.update(sandbox_metrics(self.resources))  # the step's rollouts (evaluation's apart)
        fields.update(published)
        fields["checkpoint_s"] = self.checkpointer.last_s  # reported once, the step after
        self.checkpointer.last_s = 0.0
        if self.files is not None and self.files.dashboard_s:  # the same, for the page
            fields["dashboard_s"] = self.files.dashboard_s
            self.files.dashboard_s = 0.0
        if data.refill_rounds or self.role.refill:
            fields["refill_rounds"] = data.refill_rounds
            fields["refill_task_ids"] = [str(self.stream.at(s).id) for s in data.extra]
            fields["groups_informative"] = len(data.trained)
        if data.fill_rounds:
            fields["fill_task_slots"] = list(data.extra)
        window = self.buffer.take_window("step")
        clock = self.clock.window("step")
        fields.update(window.as_dict(clock["window_s"]))
        fields.update({k: v for k, v in clock.items() if k != "window_s"})
        fields["buffer_backlog"] = self.buffer.backlog
        fields["in_flight_groups"] = self.buffer.in_flight
        fields["wait_s"] = data.wait_s
        return fields

    def _commit(self, step: int, data: Any, record: dict[str, Any]) -> None:
        """Settle the step's slots, write its trajectories and record, checkpoint when due."""
        trajs = self.role.settle(data, step)
        record["data_cursor"] = self.tasks.low
        self.idle_steps = self.idle_steps + 1 if trained_on_nothing(record) else 0
        record["steps_without_update"] = self.idle_steps
        limit = self.cfg.train.max_steps_without_update
        if limit and self.idle_steps >= limit:
            record["stop_reason"] = stall_reason(self.idle_steps, record)
        if self.files is not None:
            for traj in trajs:
                self.files.trajectory(traj)
            trained = [t for v in data.trained for t in v.trajectories]
            rewards = [float(t.reward) for t in trained if t.reward is not None]
            self.files.step(record, rewards)
            self.files.progress.update(record)
        self.last = record
        if "stop_reason" in record:
            raise TrainingStalled(
                f"{record['stop_reason']}; the run stopped at step {step} "
                f"(train.max_steps_without_update={limit}; ledger: "
                f"{self.setup.out / 'ledger.jsonl'})"
            )
        if self.checkpointer.due(step):  # the run files' lengths: fsynced by the save
            self.checkpointer.save(
                step, self.learner, self.tasks.state(), self.tasks.low, idle_steps=self.idle_steps
            )
            self.ended = None
        elif self.cfg.checkpoint.at_stop:  # what a save after a stop writes for this step
            from agentrl.trainer import rng_state

            self.ended = _Ended(
                step,
                self.learner.version,
                self.tasks.state(),
                self.tasks.low,
                self.idle_steps,
                rng_state(),
            )

    async def _intervals(self) -> None:
        every = self.cfg.logging.interval_s
        while True:
            await anyio.sleep(every)
            self._interval()

    def _interval(self) -> None:
        """One ``runtime.jsonl`` record: the window since the previous one."""
        clock = self.clock.window("interval")
        record: dict[str, Any] = {
            "time_s": time.perf_counter() - self.clock.start,
            "step": self.step,
            "policy_version": self.learner.version,
            "buffer_backlog": self.buffer.backlog,
            "in_flight_groups": self.buffer.in_flight,
        }
        record.update(self.buffer.take_window("interval").as_dict(clock["window_s"]))
        record.update({k: v for k, v in clock.items() if k != "window_s"})
        assert self.files is not None
        self.files.interval(record)


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The one error a nest of task groups carries (the group itself when there are more)."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else group


def train(
    cfg: TrainConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    backend: str = "trio",
    accept_lost_records: bool = False,
) -> TrainResult:
    """Synchronous ``atrain`` on its own event loop."""
    return anyio.run(
        lambda: atrain(cfg, out, resume=resume, accept_lost_records=accept_lost_records),
        backend=backend,
    )
