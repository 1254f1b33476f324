"""A checkpoint save that failed: clean up, and say why in words that lead to a fix.

A full disk is the common cause and the one with a misleading symptom: torch's writer reports it
as a bare ``RuntimeError`` without an errno, and the failed save's folder keeps the disk full.
``save_failed`` removes that folder after closing the files the failed writers still held (an
exception's frames keep them open, and an unlinked open file keeps its blocks), and for a full
disk names ENOSPC, the free space, what one checkpoint takes and the room ``checkpoint.keep``
needs: one checkpoint's size × (keep + 1), the kept ones plus the one being written before the
oldest is pruned.
"""

from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path

from agentrl._errors import exception_chain
from agentrl._outfiles import human_size, is_disk_full

from ._manifest import CheckpointError


def _tree_size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


_FULL_FLOOR = 64 << 20


def _disk_full(exc: BaseException, free: int, one_checkpoint: int) -> bool:
    """ENOSPC/EDQUOT anywhere in the exception's chain, or (torch's writer reports a full disk
    as a bare ``RuntimeError`` with no errno) less room left than one checkpoint needs."""
    return is_disk_full(exc) or free < max(_FULL_FLOOR, one_checkpoint)


def _release_frames(exc: BaseException) -> None:
    """Drop the local variables of the frames of ``exc`` and the exceptions it chains to
    (torch's writer fails a second time while closing: its file is held by that chained
    exception's frames)."""
    for link in exception_chain(exc):
        traceback.clear_frames(link.__traceback__)


def save_failed(
    exc: Exception, root: Path, tmp: Path, final: Path, *, keep: int, previous: Path | None
) -> Exception:
    """The ``CheckpointError`` for a save of ``final`` that failed with ``exc``, after removing
    its partial folder ``tmp``; ``previous``: the newest complete checkpoint (its size is what
    one checkpoint takes)."""
    if isinstance(exc, CheckpointError):
        return exc
    # the failed writers' frames may hold open files: close them, or the removed files would
    # keep their blocks (a full disk would stay full for as long as the error lives)
    _release_frames(exc)
    written = _tree_size(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    one = _tree_size(previous) if previous else 0
    free = shutil.disk_usage(root).free
    cause = f"{type(exc).__name__}: {exc}"
    if not _disk_full(exc, free, one):
        return CheckpointError(
            f"writing checkpoint {final.name} in {root} failed ({cause}); its partial folder "
            "was removed and the earlier checkpoints are untouched"
        )
    if one:
        size = f"{human_size(one)} ({previous.name})"
    else:
        size = f"at least {human_size(written)} (what this save wrote before the disk filled)"
    need = human_size(max(one, written) * (keep + 1))
    return CheckpointError(
        f"no space left on device (ENOSPC) writing checkpoint {final.name} in {root} "
        f"({cause}): {human_size(free)} free there. One checkpoint takes {size}; "
        f"checkpoint.keep={keep} needs about {need} ({keep} kept + the one being written, "
        f"before the oldest is pruned). The partial {tmp.name} was removed and the earlier "
        "checkpoints are untouched: free space, lower checkpoint.keep, or set checkpoint.dir "
        "to a larger disk"
    )
