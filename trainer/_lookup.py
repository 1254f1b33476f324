"""Finding a checkpoint to trust: the loop state a checkpoint records (``state.json``), checked
key by key, and the newest intact checkpoint under a root.

A checkpoint is trusted only after ``verify_checkpoint`` found every file its manifest lists
(``_manifest``) present with its size and hash, and ``state.json`` complete: each key present, of
its type, no unknown key. ``find_intact_checkpoint`` walks the checkpoints newest first and
returns the newest intact one with the reason it skipped each newer one; with none intact it
raises ``CheckpointError`` naming each broken file and how to start over (a new run). A
checkpoint saved without a manifest (by an older agentrl: ``state.json`` has no
``checkpoint_format``) is accepted after a structural check only, with a ``CheckpointWarning``.
A checkpoint whose ``state.json`` names another step than its ``step-N`` folder is broken.
"""

from __future__ import annotations

import json
import math
import os
import re
import typing
import warnings
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from ._manifest import (
    MANIFEST,
    CheckpointError,
    CheckpointTooNew,
    check_manifest,
    unreadable,
)

IN_FLIGHT_RULE = "discard-after-checkpoint"
CHECKPOINT_FORMAT = 2
"""1: no manifest (older agentrl); 2: ``manifest.json`` lists every file's size and hash."""
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped as broken, or trusted without a manifest."""


@dataclass
class LoopState:
    """What a resumed loop needs besides the engines' state."""

    step: int
    """Completed learner steps."""
    policy_version: int
    """The version the engines were last given (the weights in this checkpoint)."""
    data_cursor: int
    """Training tasks consumed so far: the next step starts at this index of the task stream."""
    tokenizer_fingerprint: str
    config_hash: str
    model_path: str
    in_flight: str = IN_FLIGHT_RULE
    file_lengths: dict[str, int] = field(default_factory=dict)
    """Byte length of each append-only run file (``ledger.jsonl``, ...) at checkpoint time."""
    created: float = 0.0
    checkpoint_format: int = 1
    """Set by ``save_checkpoint`` (``CHECKPOINT_FORMAT``); 1 in checkpoints of older agentrl."""
    world_size: int = 0
    """Ranks that saved the checkpoint (set by ``save_checkpoint``; 0 in checkpoints of older
    agentrl: counted from their ``rng-rank*.pt`` files)."""
    tasks: dict[str, Any] = field(default_factory=dict)
    """The loop's task accounting (``agentrl.loop``'s ``TaskLedger.state()``: ``low``, every
    slot below it settled; ``settled``, the settled slots above it; ``next``, the first slot
    never handed out); empty in checkpoints that predate it (``data_cursor`` says it all)."""
    steps_without_update: int = 0
    """Consecutive steps up to ``step`` that trained on nothing (the loop's stall count, so a
    resumed run stops where the uninterrupted one would); 0 in checkpoints that predate it."""
    run_id: str = ""
    """The run that wrote it (its folder's ``config.json`` ``run_id``), so that a resume never
    continues one run from another's checkpoints; empty in checkpoints that predate it."""


def _step_dirs(root: Path) -> list[Path]:
    """Every ``step-NNNNNNNN`` folder under ``root`` (complete or not), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if p.is_dir()]


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Checkpoints under ``root`` that hold a ``state.json``, oldest first (not verified:
    ``find_intact_checkpoint`` verifies)."""
    return [p for p in _step_dirs(Path(root)) if (p / "state.json").is_file()]


class CheckpointLookup(NamedTuple):
    """What ``find_intact_checkpoint`` found."""

    path: Path | None
    """The newest intact checkpoint; None when ``root`` holds no checkpoint at all."""
    state: LoopState | None
    """Its loop state."""
    skipped: list[tuple[Path, str]]
    """Each newer checkpoint that was broken, newest first, with the reason (naming the file)."""


def find_intact_checkpoint(root: str | os.PathLike[str], *, contents: bool = True):
    """The newest checkpoint under ``root`` that ``verify_checkpoint`` accepts (``contents``:
    hash every file too, not only sizes), and the broken newer ones it skipped. When checkpoints
    exist but none is intact, ``CheckpointError`` names each broken file."""
    root = Path(root)
    skipped: list[tuple[Path, str]] = []
    for path in reversed(_step_dirs(root)):
        try:
            state = verify_checkpoint(path, contents=contents)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        return CheckpointLookup(path, state, skipped)
    if skipped:
        broken = "\n".join(f"  {path.name}: {reason}" for path, reason in skipped)
        raise CheckpointError(
            f"no intact checkpoint under {root}:\n{broken}\nThe run cannot be resumed; to train "
            "it again from step 1, start a new run from its configuration (agentrl train "
            "--config RUN/config.yaml --out NEW_RUN), and keep the broken checkpoints for a "
            f"look by moving them away (mv {root} {root}.broken)"
        )
    return CheckpointLookup(None, None, [])


def latest_checkpoint(root: str | os.PathLike[str], *, contents: bool = True) -> Path | None:
    """The newest intact checkpoint under ``root`` (None when there is none); each newer broken
    one is skipped with a ``CheckpointWarning`` naming its broken file
    (``find_intact_checkpoint``)."""
    found = find_intact_checkpoint(root, contents=contents)
    for path, reason in found.skipped:
        warnings.warn(
            CheckpointWarning(f"skipped broken checkpoint {path}: {reason}; using {found.path}"),
            stacklevel=2,
        )
    return found.path


def _checked_value(name: str, hint: Any, value: Any) -> str | None:
    origin = typing.get_origin(hint) or hint
    if origin is float:
        origin = (int, float)
    if not isinstance(origin, type | tuple):
        return None
    if isinstance(value, bool) or not isinstance(value, origin):
        return f"{name} is {value!r}"
    if name == "tasks":
        return _checked_tasks(value)
    if origin is dict and not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in value.items()
    ):
        return f"{name} is {value!r} (names to non-negative byte lengths)"
    return None


def _checked_tasks(value: dict[str, Any]) -> str | None:
    if not value:
        return None

    def slot(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    settled = value.get("settled")
    ok = set(value) == {"low", "settled", "next"} and slot(value["low"]) and slot(value["next"])
    ok = ok and isinstance(settled, list) and all(slot(x) for x in settled)
    if not ok:
        return f"tasks is {value!r} (low, settled, next: task slots)"
    return None


def read_state(path: str | os.PathLike[str]) -> LoopState:
    """The checkpoint's ``state.json`` as a ``LoopState``; a missing, unreadable or incomplete
    file raises ``CheckpointError`` naming it and what is wrong."""
    file = Path(path) / "state.json"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint")
    try:
        data = json.loads(file.read_bytes())
    except PermissionError as exc:
        raise unreadable(file, exc) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    hints = typing.get_type_hints(LoopState)
    required = [f.name for f in fields(LoopState) if f.default is f.default_factory is MISSING]
    problems = [f"{name} is missing" for name in required if name not in data]
    problems += [f"{key!r} is not a loop-state key" for key in data if key not in hints]
    problems += [
        p for key, v in data.items() if key in hints and (p := _checked_value(key, hints[key], v))
    ]
    if not problems and data.get("checkpoint_format", 1) > CHECKPOINT_FORMAT:
        raise CheckpointTooNew(
            f"{file}: checkpoint format {data['checkpoint_format']}, written by a newer agentrl "
            f"(this one reads formats 1 to {CHECKPOINT_FORMAT}): nothing was changed; resume it "
            "with the agentrl that wrote it"
        )
    problems = problems or _meaning(data)
    if problems:
        raise CheckpointError(f"{file} is damaged: {'; '.join(problems)}")
    return LoopState(**data)


IN_FLIGHT_RULES = (IN_FLIGHT_RULE, "requeue")
"""The in-flight rules checkpoints record (older agentrl's default; the loop's)."""
MAX_WORLD_SIZE = 1 << 20
MAX_OPEN_SLOTS = 1_000_000
"""Task slots handed out and not yet settled that a checkpoint may record: a step holds at most
``tasks_per_step × (max_version_lag + 1)`` and its refills; a resumed run samples them again."""


def _meaning(data: dict[str, Any]) -> list[str]:
    """What a well-typed ``state.json`` may still get wrong (a hand edit, a damaged or hostile
    file whose manifest was rewritten): counters below zero, a format from a newer agentrl,
    task accounting that is not one (it would be sampled again, slot by slot)."""
    problems = [
        f"{key} is {data[key]!r} (a count: >= 0)"
        for key in ("step", "policy_version", "data_cursor", "steps_without_update", "world_size")
        if key in data and data[key] < 0
    ]
    idle = data.get("steps_without_update", 0)
    if idle > data["step"]:
        problems.append(f"steps_without_update {idle} > step {data['step']}")
    if data.get("checkpoint_format", 1) < 1:
        problems.append(f"checkpoint_format is {data['checkpoint_format']!r} (1 or more)")
    world = data.get("world_size", 0)  # 0: not recorded (counted from the RNG files)
    if world > MAX_WORLD_SIZE:
        problems.append(f"world_size is {world!r} (saved by at most {MAX_WORLD_SIZE} ranks)")
    if data.get("in_flight", IN_FLIGHT_RULE) not in IN_FLIGHT_RULES:
        problems.append(f"in_flight is {data['in_flight']!r} (one of {', '.join(IN_FLIGHT_RULES)})")
    created = data.get("created", 0.0)
    if isinstance(created, float) and not math.isfinite(created):
        problems.append(f"created is {created!r} (a time)")
    tasks = data.get("tasks") or {}
    if tasks:
        low, nxt, settled = tasks["low"], tasks["next"], tasks["settled"]
        if not low <= nxt:
            problems.append(f"tasks.low {low} > tasks.next {nxt}")
        elif nxt - low > MAX_OPEN_SLOTS:
            problems.append(f"tasks: {nxt - low} open task slots (at most {MAX_OPEN_SLOTS})")
        elif any(not low <= slot < nxt for slot in settled) or len(set(settled)) < len(settled):
            problems.append(f"tasks.settled {settled!r:.80} (distinct slots in [low, next))")
        if low != data["data_cursor"]:
            problems.append(f"tasks.low {low} is not data_cursor {data['data_cursor']}")
    return problems


def verify_checkpoint(path: str | os.PathLike[str], *, contents: bool = True) -> LoopState:
    """Check a checkpoint folder before trusting it: every file its manifest lists present with
    the size (and, with ``contents``, the hash) it was saved with, ``state.json`` complete, and
    (in a ``step-N`` folder) its step N. ``CheckpointError`` names the broken file. A
    checkpoint saved by an older agentrl without a manifest is accepted when its ``state.json``
    and ``policy/`` folder are there, with a ``CheckpointWarning`` (its files cannot be
    verified)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder")
    verified = check_manifest(path, contents=contents)
    state = read_state(path)
    named = _STEP_DIR.match(path.name)
    if named and int(named.group(1)) != state.step:
        raise CheckpointError(
            f"{path / 'state.json'} is the checkpoint of step {state.step}, not of the step its "
            f"folder is named for (a folder copied or renamed over another): move it away"
        )
    if verified:
        return state
    if state.checkpoint_format >= 2:
        raise CheckpointError(f"{path / MANIFEST} is missing (this checkpoint was saved with one)")
    if not (path / "policy").is_dir():
        raise CheckpointError(f"{path / 'policy'} is missing (the policy's DeepSpeed state)")
    warnings.warn(
        CheckpointWarning(
            f"{path} was saved without a manifest (an older agentrl): its files' sizes and "
            "contents cannot be verified"
        ),
        stacklevel=2,
    )
    return state
