"""One writer per run folder: ``OUT/.agentrl.lock``.

The process that writes the run files (rank 0; the only process of a single-process run) holds
an exclusive ``fcntl.flock`` on ``OUT/.agentrl.lock`` from before its first write until the run
ends, and writes its pid and host into the file. A second ``agentrl train`` into the same folder
(``--resume`` or a new run) is refused with one line naming the folder and the holder, before it
writes anything; the kernel drops the lock when the holder exits, however it ends (a SIGKILL
too), so a stale file never blocks a resume. The checkpoint root is locked the same way
(``ROOT/.agentrl.lock``; it may be a ``checkpoint.dir`` outside ``OUT``), so two runs given one
``checkpoint.dir`` never write their checkpoints into each other's, even when both start
before either has written one.

Under ``torchrun`` only rank 0 takes the lock (every rank of one run shares the folder); the
outcome is gathered to every rank, so a refusal stops all of them with the same error instead of
leaving the others waiting in a collective. The lock is taken on the filesystem of ``OUT``: NFS
(v4, or v3 with lockd) shares it between nodes; a filesystem without ``flock`` (Lustre mounted
without ``-o flock``) runs unlocked, saying so.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agentrl._errors import ConfigError
from agentrl._outfiles import write_error

from ._ranks import raise_on_every_rank

T = TypeVar("T")
LOCK_FILE = ".agentrl.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLock:
    """An exclusive ``flock`` on ``OUT/.agentrl.lock`` (``acquire``), held until ``release``."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, out: Path, *, checkpoints: bool = False) -> RunLock:
        """Lock ``out`` (created when missing) for this process; ``ConfigError`` naming the
        holder's pid when another process holds it. ``checkpoints``: ``out`` is the run's
        checkpoint root (the refusal says so)."""
        path = out / LOCK_FILE
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # a symlink there (ELOOP), a folder, no permission
            raise ConfigError(f"{path}: the run folder's lock cannot be opened ({exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if checkpoints:
                raise ConfigError(
                    f"checkpoint root {out} is in use: another agentrl run ({holder}) writes its "
                    f"checkpoints there (it holds {path}); give this run another checkpoint.dir, "
                    "or wait for that run to end"
                ) from None
            raise ConfigError(
                f"{out} is in use: another agentrl run ({holder}) holds {path}; wait for it to "
                "end, or stop it first"
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _UNSUPPORTED:
                raise
            print(
                f"warning: {path} cannot be locked on this filesystem ({exc.strerror}): nothing "
                "stops a second run from writing into this folder at the same time",
                flush=True,
            )
            return cls(path, None)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError as exc:  # a full disk
            os.close(fd)
            raise write_error(path, exc) from exc
        return cls(path, fd)

    def release(self) -> None:
        """Give the lock up (idempotent); the file stays, for the next run to lock."""
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def _holder(fd: int) -> str:
    """What the holder wrote into the lock file (``pid N on HOST``)."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown"


class RunLocks:
    """The locks one run holds (its folder's, then its checkpoint root's), released together."""

    def __init__(self, locks: list[RunLock]) -> None:
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def lock_run_folder(out: Path, *, lead: bool) -> RunLocks | None:
    """Rank 0 (``lead``) locks ``out``; every rank gets the outcome, so a refusal (or any
    failure to take the lock) raises the same ``ConfigError`` on every rank. Returns the locks
    on rank 0 (``lock_checkpoint_root`` adds the root's), None elsewhere. Call after the
    process group exists."""
    return _everywhere(lambda: RunLocks([RunLock.acquire(out)]), lead)


def lock_checkpoint_root(locks: RunLocks | None, root: Path, out: Path, *, lead: bool) -> None:
    """Rank 0 locks the checkpoint root ``root`` (created when missing) into ``locks``, with
    ``lock_run_folder``'s rules. Taken once the run is known to go on (after the refusals of
    a resume), so a refused command never creates the root. A root that is the run folder
    itself is locked already."""
    if root.resolve() == out.resolve():
        return
    taken = _everywhere(lambda: RunLock.acquire(root, checkpoints=True), lead)
    if locks is not None and taken is not None:
        locks.locks.append(taken)


def _everywhere(take: Callable[[], T], lead: bool) -> T | None:
    """``take()`` on rank 0, its failure raised on every rank."""
    lock, failure = None, None
    if lead:
        try:
            lock = take()
        except Exception as exc:  # every rank must hear of it, not only this one
            failure = exc
    raise_on_every_rank(failure, ConfigError)
    return lock
