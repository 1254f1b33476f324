"""``agentrl eval`` and ``agentrl export``: a checkpoint's policy on the held-out split, and a
checkpoint as an HF safetensors folder. Neither starts DeepSpeed: the weights are consolidated
from the ZeRO checkpoint files (``consolidated_state_dict``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import anyio

from agentrl._env_values import check_task_ids, split_tasks
from agentrl._errors import ConfigError
from agentrl._outfiles import write_file
from agentrl._rollout import RolloutContext
from agentrl._runner import describe_run_dir, refuse_training_run, run_groups
from agentrl._types import TrajectoryWriter
from agentrl.envs import check_env_sandbox, open_env_sandbox
from agentrl.trainer import (
    consolidated_state_dict,
    export_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    read_state,
    step_dir,
    verify_checkpoint,
)
from agentrl.trainer._export import recorded_model

from ._checkpointer import checkpoint_root
from ._config import TrainConfig
from ._evaluator import eval_metrics, eval_rollout, sandbox_metrics


def find_checkpoint(path: str | os.PathLike[str]) -> Path | None:
    """A checkpoint folder from a checkpoint folder, a checkpoints root or a run folder
    (its newest, under the run's own ``checkpoint.dir``); None when ``path`` is none of
    them. A training run without a complete checkpoint is a ``ConfigError`` (its folder is no
    model either)."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    if describe_run_dir(path)[0]:
        root = run_checkpoint_root(path)
        found = latest_checkpoint(root)
        if found is None:
            raise ConfigError(f"{path} is a training run with no complete checkpoint under {root}")
        return found
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    return None


def run_checkpoint_root(run: Path) -> Path:
    """Where a run folder keeps its checkpoints: its recorded ``checkpoint.dir``, else
    ``run/checkpoints``."""
    config_file = run / "config.yaml"
    if not config_file.is_file():
        return run / "checkpoints"
    from ._config import load_train_config

    return checkpoint_root(load_train_config(config_file, recorded=True), run)


def checkpoint_model(checkpoint: Path, state: Any, model: str | None) -> str:
    """The model folder a checkpoint's policy goes on (its config and tokenizer): ``model``
    (a folder or registered name, ``--model``; its tokenizer must be the one the run trained
    with), else the folder the checkpoint recorded (``state.json``'s ``model_path``)."""
    from agentrl._models import load_tokenizer, resolve_model, tokenizer_fingerprint

    if model is None:
        return str(recorded_model(checkpoint, state))
    folder = str(resolve_model(model))
    fingerprint = tokenizer_fingerprint(load_tokenizer(folder))
    if fingerprint != state.tokenizer_fingerprint:
        raise ConfigError(
            f"--model {model}: its tokenizer ({fingerprint}) is not the one checkpoint "
            f"{checkpoint} was trained with ({state.tokenizer_fingerprint})"
        )
    return folder


async def _policy(
    checkpoint: str, model: str | None = None
) -> tuple[str, int, dict[str, Any] | None, str]:
    """(model folder, policy version, weights or None, what was loaded) of a checkpoint, or
    of a model name. A checkpoint is verified first (every file its manifest lists, hashed)."""
    from agentrl._models import resolve_model

    found = find_checkpoint(checkpoint)
    if found is None:
        if model is not None:
            raise ConfigError(f"--model {model}: only for a checkpoint; {checkpoint} is none")
        return str(resolve_model(checkpoint)), 0, None, checkpoint
    state = await anyio.to_thread.run_sync(verify_checkpoint, found)
    folder = await anyio.to_thread.run_sync(checkpoint_model, found, state, model)
    weights = await anyio.to_thread.run_sync(consolidated_state_dict, found)
    return folder, state.policy_version, weights, str(found)


async def aevaluate(
    cfg: TrainConfig,
    checkpoint: str,
    *,
    out: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    model: str | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint (or, when ``checkpoint`` is not one, a model name or HF folder)
    on ``eval.num_tasks`` tasks of ``eval.split``; returns the metrics (also written to
    ``out/eval_summary.json`` with the trajectories). An ``out`` that holds an evaluation
    already is refused, unless ``overwrite``: then this one replaces it once it finishes.
    ``model``: the model folder a checkpoint goes on (``checkpoint_model``)."""
    from agentrl._models import load_tokenizer, tokenizer_fingerprint
    from agentrl._registry import spec as env_spec
    from agentrl.engine import engine_options, open_embedded_engine
    from agentrl.formats import get_format

    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        _check_eval_out(out_dir, overwrite)
    spec = env_spec(cfg.env)
    check_env_sandbox(cfg.sandbox, cfg.env, spec.entry_point)  # before any model is loaded
    model_path, version, weights, source = await _policy(checkpoint, model)
    tokenizer = load_tokenizer(model_path)
    env = spec.make(**cfg.rollout.env_kwargs)
    tasks = split_tasks(env, spec.id, cfg.eval.split, cfg.train.seed)[: cfg.eval.num_tasks]
    check_task_ids(tasks, spec.id, cfg.eval.split)
    rollout = eval_rollout(cfg)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    options = engine_options(cfg.engine)
    async with (
        open_env_sandbox(cfg.sandbox, cfg.env, spec.entry_point) as resources,
        open_embedded_engine(model_path, options) as engine,
    ):
        if weights is not None:
            await engine.update_weights(version, weights)
        ctx = RolloutContext(
            spec=spec,
            engine=engine,
            fmt=get_format("chatml-hermes", tokenizer),
            config=rollout,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            model_name=cfg.model,
            env_resources=resources,
        )
        writer = None
        if out_dir is not None:  # written beside the old evaluation, which it then replaces
            writer = TrajectoryWriter(str(out_dir / _PARTIAL))
        started = time.perf_counter()
        try:
            trajs = await run_groups(ctx, tasks, on_trajectory=writer.write if writer else None)
        finally:
            if writer is not None:
                writer.close()
        elapsed = time.perf_counter() - started
        metrics = eval_metrics(trajs, cfg.train.pass_threshold, elapsed)
        metrics.update(sandbox_metrics(resources))
    metrics.update(checkpoint=source, policy_version=version, num_tasks=len(tasks))
    if out_dir is not None:
        (out_dir / "eval_summary.json").unlink(missing_ok=True)  # never a summary of others
        os.replace(out_dir / _PARTIAL, out_dir / "eval_trajectories.jsonl")
        write_file(out_dir / "eval_summary.json", json.dumps(metrics, indent=2))
    return metrics


_EVAL_FILES = ("eval_summary.json", "eval_trajectories.jsonl")
_PARTIAL = ".eval_trajectories.jsonl.partial"  # an evaluation in progress (or interrupted)


def _check_eval_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that is a file or holds a training run (its
    ``eval_trajectories.jsonl`` is the run's, cut back on resume), or, unless ``overwrite``,
    an evaluation: its trajectories would be mixed with this one's."""
    refuse_training_run(out, "an evaluation")
    held = [name for name in _EVAL_FILES if (out / name).exists()]
    if held and not overwrite:
        raise ConfigError(
            f"--out {out} already holds an evaluation ({', '.join(held)}): choose another "
            "directory, or pass --overwrite to replace it"
        )
    (out / _PARTIAL).unlink(missing_ok=True)  # an interrupted evaluation's


def export_run(
    run_dir: str | os.PathLike[str],
    step: int | None,
    out: str | os.PathLike[str],
    model: str | None = None,
) -> tuple[Path, int]:
    """``agentrl export RUN --step N --out DIR``: the checkpoint of step N (default: newest)
    of a run as an HF folder; returns the folder and the step exported. ``DIR`` must be new,
    empty or an earlier export; the run folder and any folder holding it are refused
    (``agentrl.trainer.export_checkpoint``). ``model``: ``checkpoint_model``."""
    run = Path(run_dir)
    root = run_checkpoint_root(run)
    path = step_dir(root, step) if step is not None else latest_checkpoint(root)
    if path is None or not (path / "state.json").is_file():
        steps = [read_state(p).step for p in list_checkpoints(root)]
        which = f"for step {step}" if step is not None else "at all"
        there = (
            f"the complete ones are of steps {', '.join(map(str, steps))}"
            if steps
            else "it holds none"
        )
        raise ConfigError(f"no complete checkpoint {which} under {root}: {there}")
    state = read_state(path)
    folder = checkpoint_model(path, state, model)
    return export_checkpoint(path, out, model_path=folder, run_dir=run), state.step
