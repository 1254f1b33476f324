"""Held-out evaluation during training, and the sandbox's ledger fields."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import anyio

from agentrl._rollout import RolloutContext, derive_seed
from agentrl._runner import run_groups
from agentrl._types import Trajectory
from agentrl.envs._sandbox_open import interval_metrics

from ._ledger import rollout_metrics
from ._ranks import gather, in_task_order, shard


def sandbox_metrics(resources: dict[str, Any], prefix: str = "sandbox") -> dict[str, Any]:
    """The run's sandbox activity since the previous call, every rank's (``sandbox/…`` ledger
    fields; see docs/training.md), or nothing when the env runs no code."""
    runner = resources.get("sandbox")
    if runner is None:
        return {}
    return interval_metrics(gather(runner.take_interval()), prefix)


class Evaluator:
    """Held-out evaluation: the first ``eval.num_tasks`` tasks of the eval split, one sample
    each, a fixed seed (so curves compare policies, not samples); split over the ranks like
    training tasks, metrics from all of them. Group ids end in ``@eval<step>`` (trajectory ids
    stay unique over the run)."""

    def __init__(self, cfg: Any, base: RolloutContext, tasks: list[Any], files: Any) -> None:
        self.cfg, self.tasks, self.files = cfg, tasks, files
        self.ctx = dataclasses.replace(base, config=eval_rollout(cfg))

    async def __call__(self, step: int, stop: anyio.Event | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        mine = await run_groups(self.ctx, shard(self.tasks), stop=stop, suffix=f"@eval{step}")
        if stop is not None and stop.is_set():
            return {}
        trajs = in_task_order(self.tasks, gather(mine))
        if self.files is not None:
            for traj in trajs:
                self.files.eval_trajectory(traj)
        metrics = eval_metrics(trajs, self.cfg.train.pass_threshold, time.perf_counter() - started)
        return {**metrics, **sandbox_metrics(self.ctx.env_resources, "eval_sandbox")}


def eval_rollout(cfg: Any) -> Any:
    """The rollout settings of an evaluation: one sample per task at ``eval.temperature``,
    a fixed seed."""
    return cfg.rollout.model_copy(
        update={
            "group_size": 1,
            "temperature": cfg.eval.temperature,
            "seed": derive_seed(cfg.rollout.seed, "eval"),
        }
    )


def eval_metrics(trajs: list[Trajectory], threshold: float, elapsed: float) -> dict[str, Any]:
    m = rollout_metrics(trajs, pass_threshold=threshold, elapsed_s=elapsed)
    return {
        "eval_reward_mean": m["reward_mean"],
        "eval_pass_rate": m["pass_rate"],
        "eval_tool_calls_per_trajectory": m["tool_calls_per_trajectory"],
        "eval_s": elapsed,
    }
