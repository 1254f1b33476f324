"""The run's append-only JSONL files (``ledger.jsonl``, ``trajectories.jsonl``, ...) at a
checkpoint and at resume.

A checkpoint records each run file's byte length; resume cuts the file back to it, dropping what
was written after the checkpoint. Two rules make that safe:

- **A record belongs to the checkpoint exactly when its newline lies within the recorded
  length.** ``record_lengths`` flushes the writers, fsyncs each file (so the bytes it counts
  are on the disk before the checkpoint that counts them), and records the offset just past the
  last complete line: a line being written concurrently is left to the next checkpoint.
  ``restore_run_files`` cuts back to the last newline at or before the recorded length, so a
  torn last line is never left behind.
- **Resume never pads.** A file *shorter* than its recorded length lost records that the
  checkpoint counted (a crash before they reached the disk, a copy that was cut short, an edit).
  Extending it would put NUL bytes where those records were. The policy is the caller's:
  ``short="refuse"`` (the default) raises ``RunFileError`` naming the file, its length and the
  recorded one, and what to do; ``short="recover"`` keeps the file's complete lines and accepts
  the loss (the lost records are not re-created; the run's history has a gap there), and the
  returned ``RunFileRepair`` says so.

Run files must be regular files in the run directory: a symlink or a folder under a run file's
name is refused (truncating through a symlink would cut a file elsewhere). Valid JSON lines never
hold a raw NUL byte, so NUL bytes in a run file are damage (an older resume padded a short file
with them): refused, or cut at the line before them under ``short="recover"``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

from agentrl._errors import AgentRLError
from agentrl._outfiles import regular_or_missing
from agentrl.trainer import fsync_dir

_CHUNK = 1 << 20


class RunFileError(AgentRLError):
    """A run file cannot be restored to a checkpoint's recorded length without losing or
    inventing records; the message names the file, both lengths and what to do."""


class SupportsFlush(Protocol):
    def flush(self) -> None: ...


class RunFileRepair(NamedTuple):
    """What ``restore_run_files`` did to one run file."""

    name: str
    """The file's name in the run directory."""
    size_before: int
    """Its byte length before the restore."""
    size_after: int
    """Its byte length after the restore."""
    recorded: int
    """The length the checkpoint recorded (0 when it recorded none)."""
    lost: bool
    """True when records the checkpoint counted are gone (``short="recover"`` accepted it)."""


def _regular_or_missing(path: Path) -> os.stat_result | None:
    """The file's stat, None when it does not exist; a symlink, folder or other non-regular
    file under a run file's name is refused."""
    return regular_or_missing(path, error=RunFileError, written_as="a JSONL run file")


def _line_end_at_or_before(fd: int, limit: int) -> int:
    """The offset just past the last newline in bytes ``[0, limit)``; 0 when there is none."""
    end = limit
    while end > 0:
        start = max(0, end - _CHUNK)
        chunk = os.pread(fd, end - start, start)
        at = chunk.rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def _first_nul(fd: int, limit: int) -> int | None:
    """The offset of the first NUL byte in bytes ``[0, limit)``, None when there is none."""
    offset = 0
    while offset < limit:
        chunk = os.pread(fd, min(_CHUNK, limit - offset), offset)
        if not chunk:
            return None
        at = chunk.find(b"\0")
        if at >= 0:
            return offset + at
        offset += len(chunk)
    return None


def record_lengths(
    out: str | os.PathLike[str], names: Iterable[str], writers: Iterable[SupportsFlush] = ()
) -> dict[str, int]:
    """The lengths a checkpoint records for the run files ``names`` under ``out``: each
    writer's buffer is flushed first, then each file is fsynced and its length taken up to the
    end of its last complete line. Files that do not exist are left out (a resume treats them
    as empty). Call it after the step's records are written and before saving the checkpoint.
    """
    out = Path(out)
    for writer in writers:
        writer.flush()
    lengths: dict[str, int] = {}
    for name in names:
        path = out / name
        if _regular_or_missing(path) is None:
            continue
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
            lengths[name] = _line_end_at_or_before(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    fsync_dir(out)
    return lengths


def _short_message(path: Path, size: int, recorded: int, why: str) -> str:
    return (
        f"{path} {why}, but the checkpoint recorded {recorded} bytes: records the checkpoint "
        "counted are lost (a crash before they reached the disk, a partial copy, or an edit), "
        "and padding the file would put NUL bytes in their place. Restore the file from a "
        "copy, or resume accepting the loss (agentrl train --resume RUN --accept-lost-records: "
        "the file is cut to its last complete line and the lost records stay missing), or "
        "start the run over in a new output directory"
    )


def _plan(out: Path, name: str, recorded: int, short: str) -> RunFileRepair:
    """Where ``name`` must be cut (``size_after``), checked against the policy; changes
    nothing."""
    path = out / name
    st = _regular_or_missing(path)
    if st is None:
        if recorded > 0 and short == "refuse":
            raise RunFileError(_short_message(path, 0, recorded, "does not exist"))
        return RunFileRepair(name, 0, 0, recorded, lost=recorded > 0)
    size = st.st_size
    limit, lost = min(size, recorded), size < recorded
    if lost and short == "refuse":
        raise RunFileError(_short_message(path, size, recorded, f"is {size} bytes"))
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        nul = _first_nul(fd, limit)
        if nul is not None:
            if short == "refuse":
                raise RunFileError(
                    f"{path} holds NUL bytes from offset {nul} (within the {recorded} bytes the "
                    "checkpoint recorded): an older resume padded a file that had lost its "
                    "tail. Restore the file from a copy, or resume accepting the loss "
                    "(--accept-lost-records: the file is cut to its last complete line before "
                    "the NUL bytes), or start the run over in a new output directory"
                )
            limit, lost = nul, True
        keep = _line_end_at_or_before(fd, limit)
    finally:
        os.close(fd)
    return RunFileRepair(name, size, keep, recorded, lost=lost)


def check_run_files(
    out: str | os.PathLike[str],
    lengths: Mapping[str, int],
    names: Iterable[str],
    *,
    short: Literal["refuse", "recover"] = "refuse",
) -> None:
    """What ``restore_run_files`` would refuse, refused without changing anything."""
    for name in names:
        _plan(Path(out), name, lengths.get(name, 0), short)


def restore_run_files(
    out: str | os.PathLike[str],
    lengths: Mapping[str, int],
    names: Iterable[str],
    *,
    short: Literal["refuse", "recover"] = "refuse",
) -> list[RunFileRepair]:
    """Cut each run file ``names`` under ``out`` back to the length a checkpoint recorded in
    ``lengths`` (a name it does not list: 0, the file is emptied), to the last complete line
    at or before it. Never extends a file.

    ``short`` is the policy for a file shorter than recorded (or missing), or holding NUL
    bytes: ``"refuse"`` raises ``RunFileError`` before any file is changed; ``"recover"`` cuts
    it to its last complete line before the damage. A symlink or folder under a run file's name
    is refused under both. Returns one ``RunFileRepair`` per file changed or lost (``lost``
    marks those that lost records the checkpoint counted)."""
    if short not in ("refuse", "recover"):
        raise ValueError(f"short must be 'refuse' or 'recover', not {short!r}")
    out = Path(out)
    plans = [_plan(out, name, lengths.get(name, 0), short) for name in names]
    changed = [p for p in plans if p.size_after != p.size_before or p.lost]
    for plan in changed:
        if plan.size_after == plan.size_before:
            continue
        fd = os.open(out / plan.name, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, plan.size_after)
            os.fsync(fd)
        finally:
            os.close(fd)
    if changed:
        fsync_dir(out)
    return changed
