"""Run many trajectories: groups of G samples per task, bounded concurrency, JSONL as they finish.

``rollout()`` / ``arollout()`` are the Python API behind ``agentrl rollout``. A run directory is
never written over by accident: one that already holds a rollout is refused unless the caller
asks to ``overwrite`` it or to ``append`` to it (appended samples continue each group's sample
indices, so trajectory ids stay unique); one that holds a training run is always refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio

from ._config import ROLLOUT_LEGACY_VALUES, RolloutConfig
from ._config_file import read_json_value
from ._env_values import check_task_ids, split_tasks
from ._errors import ConfigError
from ._outfiles import write_file
from ._registry import spec as env_spec
from ._rollout import RolloutContext, derive_seed, run_trajectory
from ._tool_process import open_tool_processes
from ._types import Trajectory, TrajectoryWriter, read_trajectories

IfExists = Literal["error", "overwrite", "append"]
ROLLOUT_FILES = ("config.json", "trajectories.jsonl", "summary.json", "report.html")
"""What ``agentrl rollout --out DIR`` writes (``--overwrite`` removes exactly these)."""
TRAINING_FILES = ("ledger.jsonl", "checkpoints")
"""Any of these (or a ``config.json`` saying ``"train": true``) marks a training run, which a
rollout never writes into."""
_APPEND_FREE = ("concurrency", "tool_threads", "tool_processes", "max_abandoned_threads")
"""Rollout settings that do not change what is sampled: an append may change them."""

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .engine import Engine, EngineOptions


@dataclass
class RolloutResult:
    """What ``rollout`` / ``arollout`` return."""

    trajectories: list[Trajectory]
    """This call's finished trajectories, in (task, sample) order."""
    elapsed_s: float
    """Wall-clock seconds of the rollout (engine start excluded)."""
    out_dir: Path | None
    """The run directory, when ``out`` was given."""
    model_path: str
    """The model folder the engine loaded (or the ``model`` name an engine was passed with)."""
    planned: int = 0
    """Trajectories this call set out to run (tasks × group size)."""
    interrupted: bool = False
    """``stop`` was set: the trajectories in flight were cancelled (none of them is written)."""
    appended_to: int = 0
    """Trajectories the run directory held before this call (``if_exists="append"``)."""


async def run_groups(
    ctx: RolloutContext,
    tasks: Sequence[Any],
    *,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    first_sample: Mapping[str, int] | None = None,
    stop: anyio.Event | None = None,
    suffix: str = "",
) -> list[Trajectory]:
    """Run ``group_size`` samples of every task, at most ``concurrency`` at once.

    One failing trajectory never cancels its siblings (failures are recorded on it). Sample
    indices of a group start at ``first_sample[group_id]`` (default 0). When ``stop`` is set the
    trajectories still running are cancelled and the finished ones are returned. Group ids are
    ``env/task`` + ``suffix``."""
    cfg = ctx.config
    limiter = anyio.CapacityLimiter(cfg.concurrency)
    if ctx.tool_limiter is None:
        ctx.tool_limiter = anyio.CapacityLimiter(cfg.tool_threads)
    results: dict[tuple[int, int], Trajectory] = {}

    async def one(task_index: int, task: Any, sample: int, slot: HeldSlot) -> None:
        group_id = f"{ctx.spec.id}/{task.id}{suffix}"
        seed = derive_seed(cfg.seed, ctx.spec.id, task.id, sample)
        traj = await run_trajectory(
            ctx, task, group_id=group_id, sample_index=sample, seed=seed, slot=slot
        )
        results[(task_index, sample)] = traj
        if on_trajectory is not None:
            on_trajectory(traj)

    if stop is not None and stop.is_set():
        return []
    async with AsyncExitStack() as stack:
        if ctx.tool_processes is None:  # isolation="process" tool workers, killed at the end
            ctx.tool_processes = await stack.enter_async_context(
                open_tool_processes(cfg.tool_processes)
            )
            stack.callback(setattr, ctx, "tool_processes", None)
        await _run_all(ctx, tasks, one, limiter, first_sample, stop)
    return [results[k] for k in sorted(results)]


class HeldSlot:
    """A generation slot taken for a trajectory before it starts; released when its episode
    ends (``run_trajectory``'s ``slot``)."""

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self._limiter = limiter

    async def take(self) -> None:
        await self._limiter.acquire_on_behalf_of(self)

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        self._limiter.release_on_behalf_of(self)


async def _run_all(
    ctx: RolloutContext,
    tasks: Sequence[Any],
    one: Callable[[int, Any, int, HeldSlot], Any],
    limiter: anyio.CapacityLimiter,
    first_sample: Mapping[str, int] | None,
    stop: anyio.Event | None,
) -> None:
    """Start the trajectories in (task, sample) order, each once a generation slot is free: at
    most ``concurrency`` episodes run, and a rollout of any size holds only those (and the ones
    being scored), not a waiting task per sample."""
    async with anyio.create_task_group() as watch:
        if stop is not None:
            watch.start_soon(cancel_when_set, stop, watch.cancel_scope)
        async with anyio.create_task_group() as tg:
            for ti, task in enumerate(tasks):
                start = (first_sample or {}).get(f"{ctx.spec.id}/{task.id}", 0)
                for sample in range(start, start + ctx.config.group_size):
                    slot = HeldSlot(limiter)
                    await slot.take()
                    tg.start_soon(one, ti, task, sample, slot)
        watch.cancel_scope.cancel()


async def cancel_when_set(stop: anyio.Event, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once ``stop`` is set (run it in a task beside the work)."""
    await stop.wait()
    scope.cancel()


def config_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``["rollout.temperature: 1.0 → 0.7", ...]``: every leaf where two JSON-like values
    differ (a key only one side has shows as ``<absent>``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in old:
                out.append(f"{name}: <absent> → {json.dumps(new[key])}")
            elif key not in new:
                out.append(f"{name}: {json.dumps(old[key])} → <absent>")
            else:
                out += config_diff(old[key], new[key], name)
        return out
    if old == new:
        return []
    return [f"{prefix or '(value)'}: {json.dumps(old)} → {json.dumps(new)}"]


def _resolved_config(
    env_id: str,
    model: str,
    model_path: str,
    n: int,
    split: str,
    task_offset: int,
    cfg: RolloutConfig,
) -> dict[str, Any]:
    return {
        "env": env_id,
        "model": model,
        "model_path": model_path,
        "n": n,
        "split": split,
        "task_offset": task_offset,
        "rollout": cfg.model_dump(mode="json"),
    }


def _sampling_part(config: dict[str, Any]) -> dict[str, Any]:
    """What must match for an append: env, model, engine, split and what decides the samples
    (a run written before ``config.json`` named its engine ran the embedded one)."""
    rollout = {k: v for k, v in dict(config.get("rollout") or {}).items() if k not in _APPEND_FREE}
    keys = ("env", "env_entry_point", "model", "split")
    part = {k: config.get(k) for k in keys if k in config}
    return {**part, "engine": config.get("engine", "embedded"), "rollout": rollout}


def entry_point_name(spec: Any) -> str:
    """``module.qualname`` of an env's entry point (where its id came from)."""
    entry = spec.entry_point
    return f"{spec.module}.{getattr(entry, '__qualname__', type(entry).__name__)}"


def _as_recorded(config: dict[str, Any]) -> dict[str, Any]:
    """A rollout's recorded ``config.json`` with each rollout field added since it was written
    set to the value it ran with (``ROLLOUT_LEGACY_VALUES``): an append compares like with
    like, and one that gives the same value may go on."""
    rollout = config.get("rollout")
    if not isinstance(rollout, dict):
        return config
    return {**config, "rollout": {**ROLLOUT_LEGACY_VALUES, **rollout}}


def engine_label(engine: Any) -> str:
    """How ``config.json`` names the engine a rollout ran on: ``embedded`` when ``arollout``
    opened it, else the engine's ``label`` (the scripted engine: ``scripted:FILE``) or its
    class name."""
    if engine is None:
        return "embedded"
    label = getattr(engine, "label", None)
    return label if isinstance(label, str) else type(engine).__name__


def read_config_json(path: Path, what: str) -> dict[str, Any]:
    """A run folder's ``config.json`` as an object, or ``ConfigError`` naming the file (``what``
    says who reads it: ``--append``, ``inspect``)."""
    config = read_json_value(path, what)
    if not isinstance(config, dict):
        raise ConfigError(f"{what}: {path} is not a JSON object (got {type(config).__name__})")
    return config


def is_training_config(out: Path) -> bool:
    """Does ``out/config.json`` say the folder is a training run's (``"train": true``)? A
    missing, unreadable or non-regular file does not."""
    config = out / "config.json"
    try:
        return config.is_file() and json.loads(config.read_text()).get("train") is True
    except (OSError, ValueError, AttributeError):
        return False


def describe_run_dir(out: Path) -> tuple[list[str], list[str]]:
    """``(training-run markers, rollout files)`` found in ``out``."""
    training = [name for name in TRAINING_FILES if (out / name).exists()]
    if is_training_config(out):
        training.append("config.json of a training run")
    rollout = [name for name in ROLLOUT_FILES if (out / name).exists()]
    return training, rollout


def refuse_training_run(out: Path, writer: str) -> list[str]:
    """Refuse an ``--out`` that is a file or holds a training run (``writer``, e.g. "a
    rollout", names what never writes into one), or a folder or link under a rollout file's
    name; return the rollout files it holds."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    training, held = describe_run_dir(out)
    if training:
        raise ConfigError(
            f"--out {out} holds a training run ({', '.join(training)}); {writer} never writes "
            "into one: choose another directory"
        )
    for name in held:
        path = out / name
        if path.is_symlink() or not path.is_file():
            raise ConfigError(
                f"--out {out}: {name} is not a regular file (a folder or a link): {writer} "
                "neither replaces nor writes through it; move it away or choose another --out"
            )
    return held


def check_run_dir(out: Path, if_exists: IfExists) -> list[str]:
    """Refuse ``out`` early (before a model is loaded) when it holds a training run, or a
    rollout and ``if_exists="error"``; return the rollout files it holds."""
    held = refuse_training_run(out, "a rollout")
    if held and if_exists == "error":
        count = _count_lines(out / "trajectories.jsonl")
        raise ConfigError(
            f"--out {out} already holds a rollout ({', '.join(held)}; {count} trajectories): "
            "choose another directory, or pass --overwrite to replace it or --append to add to it"
        )
    return held


def prepare_run_dir(
    out: Path, resolved: dict[str, Any], if_exists: IfExists
) -> tuple[dict[str, int], int]:
    """Check ``out`` against ``if_exists`` (``check_run_dir``) and write its ``config.json``;
    return the first free sample index per group and the number of trajectories already there
    (both empty/0 unless appending). An append whose env, model, split or sampling settings
    differ from the run's raises ``ConfigError`` naming each difference."""
    held = check_run_dir(out, if_exists)
    first_sample: dict[str, int] = {}
    previous: list[Trajectory] = []
    config = resolved
    if held and if_exists == "overwrite":
        for name in held:
            (out / name).unlink()
    elif held and if_exists == "append":
        if not (out / "config.json").is_file():
            raise ConfigError(f"--append: {out} has no config.json (not an agentrl rollout)")
        old = read_config_json(out / "config.json", "--append")
        mine = _sampling_part(resolved)
        if "env_entry_point" not in old:  # recorded before the field: the id alone
            mine.pop("env_entry_point", None)
        differ = config_diff(_sampling_part(_as_recorded(old)), mine)
        if differ:
            raise ConfigError(
                f"--append: this rollout differs from the one in {out}: " + "; ".join(differ)
            )
        existing = out / "trajectories.jsonl"
        try:
            previous = read_trajectories(str(existing)) if existing.is_file() else []
        except ValueError as exc:
            raise ConfigError(f"--append: {exc}") from None
        for traj in previous:
            first_sample[traj.group_id] = max(
                first_sample.get(traj.group_id, 0), traj.sample_index + 1
            )
        call = {k: resolved[k] for k in ("n", "task_offset", "rollout")}
        config = {**old, "appended": [*old.get("appended", []), call]}
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / "config.json", json.dumps(config, indent=2))
    return first_sample, len(previous)


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


async def arollout(
    env: str,
    *,
    model: str = "tiny-random",
    n: int = 8,
    split: str = "train",
    task_offset: int = 0,
    config: RolloutConfig | None = None,
    out: str | Path | None = None,
    engine: Engine | None = None,
    engine_options: EngineOptions | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    env_resources: dict[str, Any] | None = None,
    if_exists: IfExists = "error",
    stop: anyio.Event | None = None,
    on_tasks: Callable[[int], None] | None = None,
) -> RolloutResult:
    """Roll out ``n`` tasks × ``config.group_size`` samples of ``env`` on ``model``.

    ``model`` is a registered model name or a local HF folder; ``engine`` (any ``Engine``)
    overrides the embedded engine, otherwise opened with ``engine_options`` (``EngineOptions``:
    device, dtype, batch size...). With ``out`` the run directory gets ``config.json`` and
    ``trajectories.jsonl`` (written as each trajectory finishes); a directory that already
    holds a rollout is refused unless ``if_exists`` is ``"overwrite"`` or ``"append"``. Setting
    ``stop`` cancels the trajectories in flight and returns the finished ones
    (``interrupted=True``). ``on_tasks`` is called with the number of tasks found from
    ``task_offset`` (at most ``n``; fewer when the split ends first) before the engine loads."""
    cfg = config or RolloutConfig()
    for name, value, least in (("n", n, 1), ("task_offset", task_offset, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
    spec = env_spec(env)
    resources = dict(env_resources or {})
    # the env's arguments are checked before a model is fetched or torch is imported
    taken = sorted(set(cfg.env_kwargs) & set(resources))
    if taken:
        raise ConfigError(
            f"env_kwargs {taken[0]!r}: the run gives the environment its {taken[0]} itself "
            "(--sandbox / sandbox:); drop it from env_kwargs"
        )
    tasks = split_tasks(spec.make(**cfg.env_kwargs, **resources), spec.id, split, cfg.seed)
    check_task_ids(tasks, spec.id, split)
    if task_offset >= len(tasks):
        raise ConfigError(
            f"task_offset {task_offset}: {spec.id}'s {split!r} split has {len(tasks)} tasks "
            f"(offsets 0-{len(tasks) - 1}); nothing to run"
        )
    tasks = tasks[task_offset : task_offset + n]
    if on_tasks is not None:
        on_tasks(len(tasks))

    from ._models import load_tokenizer, resolve_model, tokenizer_fingerprint
    from .engine import open_embedded_engine
    from .formats import get_format

    model_path = str(resolve_model(model)) if engine is None or tokenizer is None else model
    if tokenizer is None:
        tokenizer = load_tokenizer(model_path)
    fmt = get_format("chatml-hermes", tokenizer)
    out_dir: Path | None = None
    writer: TrajectoryWriter | None = None
    first_sample: dict[str, int] = {}
    previous = 0
    if out is not None:  # refused before a model is loaded
        out_dir = Path(out)
        resolved = _resolved_config(spec.id, model, model_path, n, split, task_offset, cfg)
        resolved["engine"] = engine_label(engine)
        # what the id named: two modules may register one id (an append must not mix them)
        resolved["env_entry_point"] = entry_point_name(spec)
        first_sample, previous = prepare_run_dir(out_dir, resolved, if_exists)
    async with AsyncExitStack() as stack:
        if engine is None:
            engine = await stack.enter_async_context(
                open_embedded_engine(model_path, engine_options)
            )
        if out_dir is not None:
            writer = stack.enter_context(TrajectoryWriter(str(out_dir / "trajectories.jsonl")))
        ctx = RolloutContext(
            spec=spec,
            engine=engine,
            fmt=fmt,
            config=cfg,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            model_name=model,
            env_resources=resources,
        )

        def sink(traj: Trajectory) -> None:
            if writer is not None:
                writer.write(traj)
            if on_trajectory is not None:
                on_trajectory(traj)

        started = time.perf_counter()
        trajectories = await run_groups(
            ctx, tasks, on_trajectory=sink, first_sample=first_sample, stop=stop
        )
        elapsed = time.perf_counter() - started
    return RolloutResult(
        trajectories,
        elapsed,
        out_dir,
        model_path,
        planned=len(tasks) * cfg.group_size,
        interrupted=stop is not None and stop.is_set(),
        appended_to=previous,
    )


def rollout(
    env: str,
    *,
    model: str = "tiny-random",
    n: int = 8,
    split: str = "train",
    task_offset: int = 0,
    config: RolloutConfig | None = None,
    out: str | Path | None = None,
    engine: Engine | None = None,
    engine_options: EngineOptions | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    env_resources: dict[str, Any] | None = None,
    if_exists: IfExists = "error",
    on_tasks: Callable[[int], None] | None = None,
    backend: Literal["trio", "asyncio"] = "trio",
) -> RolloutResult:
    """Synchronous ``arollout`` (same parameters but ``stop``, an event of the loop this call
    creates: Ctrl-C ends a synchronous rollout instead) on its own event loop, trio by
    default."""
    return anyio.run(
        lambda: arollout(
            env,
            model=model,
            n=n,
            split=split,
            task_offset=task_offset,
            config=config,
            out=out,
            engine=engine,
            engine_options=engine_options,
            tokenizer=tokenizer,
            on_trajectory=on_trajectory,
            env_resources=env_resources,
            if_exists=if_exists,
            on_tasks=on_tasks,
        ),
        backend=backend,
    )
