"""The run's ledger: ``OUT/ledger.jsonl`` (one JSON object per step, flushed and fsynced),
the trackers' scalars and histograms (TensorBoard, W&B, MLflow: ``_trackers``), and the
terminal progress (rich, with ETA).

Per step, at least: ``step, policy_version, reward_mean, kl, version_lag, gen_tokens_per_s,
learner_tokens, publish_s``; then reward std and pass rate, entropy, clip fractions, ratio
statistics, the rollout↔trainer logprob mismatch (``mismatch_abs_mean``, ``mismatch_kl``),
response length, tool calls and tool errors per trajectory, termination reasons, and the step
time broken into ``rollout_s / reference_s / logprob_s / update_s / publish_s``
(``checkpoint_s`` is the previous step's checkpoint write, ``dashboard_s`` its rewrite of
``dashboard.html``, when there was one). ``eval_*`` fields appear on steps
with an evaluation. Each key of the env's reward breakdown (``Reward.breakdown``) is logged as
``reward/<key>``: its mean over the step's trajectories that report it (a key that names one
of the ledger's own reward tags, ``mean``, ``std``, ``pass_rate`` or ``histogram``, is logged as
``reward/breakdown/<key>``). A step with failed
trajectories carries ``errors`` and ``first_error`` (where, type, message, traceback).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl._outfiles import open_append
from agentrl._types import Trajectory

from ._trackers import TensorBoardTracker, Trackers

# TensorBoard tag prefix per ledger field (fields not listed go under "train/")
_GROUPS = {
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "pass_rate": "reward/pass_rate",
    "eval_reward_mean": "eval/reward_mean",
    "eval_pass_rate": "eval/pass_rate",
    "gen_tokens_per_s": "throughput/gen_tokens_per_s",
    "sampling_s": "throughput/sampling_s",
    "learner_tokens": "throughput/learner_tokens",
    "learner_tokens_per_s": "throughput/learner_tokens_per_s",
    "version_lag": "policy/version_lag",
    "version_lag_max": "policy/version_lag_max",
    "kl": "policy/kl_to_reference",
    "entropy": "policy/entropy",
    "mismatch_abs_mean": "mismatch/logprob_abs_mean",
    "mismatch_abs_max": "mismatch/logprob_abs_max",
    "mismatch_kl": "mismatch/kl",
    "response_tokens_mean": "rollout/response_tokens_mean",
    "turns_mean": "rollout/turns_mean",
    "tool_calls_per_trajectory": "rollout/tool_calls_per_trajectory",
    "tool_errors_per_trajectory": "rollout/tool_errors_per_trajectory",
}
# the runtime's own fields: one TensorBoard section is the runtime's dashboard
_GROUPS.update(
    {
        key: f"runtime/{key}"
        for key in (
            "buffer_backlog", "in_flight_groups", "groups_produced", "groups_consumed",
            "groups_trained", "groups_stale", "groups_dropped", "groups_timed_out",
            "groups_surplus", "generated_tokens", "trained_tokens", "consumed_lag_max",
            "consumed_lag_mean", "sample_age_s_mean", "actor_idle_fraction",
            "learner_idle_fraction", "publish_bytes", "wait_s",
        )
    }
)  # fmt: skip
_TIME_FIELDS = ("rollout_s", "reference_s", "logprob_s", "update_s", "publish_s", "step_s")


_RESERVED_REWARD_TAGS = frozenset({"mean", "std", "pass_rate", "histogram"})


def breakdown_tag(key: str) -> str:
    """The ledger field / TensorBoard tag of a reward breakdown key: ``reward/<key>``, or
    ``reward/breakdown/<key>`` where ``reward/<key>`` is one of the ledger's own tags."""
    if key in _RESERVED_REWARD_TAGS or key.startswith("breakdown/"):
        return f"reward/breakdown/{key}"
    return f"reward/{key}"


def rollout_metrics(
    trajectories: Sequence[Trajectory], *, pass_threshold: float, elapsed_s: float
) -> dict[str, Any]:
    """Reward, pass rate, lengths, tools and termination reasons of one step's trajectories."""
    rewards = [float(t.reward) for t in trajectories if t.reward is not None]
    n = max(1, len(trajectories))
    sampled = [sum(t.loss_mask) for t in trajectories]
    tool_calls = sum(len(t.tool_calls) for t in trajectories)
    tool_errors = sum(1 for t in trajectories for c in t.tool_calls if not c.ok)
    failed = [t for t in trajectories if t.status == "error"]
    parts: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.reward_breakdown.items():
            parts.setdefault(key, []).append(float(value))
    out: dict[str, Any] = {
        "trajectories": len(trajectories),
        "errors": len(failed),
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "pass_rate": sum(r >= pass_threshold for r in rewards) / n,
        "gen_tokens": sum(sampled),
        "gen_tokens_per_s": sum(sampled) / elapsed_s if elapsed_s > 0 else None,
        "response_tokens_mean": sum(sampled) / n,
        "turns_mean": sum(t.num_turns for t in trajectories) / n,
        "tool_calls_per_trajectory": tool_calls / n,
        "tool_errors_per_trajectory": tool_errors / n,
        "termination": dict(Counter(t.termination_reason for t in trajectories)),
    }
    out.update({breakdown_tag(key): statistics.fmean(v) for key, v in sorted(parts.items())})
    if failed:
        out["first_error"] = first_error(failed[0])
    return out


def first_error(traj: Trajectory) -> dict[str, Any]:
    """A failed trajectory's error as a ledger field."""
    error = traj.error
    if error is None:
        return {"trajectory": traj.id, "where": "runtime", "type": "?", "message": ""}
    return {
        "trajectory": traj.id,
        "where": error.where,
        "type": error.type,
        "message": error.message,
        "traceback": error.traceback,
    }


class Ledger:
    """Appends one object per step to ``ledger.jsonl`` and mirrors its numbers to the run's
    trackers (``logging.trackers``; default: TensorBoard in ``OUT/tensorboard``)."""

    def __init__(
        self,
        out: str | os.PathLike[str],
        trackers: Trackers | None = None,
        *,
        purge_step: int | None = None,
    ) -> None:
        """``purge_step`` (a resumed run: the first step it will write again; used by the
        default TensorBoard tracker): TensorBoard discards the earlier run's events at steps >=
        it (``ledger.jsonl`` itself is truncated by the resume)."""
        self.path = Path(out) / "ledger.jsonl"
        self._fh = open_append(self.path)
        if trackers is None:
            trackers = Trackers([TensorBoardTracker(Path(out) / "tensorboard", purge_step)])
        self.trackers = trackers

    def write(self, record: dict[str, Any], *, rewards: Sequence[float] = ()) -> None:
        self._fh.write(json.dumps(record, sort_keys=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.trackers.log_step(int(record["step"]), step_scalars(record), rewards)

    def close(self) -> None:
        try:
            self._fh.close()
        finally:
            self.trackers.close()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A ledger record's numbers under their tracker names: ``reward/mean``,
    ``policy/kl_to_reference``, ``time/update_s``, ``termination/<reason>``,
    ``runtime/version_lag_<k>`` …, ``train/<field>`` for the rest."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "termination" and isinstance(value, dict):
            out.update({f"termination/{reason}": count for reason, count in value.items()})
        elif key == "version_lag_hist" and isinstance(value, dict):
            out.update({f"runtime/version_lag_{lag}": count for lag, count in value.items()})
        elif _number(value):
            tag = _GROUPS.get(key) or (f"time/{key}" if key in _TIME_FIELDS else None)
            if tag is None and "/" in key:  # already a tag: reward/<breakdown key>
                tag = key
            out[tag or f"train/{key}"] = value
    return out


def interval_scalars(record: dict[str, Any]) -> dict[str, float]:
    """An interval record's numbers as ``interval/<field>``: a section of their own, whose x
    axis is time (a step record's ``runtime/…`` are per step), ``interval/time_s`` included
    (the record's own seconds since this process started)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "version_lag_hist" and isinstance(value, dict):
            out.update({f"interval/version_lag_{lag}": count for lag, count in value.items()})
        elif _number(value):
            out[f"interval/{key}"] = value
    return out


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class StepProgress:
    """A rich progress bar (steps, elapsed, ETA, last reward) on a terminal, and one line per
    step either way. Failed trajectories are always reported (even with the progress display
    off): the step's error count and its first error with a short traceback (the traceback once
    while the same error repeats)."""

    def __init__(self, total: int, start: int, *, enabled: bool = True) -> None:
        from rich.console import Console

        self.console = Console(highlight=False, stderr=False, emoji=False)
        self.enabled = enabled
        self._last_traceback: tuple[int, str | None] | None = None
        self._progress = None
        if enabled and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total, completed=start, info="")
            self._progress.start()

    def update(self, record: dict[str, Any]) -> None:
        self._report_errors(record)
        if not self.enabled:
            return
        reward = record.get("reward_mean")
        info = f"reward {reward:.3f}" if reward is not None else "reward -"
        if record.get("errors"):
            info += f" errors {record['errors']}/{record.get('trajectories', '?')}"
        if record.get("eval_reward_mean") is not None:
            info += f" eval {record['eval_reward_mean']:.3f}"
        line = (
            f"step {record['step']} v{record['policy_version']} {info} "
            f"loss {record.get('loss', 0.0):.4f} kl {_fmt(record.get('kl'))} "
            f"gen {_fmt(record.get('gen_tokens_per_s'), '.0f')} tok/s "
            f"step {record.get('step_s', 0.0):.1f}s (rollout {record.get('rollout_s', 0):.1f} "
            f"update {record.get('update_s', 0):.1f} publish {record.get('publish_s', 0):.2f})"
        )
        if self._progress is not None:
            self._progress.update(self._task, advance=1, info=info)
            self._progress.console.print(line)
        else:
            self.console.print(line)

    def evaluated(self, record: dict[str, Any]) -> None:
        """The line of an evaluation outside a step (``eval.at_start``: step 0, before any
        update), so that its result shows before the first step's long wait."""
        if not self.enabled:
            return
        pass_rate = record.get("eval_pass_rate")
        line = (
            f"step {record['step']} v{record['policy_version']} eval "
            f"{_fmt(record.get('eval_reward_mean'), '.3f')} pass "
            f"{'-' if pass_rate is None else f'{pass_rate:.0%}'} "
            f"({record.get('eval_s', 0.0):.1f}s)"
        )
        console = self._progress.console if self._progress is not None else self.console
        console.print(line)

    def _report_errors(self, record: dict[str, Any]) -> None:
        """The step's failures: an env's error message and traceback may carry model or tool
        output, so every string is printed with its control characters made visible."""
        from rich.text import Text

        from agentrl._report_term import one_line, terminal_safe

        first = record.get("first_error")
        if not record.get("errors") or not first:
            return
        console = self._progress.console if self._progress is not None else self.console
        failed = f"step {record['step']}: {record['errors']} of {record.get('trajectories', '?')}"
        console.print(
            Text.assemble(
                (failed + " trajectories failed", "red"),
                one_line(
                    f"; first: {first['trajectory']} ({first['where']}) "
                    f"{first['type']}: {first['message']}"
                ),
            )
        )
        traceback = first.get("traceback")
        if traceback and self._last_traceback is not None and self._last_traceback[1] == traceback:
            console.print(Text(f"  (same traceback as step {self._last_traceback[0]})"))
        elif traceback:
            console.print(Text(terminal_safe("  " + traceback.replace("\n", "\n  "))))
            self._last_traceback = (record["step"], traceback)
        if record.get("stop_reason"):
            console.print(Text(terminal_safe(f"stopping: {record['stop_reason']}"), style="red"))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)
