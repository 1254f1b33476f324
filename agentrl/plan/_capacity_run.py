"""Calibrate ``agentrl plan capacity`` from a run: its rates, and what it measured."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ._capacity import CapacitySettings


@dataclass
class RunMeasures:
    """What the run's ledger says about its schedule (steady state: the first and, from four
    steps on, the last step left out)."""

    actors: int
    steps: int
    step_s: float
    backlog_mean: float
    lag_hist: dict[int, float]
    learner_idle_fraction: float
    actor_idle_fraction: float

    @property
    def lag_mean(self) -> float:
        return sum(k * v for k, v in self.lag_hist.items())


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a run file; a line that does not parse (a torn last line, bytes that
    are not UTF-8) is skipped. A path that is not a regular file (a FIFO, a device) is refused
    before it is opened."""
    if not path.is_file():
        raise ConfigError(f"--from-run: {path} is not a regular file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--from-run: cannot read {path}: {exc.strerror or exc}") from None
    rows = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # (UnicodeDecodeError included)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _config(run: Path) -> dict[str, Any]:
    from .._config_file import read_config_file

    try:
        config = read_config_file(run / "config.yaml")
    except ConfigError as exc:
        raise ConfigError(f"--from-run {run}: cannot read config.yaml: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--from-run {run}: config.yaml is not a mapping")
    return config


def _sum(rows: list[dict[str, Any]], *keys: str) -> float:
    return float(sum(sum(r.get(k) or 0.0 for k in keys) for r in rows))


def from_run(run_dir: str) -> tuple[CapacitySettings, RunMeasures]:
    """Rates and settings from a run's config and ledger, and its measured schedule."""
    run = Path(run_dir)
    config = _config(run)
    ledger = run / "ledger.jsonl"
    if not ledger.exists():
        raise ConfigError(f"--from-run {run}: no ledger.jsonl (not a training run folder?)")
    rows = [r for r in _read_jsonl(ledger) if "update_s" in r and r.get("trajectories")]
    if len(rows) < 2:
        raise ConfigError(f"--from-run {run}: {len(rows)} training step(s) in the ledger; need 2")
    # the first step includes start-up (compiles, an empty pipeline); the last one drains it
    # (nothing more is admitted, so actors idle): a steady state leaves both out when it can
    steady = rows[1:-1] if len(rows) >= 4 else rows[1:]
    train, rollout = config.get("train") or {}, config.get("rollout") or {}
    urls = (config.get("server") or {}).get("urls") or []
    busy = sum((1 - (r.get("actor_idle_fraction") or 0.0)) * r["step_s"] for r in steady)
    settings = CapacitySettings(
        actor_tokens_per_s=_sum(steady, "gen_tokens") / max(busy, 1e-9) / max(1, len(urls)),
        learner_tokens_per_s=_sum(steady, "learner_tokens")
        / max(_sum(steady, "update_s", "reference_s", "logprob_s"), 1e-9),
        gen_tokens=_sum(steady, "gen_tokens") / max(_sum(steady, "trajectories"), 1),
        learner_tokens=_sum(steady, "learner_tokens")
        / max(_sum(steady, "trajectories_trained"), 1),
        group_size=int(rollout.get("group_size") or 1),
        tasks_per_step=int(train.get("tasks_per_step") or 1),
        max_version_lag=int(train.get("max_version_lag") or 0)
        if train.get("mode") == "async"
        else 0,
        publish_s=_sum(steady, "publish_s", "checkpoint_s") / len(steady),
        concurrency=int(rollout.get("concurrency") or 64),
    )
    measures = _measures(steady, max(1, len(urls)))
    runtime = run / "runtime.jsonl"
    if runtime.exists():  # interval samples: a time average rather than one value per step
        first, last = steady[0]["step"], steady[-1]["step"]
        samples = [r for r in _read_jsonl(runtime) if first <= (r.get("step") or 0) <= last]
        if samples:
            measures.backlog_mean = _sum(samples, "buffer_backlog") / len(samples)
    return settings, measures


def _measures(steady: list[dict[str, Any]], actors: int) -> RunMeasures:
    span = _sum(steady, "step_s")
    lags: dict[int, float] = {}
    for r in steady:
        for lag, count in (r.get("version_lag_hist") or {}).items():
            lags[int(lag)] = lags.get(int(lag), 0.0) + count
    total = sum(lags.values()) or 1.0

    def weighted(key: str) -> float:
        return sum((r.get(key) or 0.0) * r["step_s"] for r in steady) / max(span, 1e-9)

    return RunMeasures(
        actors=actors,
        steps=len(steady),
        step_s=span / len(steady),
        backlog_mean=weighted("buffer_backlog"),
        lag_hist={k: v / total for k, v in sorted(lags.items())},
        learner_idle_fraction=weighted("learner_idle_fraction"),
        actor_idle_fraction=weighted("actor_idle_fraction"),
    )
