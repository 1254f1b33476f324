"""Files agentrl writes into folders people name (a run folder, ``--out``, ``--html``).

Every such file is written by name into its folder, never through a link: a symlink under the
name (``RUN/config.json -> /home/me/notes.txt``) would make agentrl write to whatever it
points at. ``write_file`` and ``open_append`` refuse a symlink, a folder or any other
non-regular file under the file's name with an ``OutputError`` naming the path; the folder
itself may be a link (people put runs on other disks that way).

``write_file`` replaces a file whole: the bytes go to a new file beside it, which is then
renamed over the name, so a reader sees the old contents or the new ones, never a mix.
``open_append`` opens with ``O_NOFOLLOW``: the check and the open are one system call.
``replace_page`` guards the HTML outputs a user names (``--out FILE``, ``--html FILE``):
an existing file there is replaced only when it is a page agentrl wrote (``GENERATOR``).

The readers of run folders someone else may have made (``inspect``, ``dashboard``, ``plan
capacity --from-run``) open their files with ``open_run_file``: it never blocks (a FIFO, a
terminal, ``/proc/kmsg`` under a run file's name) and refuses anything but a regular file with
one line naming it (``RunFileError``). ``display_text`` turns a name that is not UTF-8 (a folder
name's stray bytes) into text a page or a terminal can show.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal

from ._errors import ConfigError, OutputError, WriteError, exception_chain

GENERATOR = '<meta name="generator" content="agentrl">'
"""The tag every HTML page agentrl writes carries in its head."""
_PAGE_HEAD = 4096
_CHUNK = 1 << 20
MAX_CONFIG_BYTES = 16 << 20
"""Most bytes ``read_run_file`` reads (a run's config.yaml or config.json is kilobytes)."""


class RunFileError(ConfigError):
    """A run file that cannot be read as one: not a regular file, not permitted, or one whose
    read would block (``/proc/kmsg``). The message is one line naming it."""


_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def display_text(text: str | os.PathLike[str]) -> str:
    """``text`` (or a path) with lone surrogates -- the bytes of a file name that is not
    UTF-8, as Python decodes them -- written as U+FFFD, so a page or a terminal can show it."""
    text = os.fspath(text)
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate no file name has (e.g. one JSON wrote)
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def open_run_file(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` opened for binary reading, never blocking: a FIFO, a device or a terminal
    under the name is refused before anything is read, and so is a file of ``/proc`` or
    ``/sys`` (they claim to be regular; reading ``/proc/kmsg`` blocks, or consumes the kernel's
    log); a read that would block on any other file raises ``BlockingIOError``
    (``run_file_lines`` turns it into a ``RunFileError``). ``FileNotFoundError`` when nothing
    has the name; ``RunFileError`` for anything else that is not a readable regular file."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RunFileError(f"{display_text(path)}: cannot read it ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        special = "a FIFO, a device or another special file"
        what = "a folder" if stat.S_ISDIR(info.st_mode) else special
        raise RunFileError(f"{display_text(path)} is not a regular file (it is {what})")
    kernel = _kernel_filesystem(info.st_dev)
    if kernel is not None:
        os.close(fd)
        raise RunFileError(
            f"{display_text(path)} is a file of the kernel's {kernel}, not a run file (reading "
            "some of them consumes what they hold, /proc/kmsg the kernel's log)"
        )
    return os.fdopen(fd, "rb", buffering=0)


def _kernel_filesystem(device: int) -> str | None:
    """``/proc`` or ``/sys`` when a file with ``st_dev == device`` lies on that filesystem:
    their files claim to be regular but are the kernel's interfaces."""
    for root in ("/proc", "/sys"):
        try:
            if os.stat(root).st_dev == device:
                return root
        except OSError:
            continue
    return None


def _unreadable(path: str | os.PathLike[str], exc: OSError) -> RunFileError:
    why = "its read would block" if isinstance(exc, BlockingIOError) else exc.strerror
    return RunFileError(f"{display_text(path)}: not a readable run file ({why})")


OVERSIZE_LINE = b"\x00"
"""What ``run_file_lines(..., max_line=N)`` yields for a line longer than ``N`` bytes: never
valid JSON, so a reader counts it with the lines it could not read."""


def run_file_lines(
    path: str | os.PathLike[str], *, max_line: int | None = None
) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of the run file ``path`` (``open_run_file``), read unbuffered
    so that a read that would block (``EAGAIN`` from a procfs file) or fails (``EIO``) is a
    ``RunFileError`` rather than a silent end of file. A line longer than ``max_line`` bytes
    (its newline not counted) is not held: ``OVERSIZE_LINE`` stands for it."""
    with open_run_file(path) as fh:
        fd, lineno, held = fh.fileno(), 0, 0
        parts: list[bytes] | None = []  # None: the line is past max_line
        while True:
            try:
                data = os.read(fd, _CHUNK)
            except OSError as exc:
                raise _unreadable(path, exc) from None
            if not data:
                break
            start = 0
            while (end := data.find(b"\n", start)) >= 0:
                lineno += 1
                if parts is None or (max_line is not None and held + end - start > max_line):
                    yield lineno, OVERSIZE_LINE
                else:
                    parts.append(data[start : end + 1])
                    yield lineno, b"".join(parts)
                parts, held, start = [], 0, end + 1
            if start < len(data) and parts is not None:
                parts.append(data[start:])
                held += len(data) - start
                if max_line is not None and held > max_line:
                    parts = None  # the rest of this line is dropped as it arrives
        if parts is None:
            yield lineno + 1, OVERSIZE_LINE
        elif parts:
            yield lineno + 1, b"".join(parts)


def read_run_file(path: str | os.PathLike[str], *, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The whole of the run file ``path`` (``open_run_file``): a config, not a log; one
    larger than ``limit`` bytes, or whose read would block or fails, is a ``RunFileError``."""
    with open_run_file(path) as fh:
        parts, size = [], 0
        while size <= limit:
            try:
                data = os.read(fh.fileno(), min(_CHUNK, limit + 1 - size))
            except OSError as exc:
                raise _unreadable(path, exc) from None
            if not data:
                return b"".join(parts)
            parts.append(data)
            size += len(data)
    raise RunFileError(f"{display_text(path)}: larger than {limit} bytes: not a run's config")


def read_run_config(path: str | os.PathLike[str]) -> Any:
    """The value of a run's config file (YAML; ``.json``: JSON) as ``read_config_file``
    parses it, read with ``read_run_file``: ``FileNotFoundError`` when missing, else a
    ``ConfigError`` naming the file when it cannot be read or parsed."""
    from ._config_file import decode_utf8, load_json, load_yaml

    where = display_text(path)
    text = decode_utf8(read_run_file(path), where)
    return (load_json if Path(path).suffix == ".json" else load_yaml)(text, where)


def json_record(line: bytes) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None when it is not one: torn, not UTF-8, nested past
    the parser's depth (``RecursionError``), or another JSON value."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def regular_or_missing(
    path: str | os.PathLike[str],
    *,
    error: type[Exception] = OutputError,
    written_as: str = "a file",
) -> os.stat_result | None:
    """The stat of ``path`` when it is a regular file, None when nothing has its name; a
    symlink, a folder or any other non-regular file under the name is refused with ``error``
    (the message says agentrl writes ``written_as`` under that name)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise error(
            f"{path} is a symlink (to {os.readlink(path)}); agentrl writes its files by name, "
            "never through a link: remove the link (or replace it with a copy of its target)"
        )
    if not stat.S_ISREG(st.st_mode):
        raise error(
            f"{path} is not a regular file (a folder or a special file has its name); move it "
            f"away: agentrl writes {written_as} under this name"
        )
    return st


def check_writable(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` exists as a regular file, False when nothing has its name; a
    symlink, a folder or any other non-regular file is refused (``OutputError``)."""
    return regular_or_missing(path) is not None


def write_file(path: str | os.PathLike[str], data: str | bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` as the whole contents of ``path`` (created, or replaced atomically);
    refuses a symlink or non-regular file under the name (``check_writable``). A write that
    fails (a full disk) raises ``WriteError`` naming ``path``, and leaves the old file as it
    was."""
    payload = data.encode() if isinstance(data, str) else data

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(payload)

    with writing(path):
        write_via(path, fill, mode=mode)


def write_via(
    path: str | os.PathLike[str], fill: Callable[[str], None], *, mode: int = 0o644
) -> None:
    """Have ``fill(tmp)`` write a new file ``tmp`` beside ``path`` (created empty for it), then
    rename it over ``path``; refuses a symlink or non-regular file under the name
    (``check_writable``). For writers that take a file name (``safetensors.save_file``)."""
    path = Path(path)
    check_writable(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        fill(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # replaces the name itself: a link made meanwhile is not followed
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_append(path: str | os.PathLike[str], mode: Literal["a", "ab"] = "a") -> IO:
    """``open(path, mode)`` for appending, created when missing; refuses a symlink or
    non-regular file under the name (``OutputError``)."""
    check_writable(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:  # a link or a folder put there since the check
        raise OutputError(f"{path}: cannot append to it ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        check_writable(path)
        raise OutputError(f"{path} is not a regular file")
    return os.fdopen(fd, mode)


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT anywhere in the exception's chain (writers that wrap the ``OSError``,
    safetensors' or torch's, say so in their message)."""
    for link in exception_chain(exc):
        if isinstance(link, OSError) and link.errno in _FULL_ERRNOS:
            return True
        if "No space left on device" in str(link) or "Disk quota exceeded" in str(link):
            return True
    return False


def human_size(size: float) -> str:
    """``852.0 KiB``, ``1.2 MiB``: a byte count for people."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def free_space(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing folder)."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def write_error(path: str | os.PathLike[str], exc: BaseException, *, then: str = "") -> WriteError:
    """The ``WriteError`` for a write of ``path`` that failed with ``exc``: a full disk (or
    quota) is named with the free space left there; ``then`` says what happens now."""
    cause = f"{type(exc).__name__}: {exc}"
    if is_disk_full(exc):
        free = free_space(path)
        room = f": {human_size(free)} free there" if free is not None else ""
        text = f"no space left on device (ENOSPC) writing {path} ({cause}){room}"
    else:
        text = f"writing {path} failed ({cause})"
    return WriteError(text + (f". {then}" if then else ""))


@contextmanager
def writing(path: str | os.PathLike[str], *, then: str = "") -> Iterator[None]:
    """Turn an ``OSError`` (a full disk, an I/O error) raised inside into ``write_error``'s
    ``WriteError`` naming ``path``."""
    try:
        yield
    except OSError as exc:
        raise write_error(path, exc, then=then) from exc


def is_agentrl_page(path: str | os.PathLike[str]) -> bool:
    """Does the regular file ``path`` hold an HTML page agentrl wrote (``GENERATOR`` in its
    head, or an ``agentrl`` title as pages had before the tag)?"""
    with open(path, "rb") as fh:
        head = fh.read(_PAGE_HEAD).decode("utf-8", "replace")
    return head.lstrip().lower().startswith("<!doctype html") and (
        GENERATOR in head or "<title>agentrl " in head
    )


def replace_page(path: str | os.PathLike[str], page: str, *, option: str = "") -> Path:
    """Write the HTML ``page`` to ``path`` (the value of ``option``, e.g. ``--out``, when a
    user named it): a new file, or a page agentrl wrote before; anything else there is refused
    (``OutputError``) and left as it is. Returns the path."""
    path = Path(path)
    named = f"{option} {path}" if option else str(path)
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"{named} is a folder; give the page's file name")
    if check_writable(path) and not is_agentrl_page(path):
        raise OutputError(
            f"{named} exists and is not a page agentrl wrote; it is left as it is: choose "
            "a new file name"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, page)
    return path
