"""The step's ledger record and the runtime's interval record."""

from __future__ import annotations

import time
from typing import Any

from agentrl._errors import AgentRLError

from ._ledger import rollout_metrics


class TrainingStalled(AgentRLError):
    """Several consecutive steps trained on nothing (``train.max_steps_without_update``)."""

    exit_code = 1


def step_record(
    step: int, version: int, data: Any, stream: Any, cursor: int, threshold: float
) -> dict[str, Any]:
    """The step's sampling side: versions, tasks, the trajectories' metrics."""
    trajs = [t for v in data.views for t in v.trajectories]
    trained = [t for v in data.trained for t in v.trajectories]
    lags = [v.lag for v in data.trained] or [0]
    record: dict[str, Any] = {
        "step": step,
        "policy_version": version,
        "rollout_version": min((v.version for v in data.views), default=version - 1),
        "data_cursor": cursor,
        "task_ids": [str(stream.at(s).id) for s in data.primary],
        "task_slots": list(data.primary),
        "version_lag": sum(lags) / len(lags),
        "version_lag_max": max(lags),
        "rollout_s": data.wait_s,
        "sampling_s": data.sampling_s,
        "trajectories_trained": len(trained),
    }
    if data.extra:
        record["extra_task_slots"] = list(data.extra)
    record.update(rollout_metrics(trajs, pass_threshold=threshold, elapsed_s=data.sampling_s))
    return record


def add_learner_stats(record: dict[str, Any], stats: dict[str, Any]) -> None:
    record.update(stats)
    busy = stats["update_s"] + stats["reference_s"] + stats["logprob_s"]
    record["learner_tokens_per_s"] = stats["learner_tokens"] / busy if busy > 0 else None


def trained_on_nothing(record: dict[str, Any]) -> bool:
    return not record.get("updates") or not record.get("trajectories_used")


def stall_reason(steps: int, record: dict[str, Any]) -> str:
    errors, total = record.get("errors", 0), record.get("trajectories", 0)
    why = f"{errors} of {total} trajectories failed"
    first = record.get("first_error")
    if first:
        why += f"; first: {first['where']} {first['type']}: {first['message']}"
    if errors < total:  # the algorithm's masks left nothing (dynamic sampling, overlong filter)
        why += (
            f"; the learner kept {record.get('trajectories_used', 0)} of "
            f"{record.get('trajectories_in', total)} (groups without a reward signal or past "
            "the step's tasks: "
            f"{record.get('groups_filtered', 0) + record.get('groups_surplus', 0)}; "
            f"terminations: {record.get('termination', {})}"
            f"; groups not trained: stale {record.get('groups_stale', 0)}, dropped "
            f"{record.get('groups_dropped', 0)}, timed out {record.get('groups_timed_out', 0)})"
        )
    return f"{steps} consecutive steps trained on nothing ({why})"


class Clock:
    """Wall-clock windows for the idle fractions (actor and learner busy seconds)."""

    def __init__(self, actor: Any, learner: Any) -> None:
        self.actor, self.learner = actor, learner
        self.start = time.perf_counter()
        self._marks: dict[str, tuple[float, float, float]] = {}

    def window(self, name: str) -> dict[str, Any]:
        """Seconds since the previous call for ``name``, and the idle fractions over them."""
        now, actor, learner = time.perf_counter(), self.actor.busy_s(), self.learner.busy_s
        then, actor0, learner0 = self._marks.get(name, (self.start, 0.0, 0.0))
        self._marks[name] = (now, actor, learner)
        span = now - then
        if span <= 0:
            return {"window_s": 0.0}
        return {
            "window_s": span,
            "actor_idle_fraction": max(0.0, 1 - (actor - actor0) / span),
            "learner_idle_fraction": max(0.0, 1 - (learner - learner0) / span),
        }
