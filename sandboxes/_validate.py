"""Request validation: one function, used by the pool (in-process) and the service (HTTP).

A request that breaks a rule is a *request error*: ``InvalidRequest`` names the field and the
offending value, nothing runs and no sandbox is touched. The service answers it with 400; the
pool raises it from ``run`` (in a batch, that item alone gets ``status="invalid_request"`` and
the others run). Everything a program does once it runs is a *run outcome* (a ``RunResult``
status), never an error.

The rules are the fixed limits of the API (``_types.MAX_*``) and what the backend can give
(``RequestLimits``): programs without network; files held in memory that counts against the
request's ``memory_mb`` and in the backend's scratch tmpfs. Strings that reach an argv, an
environment or a path (``code``, file names) may not hold NUL; every string must be valid Unicode
(no lone surrogates). File *contents* and ``stdin`` may hold any character.

``parse_json`` reads the service's JSON bodies: strict UTF-8, no ``NaN``/``Infinity``, and no
duplicate keys anywhere (a repeated ``code`` or file name would otherwise be silently dropped by
one reader and kept by another).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from ._types import (
    MAX_CODE_BYTES,
    MAX_FILES,
    MAX_FILES_BYTES,
    MAX_MEMORY_MB,
    MAX_OUTPUT_LIMIT_BYTES,
    MAX_STDIN_BYTES,
    MAX_TIMEOUT_S,
    InvalidRequest,
    RunRequest,
    printable,
)

LANGUAGES = ("python", "bash")
MIN_MEMORY_MB = 16
MAX_NAME_BYTES = 255  # one path component (NAME_MAX)
MAX_PATH_BYTES = 1024
MAX_PATH_DEPTH = 16
MAX_ENTRIES = 1024  # files plus the directories their names imply (inodes of the scratch tmpfs)
PAGE = 4096  # tmpfs stores each file in whole pages
MB = 1 << 20
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


class RequestLimits(msgspec.Struct, frozen=True):
    """What the backend serving a request can give it, beyond the API's fixed limits."""

    network: bool = False
    """Whether programs may ask for network (no backend gives it: every sandbox is offline)."""
    scratch_mb: int | None = None
    """Size of the tmpfs holding the request's files (``None``: not checked)."""


def request_limits(backend: Any) -> RequestLimits:
    """The limits a backend config (``DockerConfig``, ``GVisorConfig``, ``LocalConfig``) sets:
    every backend runs programs without network; files go to its ``scratch_mb`` tmpfs."""
    scratch = getattr(backend, "scratch_mb", None)
    return RequestLimits(network=False, scratch_mb=int(scratch) if scratch is not None else None)


def show(value: Any, limit: int = 60) -> str:
    """The offending value for an error message (``repr``, shortened)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "…" + text[-4:]


def _utf8_len(field: str, text: str) -> int:
    """Bytes of ``text`` in UTF-8, or ``InvalidRequest`` for a lone surrogate."""
    try:
        return len(text.encode())
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            field, f"is not valid Unicode: lone surrogate {show(text[exc.start])} at {exc.start}"
        ) from None


def _number(field: str, value: Any, low: int, high: float, *, integer: bool) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an integer" if integer else "a number"
        raise InvalidRequest(field, f"must be {want}, got {show(value)}")
    finite = isinstance(value, int) or math.isfinite(value)
    if not (finite and value <= high and (value >= low if integer else value > low)):
        span = f"[{low:d}, {high:d}]" if integer else f"(0, {high:g}]"
        raise InvalidRequest(field, f"must be in {span}, got {show(value)}")


def check_relative_path(path: Any) -> tuple[str, ...]:
    """The components of a safe relative file name inside the scratch dir, or
    ``InvalidRequest``: no absolute paths, no ``..``/``.``/empty components, no NUL or other
    control characters, no backslashes, at most 255 bytes a component, 1024 bytes and 16 levels
    in all. (Files are always written as regular files, never through a symlink.)"""
    field = f"files[{show(path)}]"
    if not isinstance(path, str):
        raise InvalidRequest(field, "the file name must be a string")
    size = _utf8_len(field, path)
    if not path:
        raise InvalidRequest(field, "the file name is empty")
    if _CONTROL_RE.search(path) or "\\" in path:
        raise InvalidRequest(field, "the file name holds a NUL, a control character or '\\'")
    if path.startswith("/"):
        raise InvalidRequest(field, "must be relative to the scratch dir, not absolute")
    parts = tuple(path.split("/"))
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidRequest(field, "must not contain '..', '.' or empty components")
    if size > MAX_PATH_BYTES or len(parts) > MAX_PATH_DEPTH:
        raise InvalidRequest(
            field, f"is longer than {MAX_PATH_BYTES} bytes or {MAX_PATH_DEPTH} levels"
        )
    if any(len(part.encode()) > MAX_NAME_BYTES for part in parts):
        raise InvalidRequest(field, f"has a component longer than {MAX_NAME_BYTES} bytes")
    return parts


def _check_files(files: Any) -> int:
    """Validate ``files``; the bytes they take on a tmpfs (whole pages)."""
    if not isinstance(files, dict):
        raise InvalidRequest("files", f"must map relative file names to text, got {show(files)}")
    if len(files) > MAX_FILES:
        raise InvalidRequest("files", f"has {len(files)} entries; the limit is {MAX_FILES}")
    total = 0
    stored = 0
    dirs: dict[str, str] = {}
    for path, content in files.items():
        parts = check_relative_path(path)
        field = f"files[{show(path)}]"
        if not isinstance(content, str):
            raise InvalidRequest(field, f"the content must be text, got {show(content)}")
        size = _utf8_len(field, content)
        total += size
        stored += -(-size // PAGE) * PAGE
        for i in range(1, len(parts)):
            dirs.setdefault("/".join(parts[:i]), path)
    if len(files) + len(dirs) > MAX_ENTRIES:
        raise InvalidRequest(
            "files",
            f"{len(files)} files in {len(dirs)} directories; the limit is {MAX_ENTRIES} entries",
        )
    for path in files:
        if path in dirs:
            raise InvalidRequest(
                f"files[{show(path)}]",
                f"is both a file and the parent directory of {show(dirs[path])}",
            )
    if total > MAX_FILES_BYTES:
        raise InvalidRequest("files", f"total {total} bytes; the limit is {MAX_FILES_BYTES}")
    return stored


def validate_request(req: Any, limits: RequestLimits | None = None) -> None:
    """Raise ``InvalidRequest`` naming the first offending field and its value.

    Checks every field's type too (a ``RunRequest`` built in-process is not type-checked)."""
    if not isinstance(req, RunRequest):
        raise InvalidRequest("request", f"must be a RunRequest, got {type(req).__name__}")
    limits = limits or RequestLimits()
    if req.language not in LANGUAGES:
        raise InvalidRequest("language", f"must be one of {LANGUAGES}, got {show(req.language)}")
    if not isinstance(req.code, str):
        raise InvalidRequest("code", f"must be a string, got {show(req.code)}")
    code_bytes = _utf8_len("code", req.code)
    if code_bytes > MAX_CODE_BYTES:
        raise InvalidRequest("code", f"is {code_bytes} bytes; the limit is {MAX_CODE_BYTES}")
    nul = req.code.find("\x00")
    if nul >= 0:
        raise InvalidRequest("code", f"holds a NUL character at offset {nul}")
    if not isinstance(req.stdin, str):
        raise InvalidRequest("stdin", f"must be a string, got {show(req.stdin)}")
    stdin_bytes = _utf8_len("stdin", req.stdin)
    if stdin_bytes > MAX_STDIN_BYTES:
        raise InvalidRequest("stdin", f"is {stdin_bytes} bytes; the limit is {MAX_STDIN_BYTES}")
    _number("timeout_s", req.timeout_s, 0, MAX_TIMEOUT_S, integer=False)
    if req.cpu_time_s is not None:
        _number("cpu_time_s", req.cpu_time_s, 0, MAX_TIMEOUT_S, integer=False)
    _number("memory_mb", req.memory_mb, MIN_MEMORY_MB, MAX_MEMORY_MB, integer=True)
    _number("output_limit_bytes", req.output_limit_bytes, 1, MAX_OUTPUT_LIMIT_BYTES, integer=True)
    if not isinstance(req.network, bool):
        raise InvalidRequest("network", f"must be true or false, got {show(req.network)}")
    if req.network and not limits.network:
        raise InvalidRequest("network", "true: this backend runs every program without network")
    stored = _check_files(req.files)
    held = stored + code_bytes
    if held * 2 > req.memory_mb * MB:
        raise InvalidRequest(
            "files",
            f"files and code take {held} bytes of memory; at most half of memory_mb="
            f"{req.memory_mb} ({req.memory_mb * MB // 2} bytes) may go to them",
        )
    if limits.scratch_mb is not None and held > limits.scratch_mb * MB:
        raise InvalidRequest(
            "files",
            f"files and code take {held} bytes; the backend's scratch dir holds "
            f"{limits.scratch_mb * MB} (scratch_mb={limits.scratch_mb})",
        )


# -- JSON bodies -----------------------------------------------------------------------------------
class DuplicateKeys(dict):  # type: ignore[type-arg]
    """A JSON object that named a key twice (kept to be reported where it is used)."""

    duplicates: list[str]


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    marked = DuplicateKeys(obj)
    marked.duplicates = [k for k, _ in pairs if k in seen or seen.add(k)]  # type: ignore[func-returns-value]
    return marked


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class MalformedJSON(ValueError):
    """The body is not JSON (or not UTF-8)."""


def parse_json(data: bytes | bytearray) -> Any:
    """The JSON value of a body; ``MalformedJSON`` when it is not strict UTF-8 JSON.
    Objects with a repeated key come back as ``DuplicateKeys``. A ``bytearray`` is emptied once
    decoded, so a large body is not held three times over (bytes, text, values)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedJSON(f"the body is not UTF-8 (byte {exc.start})") from None
    if isinstance(data, bytearray):
        del data[:]
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise MalformedJSON(f"the body is not JSON: {exc}") from None


_FIELD_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_FIELD_NAME_RE = re.compile(r"(?:unknown|required) field `([^`]+)`")


def validation_field(exc: msgspec.ValidationError, prefix: str = "") -> str | None:
    """The field a msgspec validation error is about (``code``, ``files[...]``, ``foo``)."""
    message = str(exc)
    path = _FIELD_PATH_RE.search(message)
    name = _FIELD_NAME_RE.search(message)
    parts = [p for p in (prefix, path.group(1) if path else "", name.group(1) if name else "") if p]
    return ".".join(parts) if parts else (prefix or None)


def request_from_json(obj: Any, limits: RequestLimits | None = None) -> RunRequest:
    """A validated ``RunRequest`` from a parsed JSON value, or ``InvalidRequest``."""
    if isinstance(obj, DuplicateKeys):
        raise InvalidRequest(obj.duplicates[0], "is given more than once")
    files = obj.get("files") if isinstance(obj, dict) else None
    if isinstance(files, DuplicateKeys):
        raise InvalidRequest(f"files[{show(files.duplicates[0])}]", "is given more than once")
    if isinstance(files, dict):  # name the file (msgspec would say only ``files[...]``)
        for path, content in files.items():
            if not isinstance(content, str):
                raise InvalidRequest(
                    f"files[{show(path)}]", f"the content must be text, got {show(content)}"
                )
    if isinstance(obj, dict):  # msgspec would fail on these with a UnicodeEncodeError
        for key, value in obj.items():
            if isinstance(key, str) and printable(key) != key:
                raise InvalidRequest(key, "is not a valid field name (a lone surrogate)")
            if isinstance(value, str) and key != "files":
                _utf8_len(key, value)
    try:
        req = msgspec.convert(obj, RunRequest)
    except msgspec.ValidationError as exc:
        field = validation_field(exc) or "request"
        message = str(exc).split(" - at `", 1)[0]
        if field == "language" and message.startswith("Invalid enum value"):
            message = f"must be one of {LANGUAGES}, got {show(obj[field])}"
        elif isinstance(obj, dict) and field in obj:
            message += f": {show(obj[field])}"
        raise InvalidRequest(field, message) from None
    validate_request(req, limits)
    return req
