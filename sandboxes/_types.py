"""Wire types of the sandbox API (msgspec; JSON on the wire).

Users and other languages call this API: the field names and status values are fixed. New fields
always get defaults. ``_validate.validate_request`` enforces the limits below and names the
offending field and value.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ._errors import SandboxError

Language = Literal["python", "bash"]
RunStatus = Literal[
    "ok",  # exit code 0
    "nonzero_exit",  # the program exited with a non-zero code
    "timeout",  # wall-clock or CPU-time limit
    "oom",  # memory limit
    "output_limit",  # stdout or stderr exceeded output_limit_bytes (program killed)
    "signal",  # killed by a signal it caused itself (segfault, abort, kill of itself)
    "sandbox_error",  # the sandbox failed, not the program: retry elsewhere is reasonable
    "invalid_request",  # a batch item broke a rule (field named in ``error``); it did not run
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
    """For sandbox_error / invalid_request: what went wrong (names the field for the latter);
    for an oom that stopped the whole container (the kernel's OOM killer at its cap), that."""
    backend: str = ""
    sandbox_id: str = ""


_OUTPUTS = ("stdout", "stderr")


def _wire_field(f: msgspec.structs.FieldInfo) -> tuple[Any, ...]:
    """``RunResult``'s field ``f`` as the supervisor sends it: the outputs as bytes."""
    if f.name in _OUTPUTS:
        return f.name, bytes, b""
    return (f.name, f.type) if f.required else (f.name, f.type, f.default)


SupervisorResult = msgspec.defstruct(
    "SupervisorResult", [_wire_field(f) for f in msgspec.structs.fields(RunResult)]
)
"""A ``RunResult`` as the supervisor sends it (``_supervisor.wire``): stdout and stderr are the
program's raw bytes (base64 in JSON, at most 4/3 of the output: JSON text would take up to 6
bytes a control byte). ``from_supervisor`` makes the ``RunResult``."""


def from_supervisor(wire: Any) -> RunResult:
    """The ``RunResult`` of a ``SupervisorResult`` (whose outputs it empties): its outputs
    decoded as UTF-8, an invalid byte replaced by U+FFFD."""
    texts = {}
    for name in _OUTPUTS:  # each output's bytes are dropped before the next is decoded
        raw = getattr(wire, name)
        setattr(wire, name, b"")
        texts[name] = raw.decode("utf-8", "replace")
        del raw
    return RunResult(**{**msgspec.structs.asdict(wire), **texts})


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    requests: list[RunRequest]


class BatchResult(msgspec.Struct):
    results: list[RunResult]


class ErrorBody(msgspec.Struct):
    """Structured HTTP error: ``{"error": {"type": …, "message": …, "field": …}}``."""

    type: str
    message: str
    field: str | None = None
    """The request field at fault (400 ``invalid_request``)."""
    limit: int | None = None
    """The limit that was exceeded, where one was (413, or 400 for too many batch items)."""


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class InvalidRequest(SandboxError, ValueError):
    """A request broke a rule (``_validate.validate_request``); ``field`` names where. Nothing
    ran and no sandbox was touched. Under the package's root, and a ``ValueError``."""

    def __init__(self, field: str, message: str) -> None:
        # both travel in JSON answers: a lone surrogate from the request (a field name, a
        # value) is written as its escape, never left to fail the answer's encoding
        field, message = printable(field), printable(message)
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (``\\ud800``): encodable as UTF-8."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


_encoder = msgspec.json.Encoder()


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)
