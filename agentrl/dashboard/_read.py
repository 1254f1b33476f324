"""Reading a run folder for the dashboard: the step ledger, the runtime's interval records,
and a per-step summary of the trajectories. Lines that do not parse (a torn last line of a
killed run, a corrupted record, JSON nested past the parser's depth) are skipped and counted,
never fatal. A run file that is not a readable regular file (a FIFO, ``/proc/kmsg`` under its
name, one without read permission) is refused with one line naming it (``RunFileError``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agentrl._errors import ConfigError
from agentrl._outfiles import display_text, json_record, read_run_config, run_file_lines

RUN_FILES = ("ledger.jsonl", "runtime.jsonl", "trajectories.jsonl")


class _TrajectorySummary(msgspec.Struct):
    """The few fields of a trajectory line the dashboard reads (the rest are skipped unparsed
    into objects: token ids and logprobs stay out of memory)."""

    reward: float | None = None
    termination_reason: str | None = None
    status: str | None = None
    tool_calls: list[Any] = msgspec.field(default_factory=list)
    info: dict[str, Any] = msgspec.field(default_factory=dict)


_TRAJECTORY = msgspec.json.Decoder(_TrajectorySummary)


@dataclass
class StepRewards:
    """The rewards of one step's trajectories (every fate) and how they ended."""

    rewards: list[float] = field(default_factory=list)
    fates: dict[str, int] = field(default_factory=dict)


@dataclass
class RunData:
    """What one run folder holds, as the dashboard reads it."""

    path: Path
    name: str
    ledger: list[dict[str, Any]]
    """One record per line of ``ledger.jsonl`` (training steps and evaluation rows)."""
    runtime: list[dict[str, Any]]
    """The runtime's interval records (``runtime.jsonl``), in time order."""
    steps: dict[int, StepRewards]
    """Per step, from ``trajectories.jsonl`` (each trajectory's ``info.step``)."""
    skipped: dict[str, int]
    """Per file: lines that did not parse and were skipped."""
    config: dict[str, Any]
    """The run's ``config.yaml`` (empty when missing or unreadable)."""


MAX_SAFE_INT = 2**53 - 1
"""The largest integer a browser holds exactly (JavaScript's ``Number.MAX_SAFE_INTEGER``)."""


def _unplottable(value: Any) -> bool:
    """NaN/Infinity (JSON's extensions), or an integer a browser would read as Infinity or
    round (a step of 400 digits in someone else's run file)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SAFE_INT


def finite(value: Any) -> Any:
    """JSON's NaN/Infinity extensions, and integers past what a browser holds exactly, become
    None (the page's JSON has no such numbers). Iterative: a record nested deeper than Python's
    recursion limit is still walked."""
    if not isinstance(value, dict | list | tuple):
        return None if _unplottable(value) else value
    root: list[Any] = [value]
    stack: list[tuple[Any, list[Any] | dict[Any, Any], Any]] = [(value, root, 0)]
    while stack:
        node, parent, slot = stack.pop()
        if isinstance(node, dict):
            copy: dict[Any, Any] | list[Any] = {}
            items: Iterable[tuple[Any, Any]] = node.items()
        elif isinstance(node, list | tuple):
            copy, items = [None] * len(node), enumerate(node)
        elif _unplottable(node):
            parent[slot] = None
            continue
        else:
            parent[slot] = node
            continue
        parent[slot] = copy
        stack.extend((child, copy, key) for key, child in items)
    return root[0]


MAX_RECORD_BYTES = 16 << 20
"""The longest ledger, runtime or trajectory line the dashboard reads (a longer one is counted
with the unreadable lines: the parsed form of a line holds many times its bytes)."""

MAX_MAPPING_FIELDS = 10_000
"""The most entries a record's mapping field (``termination``, ``version_lag_hist``) keeps."""


def _lines(path: Path) -> Iterable[tuple[int, bytes]]:
    """The lines of the run file ``path``; none when nothing has its name."""
    try:
        yield from run_file_lines(path, max_line=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSONL file (the fields a plot can use: numbers, text and mappings
    of them), and how many non-blank lines were not one."""
    rows: list[dict[str, Any]] = []
    bad = 0
    for _, raw in _lines(path):
        if not raw.strip():
            continue
        row = json_record(raw)
        if row is None:  # torn or corrupted (bad UTF-8 and too deep included), or not an object
            bad += 1
            continue
        rows.append(finite(_plottable_fields(row)))
    return rows, bad


def _plottable_fields(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without lists and nested structures (task ids, tracebacks' frames: nothing the
    dashboard draws, and a line of them held many times its size once parsed)."""
    kept: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            scalars = [(k, v) for k, v in value.items() if not isinstance(v, dict | list)]
            kept[key] = dict(scalars[:MAX_MAPPING_FIELDS])
        elif not isinstance(value, list):
            kept[key] = value
    return kept


def read_step_rewards(path: Path) -> tuple[dict[int, StepRewards], int]:
    """Per step, the rewards and fates of its trajectories; and the lines skipped."""
    steps: dict[int, StepRewards] = {}
    bad = 0
    for _, raw in _lines(path):
        if not raw.strip():
            continue
        try:
            traj = _TRAJECTORY.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            bad += 1
            continue
        step = traj.info.get("step")  # written as text by the learner role
        if isinstance(step, bool) or not isinstance(step, int | str):
            continue  # not a training trajectory of a step (e.g. written by `rollout`)
        try:
            step = int(step)
        except ValueError:
            continue
        if not 0 <= step <= MAX_SAFE_INT:
            continue  # no step a run records
        into = steps.setdefault(step, StepRewards())
        if traj.reward is not None and math.isfinite(traj.reward):
            into.rewards.append(traj.reward)
        fate = traj.info.get("fate")
        fate = fate if isinstance(fate, str) and fate else "unknown"
        into.fates[fate] = into.fates.get(fate, 0) + 1
    return steps, bad


def _config(run: Path) -> dict[str, Any]:
    try:
        config = read_run_config(run / "config.yaml")
    except (FileNotFoundError, ConfigError):  # the header then leaves the settings out
        return {}
    return config if isinstance(config, dict) else {}


def load_run(path: str | Path, name: str | None = None) -> RunData:
    """Read the run folder ``path``; a folder that is missing or holds none of the run files
    is a ``ConfigError`` naming it."""
    run = Path(path)
    if not run.is_dir():
        what = "is not a folder" if run.exists() else "does not exist"
        raise ConfigError(f"run folder {str(run)!r} {what}")
    if not any((run / f).is_file() for f in RUN_FILES):
        raise ConfigError(
            f"run folder {str(run)!r} holds none of {', '.join(RUN_FILES)}: not a training "
            "run's output folder (agentrl train --out)"
        )
    ledger, bad_ledger = read_records(run / "ledger.jsonl")
    runtime, bad_runtime = read_records(run / "runtime.jsonl")
    runtime.sort(key=lambda r: r["time_s"] if isinstance(r.get("time_s"), int | float) else 0)
    steps, bad_trajectories = read_step_rewards(run / "trajectories.jsonl")
    skipped = {
        "ledger.jsonl": bad_ledger,
        "runtime.jsonl": bad_runtime,
        "trajectories.jsonl": bad_trajectories,
    }
    return RunData(
        path=run,
        name=display_text(name or run.resolve().name),
        ledger=ledger,
        runtime=runtime,
        steps=steps,
        skipped={k: v for k, v in skipped.items() if v},
        config=_config(run),
    )
