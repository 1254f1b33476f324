"""The synchronous on-policy loop: rollout → rewards → advantages → update → publish → checkpoint.

One process holds everything (colocated): the embedded engine's worker thread samples, the
learner (DeepSpeed ZeRO-3) trains in the calling thread, and ``EngineWeightSink`` hands the
gathered weights to the engine in-process under the next policy version. Step ``s`` samples
with version ``s - 1`` (every trajectory records it), trains, and publishes version ``s``; the
version lag is therefore 0. The event loop is blocked while the learner computes: nothing else
runs between rollouts in this mode (the asynchronous mode will move the learner to a thread).

With several processes (``torchrun``) the ranks split each step's tasks and train data-parallel;
rank 0 writes the run files (``_ranks``).

Resume (``resume=True``): the newest complete checkpoint under ``checkpoint.dir`` restores the
learner (weights, optimizer, LR schedule), RNG states, the data cursor and the policy version;
the run files are cut back to their length at that checkpoint (the in-flight rule), and the
engine is given the checkpoint's weights before sampling. Steps then continue with the same
tasks and the same per-step seeds as an uninterrupted run.

Stopping: ``stop`` (set by the command's Ctrl-C handler) cancels the step's sampling or
evaluation; the loop ends without writing that step, so the run is exactly as if it had been
killed after its last complete step and resumes from its newest checkpoint. After
``train.max_steps_without_update`` consecutive steps that trained on nothing (every trajectory
failed, say) the loop writes the reason into that step's ledger record and raises
``TrainingStalled``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pydantic
import torch

from agentrl._errors import AgentRLError, ConfigError
from agentrl._rollout import RolloutContext, derive_seed
from agentrl._runner import config_diff, run_groups
from agentrl._types import Trajectory, TrajectoryWriter
from agentrl.envs import check_env_sandbox, open_env_sandbox
from agentrl.envs._sandbox_open import interval_metrics
from agentrl.trainer import (
    Learner,
    LearnerSettings,
    LoopState,
    init_distributed,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    save_checkpoint,
    verify_state,
)

from ._config import TrainConfig, dump_config
from ._ledger import Ledger, StepProgress, rollout_metrics
from ._ranks import barrier, gather, in_task_order, merge_stats, rank_world, shard

RUN_FILES = ("ledger.jsonl", "trajectories.jsonl", "eval_trajectories.jsonl")


class TrainingStalled(AgentRLError):
    """Several consecutive steps trained on nothing (``train.max_steps_without_update``)."""

    exit_code = 1


class EngineWeightSink:
    """Publishes to an ``Engine`` (the colocated embedded engine, or an SGLang client): the
    state dict in-process, or (``snapshot_dir``) a safetensors folder the engine loads from
    disk (``/update_weights_from_disk`` for servers)."""

    def __init__(
        self,
        engine: Any,
        *,
        snapshot_dir: str | None = None,
        model_path: str = "",
        keep: int | None = None,
    ):
        self.engine = engine
        self.snapshot_dir = snapshot_dir
        self.model_path = model_path
        self.keep = keep
        """Snapshots kept (newest first) once the engine has loaded a new one; None: all."""

    async def publish(self, version: int, weights: dict[str, torch.Tensor] | str) -> None:
        if self.snapshot_dir is not None and isinstance(weights, dict):
            weights = await anyio.to_thread.run_sync(self._write_snapshot, version, weights)
        await self.engine.update_weights(version, weights)
        if self.snapshot_dir is not None and self.keep is not None:
            self._prune()

    def _prune(self) -> None:
        import shutil

        snapshots = sorted(Path(self.snapshot_dir or ".").glob("v[0-9]*"), reverse=True)
        for old in snapshots[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def _write_snapshot(self, version: int, weights: dict[str, torch.Tensor]) -> str:
        import shutil

        from safetensors.torch import save_file

        folder = Path(self.snapshot_dir or ".") / f"v{version:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        unique: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in weights.items():  # a tied head shares the embedding's storage
            if tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                unique[name] = tensor.contiguous()
        save_file(unique, str(folder / "model.safetensors"))
        shutil.copy2(Path(self.model_path) / "config.json", folder / "config.json")
        return str(folder)


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

    def take(self, cursor: int, n: int) -> list[Any]:
        size = len(self.tasks)
        return [self.tasks[self._order(i // size)[i % size]] for i in range(cursor, cursor + n)]


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


def _file_lengths(out: Path) -> dict[str, int]:
    return {name: (out / name).stat().st_size for name in RUN_FILES if (out / name).exists()}


def _truncate(out: Path, lengths: dict[str, int]) -> None:
    """The in-flight rule: drop what was written after the checkpoint."""
    for name in RUN_FILES:
        path = out / name
        if path.exists():
            os.truncate(path, lengths.get(name, 0))


def _check_out(out: Path, *, resume: bool) -> None:
    if not resume and (out / "ledger.jsonl").exists():
        raise ConfigError(f"{out} already holds a run; resume it with --resume {out}")


def _prepare_out(cfg: TrainConfig, out: Path, model_path: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    info = {"env": cfg.env, "model": cfg.model, "model_path": model_path, "train": True}
    info["rollout"] = cfg.rollout.model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(info, indent=2))


def _check_resume(cfg: TrainConfig, out: Path, fingerprint: str) -> Path | None:
    """The checkpoint to resume from, refused early (before any model is built) when it
    belongs to another tokenizer or configuration; None when the run never reached one (it
    then starts over: its files are emptied)."""
    if not (out / "config.yaml").is_file():
        raise ConfigError(f"--resume: {out} is not a training run (no config.yaml)")
    path = latest_checkpoint(checkpoint_root(cfg, out))
    if path is None:
        return None
    state = read_state(path)
    # the tokenizer first (ids would not mean the same thing), then the configuration
    verify_state(state, path, tokenizer_fingerprint=fingerprint, config_hash=state.config_hash)
    if state.config_hash == cfg.hash():
        return path
    changed = _changed_fields(out, state.config_hash, cfg)
    raise ConfigError(
        f"--resume: configuration mismatch with checkpoint {path} (config hash "
        f"{state.config_hash}, this run's is {cfg.hash()}): "
        + ("; ".join(changed) if changed else "the checkpoint's configuration is unknown")
        + " (only max_steps, num_threads, max_steps_without_update, checkpointing, logging, eval,"
        " engine, server, sandbox and rollout concurrency may change on resume)"
    )


def _changed_fields(out: Path, old_hash: str, cfg: TrainConfig) -> list[str]:
    """The hashed fields where ``cfg`` differs from the run's ``config.yaml`` (``old → new``),
    when that file is the configuration the checkpoint was written with."""
    from ._config import load_train_config

    try:
        old = load_train_config(out / "config.yaml")
    except ConfigError:
        return []
    if old.hash() != old_hash:
        return []
    before, after = old.model_dump(mode="json"), cfg.model_dump(mode="json")
    changed = []
    for line in config_diff(before, after):
        name = line.split(":", 1)[0]
        probe = _with_leaf(before, name.split("."), after)
        try:  # does this field alone change the hash?
            alone = TrainConfig.model_validate(probe).hash() != old_hash
        except pydantic.ValidationError:
            alone = True
        if alone:
            changed.append(line)
    return changed


def _with_leaf(base: dict[str, Any], path: list[str], source: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with the value at ``path`` taken from ``source`` (or removed)."""
    import copy

    out = copy.deepcopy(base)
    node, src = out, source
    for key in path[:-1]:
        node, src = node.setdefault(key, {}), (src or {}).get(key, {})
    if path[-1] in (src or {}):
        node[path[-1]] = copy.deepcopy(src[path[-1]])
    else:
        node.pop(path[-1], None)
    return out


def checkpoint_root(cfg: TrainConfig, out: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"


async def atrain(
    cfg: TrainConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    stop: anyio.Event | None = None,
):
    """Run (or resume) training into ``out``; returns a ``TrainResult``. Setting ``stop`` ends
    the run at its next safe point (``interrupted=True``; see the module docs)."""
    from transformers import AutoTokenizer

    from agentrl._models import resolve_model, tokenizer_fingerprint
    from agentrl._registry import spec as env_spec
    from agentrl.engine import SGLangEngine, open_embedded_engine
    from agentrl.formats import get_format

    out = Path(out)
    spec = env_spec(cfg.env)
    check_env_sandbox(cfg.sandbox, cfg.env, spec.entry_point)  # before any model is loaded
    model_path = str(resolve_model(cfg.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    fingerprint = tokenizer_fingerprint(tokenizer)
    resume_from = _check_resume(cfg, out, fingerprint) if resume else None
    _check_out(out, resume=resume)
    options = cfg.engine
    dist = init_distributed(num_threads=cfg.train.num_threads)
    if cfg.server.urls and dist.world_size > 1:
        raise ConfigError("server.urls: rollouts on servers run from one process (no torchrun)")
    lead = dist.rank == 0  # writes the run files
    if lead:
        _prepare_out(cfg, out, model_path)
    if dist.world_size > 1 and options.num_threads is None:  # the ranks share the cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))
        options = options.replace(num_threads=max(1, (os.cpu_count() or 1) // local))
    max_turns = cfg.rollout.max_turns or spec.max_turns
    max_new = cfg.rollout.max_new_tokens or spec.max_new_tokens
    learner = Learner(
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
    ckpt_root = checkpoint_root(cfg, out)
    step, cursor = 0, 0
    purge_step = 0 if resume else None  # TensorBoard: drop the earlier run's redone steps
    if resume_from is not None:
        state = load_checkpoint(
            resume_from, learner, tokenizer_fingerprint=fingerprint, config_hash=cfg.hash()
        )
        if lead:
            _truncate(out, state.file_lengths)
            print(
                f"resuming from checkpoint step {state.step} ({resume_from}): policy version "
                f"{state.policy_version}, data cursor {state.data_cursor}",
                flush=True,
            )
        step, cursor = state.step, state.data_cursor
        purge_step = step + 1
    elif resume and lead:
        _truncate(out, {})  # killed before its first checkpoint: start over
        print(f"--resume: {out} has no checkpoint yet: starting over from step 1", flush=True)
    barrier()  # the run files are ready before anyone opens them
    env = spec.make(**cfg.rollout.env_kwargs)
    stream = TaskStream(list(env.tasks("train", seed=cfg.train.seed)), cfg.train.seed)
    eval_tasks = list(env.tasks(cfg.eval.split, seed=cfg.train.seed))[: cfg.eval.num_tasks]
    fmt = get_format("chatml-hermes", tokenizer)
    last: dict[str, Any] = {}
    refill_rounds = cfg.train.refill_rounds if learner.settings.algorithm.dynamic_sampling else 0
    async with AsyncExitStack() as stack:
        # the run's one sandbox (code-running envs): shared by training and evaluation
        resources = await stack.enter_async_context(
            open_env_sandbox(cfg.sandbox, cfg.env, spec.entry_point)
        )
        if cfg.server.urls:  # SGLang / agentrl serve: publish snapshots through the disk
            engine = await stack.enter_async_context(
                SGLangEngine(
                    cfg.server.urls,
                    max_context=cfg.rollout.max_context_tokens,
                    request_timeout_s=cfg.server.request_timeout_s,
                )
            )
            snapshots = cfg.server.snapshot_dir or str(out / "weights")
            sink = EngineWeightSink(
                engine,
                snapshot_dir=snapshots,
                model_path=model_path,
                keep=cfg.server.keep_snapshots,
            )
        else:
            engine = await stack.enter_async_context(open_embedded_engine(model_path, options))
            sink = EngineWeightSink(engine)
        # a server may hold another run's weights; the embedded engine starts from the base model
        if learner.version or cfg.server.urls:
            await sink.publish(learner.version, learner.state_dict())
        base = RolloutContext(
            spec=spec,
            engine=engine,
            fmt=fmt,
            config=cfg.rollout,
            tokenizer_fingerprint=fingerprint,
            model_name=cfg.model,
            env_resources=resources,
        )
        files = _RunFiles(cfg, out, step, purge_step) if lead else None
        if files is not None:
            stack.callback(files.close)
        evaluate = _Evaluator(cfg, base, eval_tasks, files)
        if step == 0 and cfg.eval.at_start:
            record = {"step": 0, "policy_version": 0, **await evaluate(0)}
            if files is not None:
                files.ledger.write(record)
        checkpoint_s = 0.0
        interrupted = False
        idle_steps = 0  # consecutive steps that trained on nothing
        while step < cfg.train.max_steps:
            if stop is not None and stop.is_set():
                interrupted = True
                break
            step += 1
            started = time.perf_counter()
            tasks = stream.take(cursor, cfg.train.tasks_per_step)
            ctx = dataclasses.replace(
                base,
                config=cfg.rollout.model_copy(
                    update={"seed": derive_seed(cfg.rollout.seed, "train-step", step)}
                ),
            )
            sampled_with = learner.version
            mine, trajs = await _sample(ctx, tasks, files, stop)
            refill: dict[str, Any] = {}
            if refill_rounds:
                mine, trajs, refill = await _refill(
                    ctx, stream, cursor + len(tasks), len(tasks), trajs, refill_rounds, files, stop
                )
            if stop is not None and stop.is_set():  # a partial step is never trained on
                step -= 1
                interrupted = True
                break
            rollout_s = time.perf_counter() - started
            sandbox = sandbox_metrics(resources)  # the step's rollouts (evaluation's apart)
            stats = learner.train_step(mine)
            t0 = time.perf_counter()
            weights = learner.state_dict()
            gather_s = time.perf_counter() - t0
            await sink.publish(learner.version, weights)
            publish_s = time.perf_counter() - t0
            del weights
            cursor += len(tasks) + len(refill.get("refill_task_ids", ()))
            learner_stats = merge_stats(gather(stats.as_dict()))
            record = _record(
                step, learner.version, sampled_with, cursor, tasks, trajs, learner_stats, cfg,
                rollout_s,
            )  # fmt: skip
            record.update(refill)
            record.update(sandbox)
            record.update(publish_s=publish_s, gather_s=gather_s, checkpoint_s=checkpoint_s)
            checkpoint_s = 0.0  # reported once, on the step after the write
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0:
                record.update(await evaluate(step, stop))
                if stop is not None and stop.is_set():  # nor is a partial evaluation logged
                    step -= 1
                    interrupted = True
                    break
            record["step_s"] = time.perf_counter() - started
            idle_steps = idle_steps + 1 if _trained_on_nothing(record) else 0
            record["steps_without_update"] = idle_steps
            limit = cfg.train.max_steps_without_update
            if limit and idle_steps >= limit:
                record["stop_reason"] = _stall_reason(idle_steps, record)
            rewards = [float(t.reward) for t in trajs if t.reward is not None]
            if files is not None:
                files.ledger.write(record, rewards=rewards)
                files.progress.update(record)
            last = record
            if "stop_reason" in record:
                raise TrainingStalled(
                    f"{record['stop_reason']}; the run stopped at step {step} "
                    f"(train.max_steps_without_update={limit}; ledger: {out / 'ledger.jsonl'})"
                )
            every = cfg.checkpoint.every_steps
            final = cfg.checkpoint.at_end and step == cfg.train.max_steps
            if (every and step % every == 0) or final:
                t0 = time.perf_counter()
                state = LoopState(
                    step=step,
                    policy_version=learner.version,
                    data_cursor=cursor,
                    tokenizer_fingerprint=fingerprint,
                    config_hash=cfg.hash(),
                    model_path=model_path,
                    file_lengths=_file_lengths(out),
                )
                save_checkpoint(ckpt_root, learner, state, keep=cfg.checkpoint.keep)
                checkpoint_s = time.perf_counter() - t0
    return TrainResult(
        out,
        step,
        learner.version,
        last,
        interrupted=interrupted,
        checkpoint=latest_checkpoint(ckpt_root),
        resumed_from=resume_from,
    )


def sandbox_metrics(resources: dict[str, Any], prefix: str = "sandbox") -> dict[str, Any]:
    """The run's sandbox activity since the previous call, every rank's (``sandbox/…`` ledger
    fields; see docs/training.md), or nothing when the env runs no code."""
    runner = resources.get("sandbox")
    if runner is None:
        return {}
    return interval_metrics(gather(runner.take_interval()), prefix)


def _trained_on_nothing(record: dict[str, Any]) -> bool:
    return not record.get("updates") or not record.get("trajectories_used")


def _stall_reason(steps: int, record: dict[str, Any]) -> str:
    errors, total = record.get("errors", 0), record.get("trajectories", 0)
    why = f"{errors} of {total} trajectories failed"
    first = record.get("first_error")
    if first:
        why += f"; first: {first['where']} {first['type']}: {first['message']}"
    if errors < total:  # the algorithm's masks left nothing (dynamic sampling, overlong filter)
        why += (
            f"; the learner kept {record.get('trajectories_used', 0)} of "
            f"{record.get('trajectories_in', total)} (groups dropped by dynamic sampling: "
            f"{record.get('groups_filtered', 0)}; terminations: {record.get('termination', {})})"
        )
    return f"{steps} consecutive steps trained on nothing ({why})"


async def _sample(
    ctx: RolloutContext,
    tasks: list[Any],
    files: _RunFiles | None,
    stop: anyio.Event | None = None,
):
    """``(this rank's trajectories, every rank's in task order)`` for ``tasks``: each rank rolls
    out its share; rank 0 appends them all to the trajectory file (as each finishes when there
    is one process, after the gather otherwise)."""
    alone = rank_world()[1] == 1
    on_traj = files.trajectory if files is not None and alone else None
    mine = await run_groups(ctx, shard(tasks), on_trajectory=on_traj, stop=stop)
    if alone:
        return mine, mine
    everything = in_task_order(tasks, gather(mine))
    if files is not None:
        for traj in everything:
            files.trajectory(traj)
    return mine, everything


def _informative_groups(trajs: list[Trajectory]) -> list[list[Trajectory]]:
    """The groups (in order of appearance) whose rewards are not all equal: DAPO's dynamic
    sampling keeps exactly these (``dynamic_sampling_mask``; errors carry no reward)."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    out = []
    for members in groups.values():
        rewards = {float(t.reward) for t in members if t.reward is not None}
        if len(rewards) > 1:
            out.append(members)
    return out


async def _refill(ctx, stream, cursor, want, trajs, rounds, files, stop=None):
    """DAPO dynamic sampling with refill: while fewer than ``want`` groups are informative,
    sample fresh tasks from the stream (at ``cursor``, seeds per round) for up to ``rounds``
    rounds; keep the first ``want`` informative groups. Returns (this rank's share to train
    on, every trajectory sampled this step, ledger fields)."""
    informative = _informative_groups(trajs)
    everything = list(trajs)
    drawn: list[Any] = []
    used = 0
    for round_ in range(rounds):
        need = want - len(informative)
        if need <= 0:
            break
        extra = stream.take(cursor + len(drawn), need)
        drawn += extra
        used += 1
        seed = derive_seed(ctx.config.seed, "refill", round_)
        rctx = dataclasses.replace(ctx, config=ctx.config.model_copy(update={"seed": seed}))
        _, got = await _sample(rctx, extra, files, stop)
        if stop is not None and stop.is_set():
            break
        everything += got
        informative += _informative_groups(got)
    chosen = informative[:want]
    mine = [t for group in shard(chosen) for t in group]
    fields = {
        "refill_rounds": used,
        "refill_task_ids": [t.id for t in drawn],
        "groups_informative": len(chosen),
    }
    return mine, everything, fields


def _record(step, version, sampled_with, cursor, tasks, trajs, stats, cfg, rollout_s):
    lags = [sampled_with - t.policy_version for t in trajs] or [0]
    record: dict[str, Any] = {
        "step": step,
        "policy_version": version,
        "rollout_version": sampled_with,
        "data_cursor": cursor,
        "task_ids": [t.id for t in tasks],
        "version_lag": sum(lags) / len(lags),
        "version_lag_max": max(lags),
        "rollout_s": rollout_s,
    }
    record.update(
        rollout_metrics(trajs, pass_threshold=cfg.train.pass_threshold, elapsed_s=rollout_s)
    )
    record.update(stats)
    busy = stats["update_s"] + stats["reference_s"] + stats["logprob_s"]
    record["learner_tokens_per_s"] = stats["learner_tokens"] / busy if busy > 0 else None
    return record


class _RunFiles:
    """What rank 0 writes: trajectories, eval trajectories, the ledger (+ TensorBoard), progress."""

    def __init__(self, cfg: TrainConfig, out: Path, step: int, purge_step: int | None) -> None:
        self.keep_trajectories = cfg.logging.trajectories
        self.trajectories = TrajectoryWriter(str(out / "trajectories.jsonl"))
        self.eval_trajectories = TrajectoryWriter(str(out / "eval_trajectories.jsonl"))
        self.ledger = Ledger(out, tensorboard=cfg.logging.tensorboard, purge_step=purge_step)
        self.progress = StepProgress(cfg.train.max_steps, step, enabled=cfg.logging.progress)

    def trajectory(self, traj: Trajectory) -> None:
        if self.keep_trajectories:
            self.trajectories.write(traj)

    def close(self) -> None:
        self.trajectories.close()
        self.eval_trajectories.close()
        self.ledger.close()
        self.progress.close()


class _Evaluator:
    """Held-out evaluation: the first ``eval.num_tasks`` tasks of the eval split, one sample
    each, a fixed seed (so curves compare policies, not samples); split over the ranks like
    training tasks, metrics from all of them."""

    def __init__(
        self, cfg: TrainConfig, base: RolloutContext, tasks: list[Any], files: _RunFiles | None
    ) -> None:
        self.cfg, self.tasks, self.files = cfg, tasks, files
        rollout = cfg.rollout.model_copy(
            update={
                "group_size": 1,
                "temperature": cfg.eval.temperature,
                "seed": derive_seed(cfg.rollout.seed, "eval"),
            }
        )
        self.ctx = dataclasses.replace(base, config=rollout)

    async def __call__(self, step: int, stop: anyio.Event | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        mine = await run_groups(self.ctx, shard(self.tasks), stop=stop)
        if stop is not None and stop.is_set():
            return {}
        trajs = in_task_order(self.tasks, gather(mine))
        if self.files is not None:
            for traj in trajs:
                self.files.eval_trajectories.write(traj)
        metrics = eval_metrics(trajs, self.cfg.train.pass_threshold, time.perf_counter() - started)
        return {**metrics, **sandbox_metrics(self.ctx.env_resources, "eval_sandbox")}


def eval_metrics(trajs: list[Trajectory], threshold: float, elapsed: float) -> dict[str, Any]:
    m = rollout_metrics(trajs, pass_threshold=threshold, elapsed_s=elapsed)
    return {
        "eval_reward_mean": m["reward_mean"],
        "eval_pass_rate": m["pass_rate"],
        "eval_tool_calls_per_trajectory": m["tool_calls_per_trajectory"],
        "eval_s": elapsed,
    }


def train(
    cfg: TrainConfig, out: str | os.PathLike[str], *, resume: bool = False, backend: str = "trio"
) -> TrainResult:
    """Synchronous ``atrain`` on its own event loop."""
    return anyio.run(lambda: atrain(cfg, out, resume=resume), backend=backend)
