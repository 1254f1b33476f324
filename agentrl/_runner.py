"""Run many trajectories: groups of G samples per task, bounded concurrency, JSONL as they finish.

``rollout()`` / ``arollout()`` are the Python API behind ``agentrl rollout``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio

from ._config import RolloutConfig
from ._registry import spec as env_spec
from ._rollout import RolloutContext, derive_seed, run_trajectory
from ._types import Trajectory, TrajectoryWriter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .engine import Engine, EngineOptions


@dataclass
class RolloutResult:
    """What ``rollout`` / ``arollout`` return."""

    trajectories: list[Trajectory]
    """Every trajectory, in task order, ``group_size`` samples per task."""
    elapsed_s: float
    """Wall-clock seconds of the rollout (engine start excluded)."""
    out_dir: Path | None
    """The run directory, when ``out`` was given."""
    model_path: str
    """The model folder the engine loaded (or the ``model`` name an engine was passed with)."""


async def run_groups(
    ctx: RolloutContext,
    tasks: Sequence[Any],
    *,
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Run ``group_size`` samples of every task, at most ``concurrency`` at once.

    One failing trajectory never cancels its siblings (failures are recorded on it)."""
    cfg = ctx.config
    limiter = anyio.CapacityLimiter(cfg.concurrency)
    if ctx.tool_limiter is None:
        ctx.tool_limiter = anyio.CapacityLimiter(cfg.tool_threads)
    results: dict[tuple[int, int], Trajectory] = {}

    async def one(task_index: int, task: Any, sample: int) -> None:
        async with limiter:
            group_id = f"{ctx.spec.id}/{task.id}"
            seed = derive_seed(cfg.seed, ctx.spec.id, task.id, sample)
            traj = await run_trajectory(
                ctx, task, group_id=group_id, sample_index=sample, seed=seed
            )
        results[(task_index, sample)] = traj
        if on_trajectory is not None:
            on_trajectory(traj)

    async with anyio.create_task_group() as tg:
        for ti, task in enumerate(tasks):
            for sample in range(cfg.group_size):
                tg.start_soon(one, ti, task, sample)
    return [results[k] for k in sorted(results)]


def _resolved_config(
    env_id: str, model: str, model_path: str, n: int, split: str, cfg: RolloutConfig
) -> dict[str, Any]:
    return {
        "env": env_id,
        "model": model,
        "model_path": model_path,
        "n": n,
        "split": split,
        "rollout": cfg.model_dump(mode="json"),
    }


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
) -> RolloutResult:
    """Roll out ``n`` tasks × ``config.group_size`` samples of ``env`` on ``model``.

    ``model`` is a registered model name or a local HF folder; ``engine`` (any ``Engine``)
    overrides the embedded engine, otherwise opened with ``engine_options`` (``EngineOptions``:
    device, dtype, batch size...). With ``out`` the run directory gets ``config.json`` and
    ``trajectories.jsonl`` (appended as each trajectory finishes)."""
    from ._models import resolve_model, tokenizer_fingerprint
    from .engine import open_embedded_engine
    from .formats import get_format

    cfg = config or RolloutConfig()
    spec = env_spec(env)
    model_path = str(resolve_model(model)) if engine is None or tokenizer is None else model
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    fmt = get_format("chatml-hermes", tokenizer)
    resources = dict(env_resources or {})
    tasks = list(spec.make(**cfg.env_kwargs, **resources).tasks(split, seed=cfg.seed))
    tasks = tasks[task_offset : task_offset + n]
    out_dir: Path | None = None
    writer: TrajectoryWriter | None = None
    async with AsyncExitStack() as stack:
        if engine is None:
            engine = await stack.enter_async_context(
                open_embedded_engine(model_path, engine_options)
            )
        if out is not None:
            out_dir = Path(out)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.json").write_text(
                json.dumps(_resolved_config(spec.id, model, model_path, n, split, cfg), indent=2)
            )
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
        trajectories = await run_groups(ctx, tasks, on_trajectory=sink)
        elapsed = time.perf_counter() - started
    return RolloutResult(trajectories, elapsed, out_dir, model_path)


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
    backend: Literal["trio", "asyncio"] = "trio",
) -> RolloutResult:
    """Synchronous ``arollout`` (same parameters) on its own event loop, trio by default."""
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
        ),
        backend=backend,
    )
