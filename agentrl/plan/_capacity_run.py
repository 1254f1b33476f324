"""Calibrate ``agentrl plan capacity`` from a run: its rates, and what it measured.

A run folder may come from anyone (a downloaded run): every value read from its
``config.yaml``, ``ledger.jsonl`` and ``runtime.jsonl`` is checked before it is used, and a
wrong one is refused with one line naming the file, the line or key, and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._config import short_repr
from .._errors import ConfigError
from .._outfiles import RunFileError, display_text, json_record, read_run_config, run_file_lines
from ._capacity import CapacitySettings

Record = tuple[int, dict[str, Any]]
"""A line number and the JSON object on that line."""


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


def _read_jsonl(path: Path) -> list[Record]:
    """The records of a run file with their line numbers; a line that does not parse (a torn
    last line, bytes that are not UTF-8, JSON nested too deep) is skipped. A path that is not a
    readable regular file (a FIFO, a device, ``/proc/kmsg``) is refused without blocking."""
    try:
        return [(n, row) for n, line in run_file_lines(path) if (row := json_record(line))]
    except FileNotFoundError:
        raise ConfigError(f"--from-run: no {display_text(path)}") from None
    except RunFileError as exc:
        raise ConfigError(f"--from-run: {exc}") from None


MAX_VALUE = 1e15
"""The largest number taken from a run file (tokens, seconds, counts): sums and products of
such numbers over a ledger stay far inside a float's range."""


def _bad(where: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"--from-run: {where}: {short_repr(value)}: expected {expected}")


def _number(path: Path, record: Record, key: str, *, required: bool = False) -> float:
    """``record[key]`` as a finite float >= 0; 0.0 when absent (unless ``required``)."""
    lineno, row = record
    return _checked(f"{display_text(path)}: line {lineno}: {key}", row.get(key), required)


def _checked(where: str, value: Any, required: bool = False) -> float:
    if value is None:
        if required:
            raise ConfigError(f"--from-run: {where}: missing (a training step's record has it)")
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(where, value, "a number")
    try:
        number = float(value)
    except OverflowError:
        raise _bad(where, value, "a number a float can hold") from None
    if not (math.isfinite(number) and number >= 0):
        raise _bad(where, value, "a finite number >= 0")
    if number > MAX_VALUE:
        raise _bad(where, value, f"a number up to {MAX_VALUE:g} (no run records more)")
    return number


def _step(path: Path, record: Record, *, required: bool) -> int:
    lineno, row = record
    value = row.get("step")
    if value is None:
        if required:
            raise ConfigError(f"--from-run: {display_text(path)}: line {lineno}: step: missing")
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{display_text(path)}: line {lineno}: step", value, "an integer step")
    return value


def _sum(path: Path, records: list[Record], *keys: str) -> float:
    return math.fsum(_number(path, r, k) for r in records for k in keys)


def _mapping(config: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(f"{display_text(path)}: {key}", value, "a mapping")
    return value


MAX_SETTING = 10**9
"""The largest run setting (group size, tasks per step, ...) read from a run's config."""


def _setting(section: dict[str, Any], name: str, key: str, default: int, path: Path) -> int:
    value = section.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SETTING:
        raise _bad(
            f"{display_text(path)}: {name}.{key}", value, f"an integer from 1 to {MAX_SETTING}"
        )
    return value


def _config(run: Path) -> dict[str, Any]:
    try:
        config = read_run_config(run / "config.yaml")
    except FileNotFoundError:
        raise ConfigError(f"--from-run {run}: cannot read config.yaml: no such file") from None
    except ConfigError as exc:
        raise ConfigError(f"--from-run {run}: cannot read config.yaml: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--from-run {run}: config.yaml is not a mapping")
    return config


def from_run(run_dir: str) -> tuple[CapacitySettings, RunMeasures]:
    """Rates and settings from a run's config and ledger, and its measured schedule."""
    run = Path(run_dir)
    config = _config(run)
    config_path = run / "config.yaml"
    ledger = run / "ledger.jsonl"
    if not ledger.exists():
        raise ConfigError(f"--from-run {run}: no ledger.jsonl (not a training run folder?)")
    rows = [
        r
        for r in _read_jsonl(ledger)
        if "update_s" in r[1] and r[1].get("trajectories") not in (None, 0)
    ]
    if len(rows) < 2:
        raise ConfigError(f"--from-run {run}: {len(rows)} training step(s) in the ledger; need 2")
    # the first step includes start-up (compiles, an empty pipeline); the last one drains it
    # (nothing more is admitted, so actors idle): a steady state leaves both out when it can
    steady = rows[1:-1] if len(rows) >= 4 else rows[1:]
    train = _mapping(config, "train", config_path)
    rollout = _mapping(config, "rollout", config_path)
    urls = _mapping(config, "server", config_path).get("urls") or []
    if not isinstance(urls, list):
        raise _bad(f"{display_text(config_path)}: server.urls", urls, "a list")
    engines = max(1, len(urls))
    busy = math.fsum(
        (1 - _number(ledger, r, "actor_idle_fraction"))
        * _number(ledger, r, "step_s", required=True)
        for r in steady
    )
    gen_tokens = _sum(ledger, steady, "gen_tokens")
    learner_tokens = _sum(ledger, steady, "learner_tokens")
    settings = CapacitySettings(
        actor_tokens_per_s=gen_tokens / max(busy, 1e-9) / engines,
        learner_tokens_per_s=learner_tokens
        / max(_sum(ledger, steady, "update_s", "reference_s", "logprob_s"), 1e-9),
        gen_tokens=gen_tokens / max(_sum(ledger, steady, "trajectories"), 1),
        learner_tokens=learner_tokens / max(_sum(ledger, steady, "trajectories_trained"), 1),
        group_size=_setting(rollout, "rollout", "group_size", 1, config_path),
        tasks_per_step=_setting(train, "train", "tasks_per_step", 1, config_path),
        max_version_lag=_setting(train, "train", "max_version_lag", 0, config_path)
        if train.get("mode") == "async"
        else 0,
        publish_s=_sum(ledger, steady, "publish_s", "checkpoint_s", "dashboard_s") / len(steady),
        concurrency=_setting(rollout, "rollout", "concurrency", 64, config_path),
    )
    measures = _measures(ledger, steady, engines)
    runtime = run / "runtime.jsonl"
    if runtime.exists():  # interval samples: a time average rather than one value per step
        first = _step(ledger, steady[0], required=True)
        last = _step(ledger, steady[-1], required=True)
        samples = [
            r for r in _read_jsonl(runtime) if first <= _step(runtime, r, required=False) <= last
        ]
        if samples:
            measures.backlog_mean = _sum(runtime, samples, "buffer_backlog") / len(samples)
    return settings, measures


def _lag_hist(path: Path, record: Record) -> dict[int, float]:
    lineno, row = record
    where = f"{display_text(path)}: line {lineno}: version_lag_hist"
    hist = row.get("version_lag_hist")
    if hist is None:
        return {}
    if not isinstance(hist, dict):
        raise _bad(where, hist, "a mapping of lag to groups")
    out = {}
    for lag, count in hist.items():
        if not (lag.isascii() and lag.isdigit() and len(lag) <= 18):
            raise _bad(where, lag, "lags written as digits (a version lag)")
        out[int(lag)] = _checked(f"{where}.{lag}", count)
    return out


def _measures(path: Path, steady: list[Record], actors: int) -> RunMeasures:
    span = _sum(path, steady, "step_s")
    lags: dict[int, float] = {}
    for r in steady:
        for lag, count in _lag_hist(path, r).items():
            lags[lag] = lags.get(lag, 0.0) + count
    total = sum(lags.values()) or 1.0

    def weighted(key: str) -> float:
        return math.fsum(
            _number(path, r, key) * _number(path, r, "step_s", required=True) for r in steady
        ) / max(span, 1e-9)

    return RunMeasures(
        actors=actors,
        steps=len(steady),
        step_s=span / len(steady),
        backlog_mean=weighted("buffer_backlog"),
        lag_hist={k: v / total for k, v in sorted(lags.items())},
        learner_idle_fraction=weighted("learner_idle_fraction"),
        actor_idle_fraction=weighted("actor_idle_fraction"),
    )
