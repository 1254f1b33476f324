"""A checkpoint's manifest: every file's size and content hash, written when the checkpoint is
saved and checked before it is trusted.

``manifest.json`` lists each file of the checkpoint folder (relative path → byte size and
BLAKE2b-256 of the contents). ``write_manifest`` reads each file once to hash it and fsyncs it
in the same pass (the save needs the fsync anyway, and the bytes were just written, so they are
read back from the page cache); files are hashed on a few threads (``hashlib`` releases the GIL
on large buffers), so ZeRO's per-rank shard files hash in parallel. BLAKE2b is used because it
is the fastest cryptographic hash in the standard library on CPUs without SHA extensions
(measured 0.57 GB/s against SHA-256's 0.33 GB/s on one core of an AVX-512 Xeon without SHA-NI):
a 1 GB checkpoint costs about 1.8 s of one core to hash.

``check_manifest`` compares sizes (cheap: catches a truncated file) and, with ``contents``,
hashes (catches a garbled one). The first broken file is named in a ``CheckpointError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentrl._errors import AgentRLError

MANIFEST = "manifest.json"
HASH = "blake2b-256"
_CHUNK = 4 << 20


class CheckpointError(AgentRLError):
    """A checkpoint is missing, broken, incomplete, or does not belong to this run's
    configuration; the message names the checkpoint and the file."""


class CheckpointUnreadable(AgentRLError):
    """A checkpoint file this process may not read (permissions, an I/O error): not a broken
    checkpoint — a lookup stops here rather than set it aside and resume from an older one."""


class CheckpointTooNew(CheckpointUnreadable):
    """A checkpoint a newer agentrl wrote (a ``checkpoint_format`` this one does not read)."""


def unreadable(path: Path, exc: OSError) -> CheckpointUnreadable:
    if isinstance(exc, PermissionError):
        fix = "give this process access to the checkpoint (its owner and mode)"
    else:
        fix = "check the file and the disk it is on"
    return CheckpointUnreadable(
        f"cannot read {path} ({type(exc).__name__}: {exc.strerror or exc}): nothing was "
        f"changed; {fix}, then run again"
    )


def _readable_failure(exc: BaseException) -> bool:
    """An ``OSError`` that says the file is there but cannot be read by us."""
    return isinstance(exc, OSError) and not isinstance(
        exc, FileNotFoundError | NotADirectoryError | IsADirectoryError
    )


def _hash_file(path: Path, *, fsync: bool) -> tuple[int, str]:
    digest = hashlib.blake2b(digest_size=32)
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(fh.fileno())
    return size, digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(
        Path(dirpath, name).relative_to(folder)
        for dirpath, _, names in os.walk(folder)
        for name in names
        if not (dirpath == str(folder) and name == MANIFEST)
    )


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a folder's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dirs(folder: Path) -> None:
    for dirpath, _, _ in os.walk(folder):
        fsync_dir(dirpath)


def write_manifest(folder: str | os.PathLike[str]) -> dict[str, dict[str, int | str]]:
    """Hash and fsync every file under ``folder``, then write and fsync ``manifest.json``
    (and the folders). Returns the manifest's ``files`` mapping."""
    folder = Path(folder)
    names = _files(folder)
    with ThreadPoolExecutor(_workers()) as pool:
        results = list(pool.map(lambda rel: _hash_file(folder / rel, fsync=True), names))
    files = {
        str(rel): {"size": size, "hash": digest}
        for rel, (size, digest) in zip(names, results, strict=True)
    }
    with open(folder / MANIFEST, "w") as fh:
        json.dump({"hash": HASH, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dirs(folder)
    return files


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, dict[str, int | str]] | None:
    """The manifest's ``files`` mapping; None when the folder has no manifest; a manifest that
    cannot be read raises ``CheckpointError``."""
    file = Path(folder) / MANIFEST
    if not file.exists():
        return None
    try:
        data = json.loads(file.read_bytes())
        files = data["files"]
        if data.get("hash") != HASH or not isinstance(files, dict):
            raise ValueError(f"unknown hash {data.get('hash')!r} or no files")
        for rel, entry in files.items():
            if not isinstance(entry["size"], int) or not isinstance(entry["hash"], str):
                raise ValueError(f"bad entry for {rel!r}")
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ValueError(f"{rel!r} is outside the checkpoint")
    except OSError as exc:
        if _readable_failure(exc):
            raise unreadable(file, exc) from None
        raise CheckpointError(f"{file} is unreadable ({type(exc).__name__}: {exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{file} is unreadable ({type(exc).__name__}: {exc})") from None
    return files


def check_manifest(folder: str | os.PathLike[str], *, contents: bool = True) -> bool:
    """Check ``folder`` against its manifest: every listed file present with its size and (with
    ``contents``) its hash. ``CheckpointError`` names the first broken file; returns False when
    the folder has no manifest (nothing was checked), True when it matched."""
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        return False
    for rel, entry in files.items():
        path = folder / rel
        try:
            st = os.stat(path)
        except OSError as exc:
            if _readable_failure(exc):
                raise unreadable(path, exc) from None
            raise CheckpointError(f"{path} is missing (listed in {folder / MANIFEST})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is missing (listed in {folder / MANIFEST})")
        size = st.st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{path} is {size} bytes, {entry['size']} were written (truncated or replaced)"
            )
    if contents:
        rels = sorted(files)
        try:
            with ThreadPoolExecutor(_workers()) as pool:
                results = list(pool.map(lambda rel: _hash_file(folder / rel, fsync=False), rels))
        except OSError as exc:
            path = Path(exc.filename) if exc.filename else folder
            if _readable_failure(exc):
                raise unreadable(path, exc) from None
            raise CheckpointError(f"{path} is missing (listed in {folder / MANIFEST})") from None
        for rel, (_, digest) in zip(rels, results, strict=True):
            if digest != files[rel]["hash"]:
                raise CheckpointError(
                    f"{folder / rel}: its contents changed since it was saved ({HASH} differs "
                    "from the manifest's)"
                )
    return True
