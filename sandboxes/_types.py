"""Wire types of the sandbox API (msgspec; JSON on the wire).

Users and other languages call this API: the field names and status values are fixed. New fields
always get defaults. ``validate_request`` enforces the limits below and names the offending field.
"""

from __future__ import annotations

import posixpath
from typing import Literal

import msgspec

Language = Literal["python", "bash"]
RunStatus = Literal[
    "ok",  # exit code 0
    "nonzero_exit",  # the program exited with a non-zero code
    "timeout",  # wall-clock or CPU-time limit
    "oom",  # memory limit
    "output_limit",  # stdout or stderr exceeded output_limit_bytes (program killed)
    "signal",  # killed by a signal it caused itself (segfault, abort, kill of itself)
    "sandbox_error",  # the sandbox failed, not the program: retry elsewhere is reasonable
    "invalid_request",  # the request broke a rule (field named in ``error``); nothing ran
]
STATUSES: tuple[str, ...] = RunStatus.__args__  # type: ignore[attr-defined]

MAX_TIMEOUT_S = 120.0
MAX_MEMORY_MB = 8192
MAX_OUTPUT_LIMIT_BYTES = 16 * 1024 * 1024
MAX_CODE_BYTES = 1024 * 1024
MAX_STDIN_BYTES = 16 * 1024 * 1024
MAX_FILES = 256
MAX_FILES_BYTES = 32 * 1024 * 1024


class RunRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One program to run. Everything but ``language`` and ``code`` has a safe default."""

    language: Language
    code: str
    stdin: str = ""
    files: dict[str, str] = msgspec.field(default_factory=dict)
    """Relative path → text content, written into the fresh scratch dir before the run."""
    timeout_s: float = 10.0
    """Wall-clock limit."""
    cpu_time_s: float | None = None
    """CPU-time limit (default: ``timeout_s`` + 1 s, a backstop behind the wall clock)."""
    memory_mb: int = 512
    output_limit_bytes: int = 1024 * 1024
    """Per stream (stdout and stderr each); the program is killed past it."""
    network: bool = False


class RunResult(msgspec.Struct, omit_defaults=False):
    status: RunStatus
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_memory_mb: float | None = None
    signal: int | None = None
    """The signal that ended the program, when one did."""
    error: str | None = None
    """For sandbox_error / invalid_request: what went wrong (names the field for the latter)."""
    backend: str = ""
    sandbox_id: str = ""


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    requests: list[RunRequest]


class BatchResult(msgspec.Struct):
    results: list[RunResult]


class ErrorBody(msgspec.Struct):
    """Structured HTTP error: ``{"error": {"type": …, "message": …, "field": …}}``."""

    type: str
    message: str
    field: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_request(req: RunRequest) -> None:
    """Raise ``InvalidRequest`` naming the first offending field."""
    if not 0 < req.timeout_s <= MAX_TIMEOUT_S:
        raise InvalidRequest("timeout_s", f"must be in (0, {MAX_TIMEOUT_S}], got {req.timeout_s}")
    if req.cpu_time_s is not None and not 0 < req.cpu_time_s <= MAX_TIMEOUT_S:
        raise InvalidRequest("cpu_time_s", f"must be in (0, {MAX_TIMEOUT_S}], got {req.cpu_time_s}")
    if not 16 <= req.memory_mb <= MAX_MEMORY_MB:
        raise InvalidRequest("memory_mb", f"must be in [16, {MAX_MEMORY_MB}], got {req.memory_mb}")
    if not 0 < req.output_limit_bytes <= MAX_OUTPUT_LIMIT_BYTES:
        raise InvalidRequest(
            "output_limit_bytes",
            f"must be in (0, {MAX_OUTPUT_LIMIT_BYTES}], got {req.output_limit_bytes}",
        )
    if len(req.code.encode()) > MAX_CODE_BYTES:
        raise InvalidRequest("code", f"is larger than {MAX_CODE_BYTES} bytes")
    if len(req.stdin.encode()) > MAX_STDIN_BYTES:
        raise InvalidRequest("stdin", f"is larger than {MAX_STDIN_BYTES} bytes")
    if len(req.files) > MAX_FILES:
        raise InvalidRequest("files", f"has {len(req.files)} entries; the limit is {MAX_FILES}")
    total = 0
    for path, content in req.files.items():
        check_relative_path(path)
        total += len(content.encode())
    if total > MAX_FILES_BYTES:
        raise InvalidRequest("files", f"total {total} bytes; the limit is {MAX_FILES_BYTES}")


def check_relative_path(path: str) -> str:
    """A safe relative path inside the scratch dir, or ``InvalidRequest``.

    Refuses absolute paths, ``..`` components, empty names, NUL bytes and backslashes. Symlinks
    cannot be created through ``files`` (content is always written as a regular file, with
    ``O_NOFOLLOW`` on every component by the supervisor)."""
    field = f"files[{path!r}]"
    if not path or "\x00" in path or "\\" in path or len(path) > 255:
        raise InvalidRequest(field, "is not a valid relative file name")
    if path.startswith("/"):
        raise InvalidRequest(field, "must be relative to the scratch dir")
    norm = posixpath.normpath(path)
    parts = path.split("/")
    if norm.startswith("..") or ".." in parts or "" in parts or "." in parts:
        raise InvalidRequest(field, "must not contain '..', '.', or empty components")
    return norm


_request_decoder = msgspec.json.Decoder(RunRequest)
_batch_decoder = msgspec.json.Decoder(BatchRequest)
_encoder = msgspec.json.Encoder()


def decode_request(data: bytes) -> RunRequest:
    return _request_decoder.decode(data)


def decode_batch(data: bytes) -> BatchRequest:
    return _batch_decoder.decode(data)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)
