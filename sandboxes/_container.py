"""One warm container (docker or gvisor backend): one ``docker exec`` per request.

The exec runs ``_exec_wrapper.py`` as root (with the few capabilities the container keeps), which
runs the supervisor; the request goes in over the exec's stdin (a hijacked socket: files cannot be
copied into a read-only rootfs) and the supervisor's single JSON line comes back on its stdout,
followed by the wrapper's anomaly probe. Blocking socket work runs in a worker thread; the host
keeps its own deadline (request timeout + margin) in case the supervisor cannot keep it.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from ._types import RunRequest, RunResult

_LOST_POLL_S = 1.0
_result_decoder = msgspec.json.Decoder(RunResult)
_encoder = msgspec.json.Encoder()


class _Probe(msgspec.Struct):
    supervisor_exit: int
    processes: list[str]
    n_processes: int
    files: list[str]
    n_files: int
    ipc: int


class _ProbeLine(msgspec.Struct):
    agentrl_probe: _Probe


_probe_decoder = msgspec.json.Decoder(_ProbeLine)


@dataclass
class ExecOutput:
    """What came back from one exec (raw, before parsing)."""

    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    overflow: bool = False
    error: str | None = None


@dataclass
class ExecSpec:
    """Everything ``exec_blocking`` needs (built by the backend, shared by its sandboxes)."""

    api: Any  # docker.APIClient
    cmd: list[str]
    environment: dict[str, str]
    scratch_root: str


def _read_frames(
    sock: socket.socket,
    deadline: float,
    limit: int,
    out: ExecOutput,
    overdue: float,
    container_lost: Callable[[], bool],
) -> None:
    """Read docker's multiplexed stream (8-byte headers: stream, size) until EOF or deadline.

    Past ``overdue`` (the request's own timeout: the supervisor should have answered) the
    container is checked every second: an exec into a container that died (e.g. gVisor killed
    by its pids limit) may never see EOF."""
    buf = bytearray()
    streams = {1: bytearray(), 2: bytearray()}
    while True:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            out.timed_out = True
            break
        sock.settimeout(
            min(remaining, _LOST_POLL_S) if now >= overdue else min(remaining, overdue - now + 0.01)
        )
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            if time.monotonic() >= overdue and container_lost():
                out.error = "the container stopped during the run (lost)"
                break
            continue
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 8:
            kind, size = struct.unpack(">BxxxL", bytes(buf[:8]))
            if len(buf) < 8 + size:
                break
            target = streams.get(kind)
            if target is not None:
                target += buf[8 : 8 + size]
            del buf[: 8 + size]
        if len(streams[1]) + len(streams[2]) > limit:
            out.overflow = True
            break
    out.stdout, out.stderr = bytes(streams[1]), bytes(streams[2])


def exec_blocking(
    spec: ExecSpec,
    container_id: str,
    payload: bytes,
    timeout_s: float,
    overdue_s: float,
    limit: int,
    on_socket: Callable[[socket.socket], None],
) -> ExecOutput:
    """Run one exec (worker thread): create, attach, send ``payload``, half-close, read.

    ``timeout_s``: the host deadline; ``overdue_s``: when to start checking the container."""
    out = ExecOutput()
    start = time.monotonic()
    deadline = start + timeout_s

    def container_lost() -> bool:
        try:
            state = spec.api.inspect_container(container_id)["State"]
        except Exception:
            return True
        return not state.get("Running") or bool(state.get("Paused"))

    exec_id = spec.api.exec_create(
        container_id,
        spec.cmd,
        stdin=True,
        stdout=True,
        stderr=True,
        user="0",
        workdir="/",
        environment=spec.environment,
    )["Id"]
    sock = spec.api.exec_start(exec_id, socket=True)
    raw: socket.socket = getattr(sock, "_sock", sock)
    on_socket(raw)
    try:
        raw.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            raw.sendall(payload)
            raw.shutdown(socket.SHUT_WR)
        except TimeoutError:
            out.timed_out = True
            return out
        except OSError as exc:  # the exec died before reading its stdin
            out.error = f"writing the request failed: {exc}"
        _read_frames(raw, deadline, limit, out, start + overdue_s, container_lost)
    finally:
        try:
            sock.close()
        finally:
            raw.close()
    return out


@dataclass
class ContainerSandbox:
    """A warm container; ``exec`` runs one request, ``is_clean`` reports anomalies."""

    id: str
    container_id: str
    backend: str
    program_uid: int
    spec: ExecSpec
    limiter: anyio.CapacityLimiter
    margin_s: float
    memory_cap_mb: int
    """Requests asking for more memory get this (the container's cap less the supervisor's
    share), so a big program ends as ``oom`` by its rlimit, not by the container's OOM killer."""
    runs: int = 0
    clean: bool = True
    last_probe: Any = None
    _socket: socket.socket | None = field(default=None, repr=False)

    def _payload(self, request: RunRequest) -> bytes:
        if request.memory_mb > self.memory_cap_mb:
            request = msgspec.structs.replace(request, memory_mb=self.memory_cap_mb)
        envelope = {
            "request": request,
            "scratch_root": self.spec.scratch_root,
            "uid": self.program_uid,
            "gid": self.program_uid,
            "cgroup": None,
        }
        return _encoder.encode(envelope) + b"\n"

    def _remember_socket(self, sock: socket.socket) -> None:
        self._socket = sock

    def _abort(self) -> None:
        sock, self._socket = self._socket, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    async def exec(self, request: RunRequest) -> RunResult:
        """Run one (already validated) request. Never raises for what the program does."""
        if request.network:
            return RunResult(
                status="invalid_request",
                error="network: this backend runs without network (network_mode=none)",
                backend=self.backend,
                sandbox_id=self.id,
            )
        self.runs += 1
        payload = self._payload(request)
        # stdout+stderr each at most output_limit_bytes, JSON-escaped (≤ 6×), plus the probe
        limit = 12 * request.output_limit_bytes + (1 << 20)
        timeout = request.timeout_s + self.margin_s
        start = time.monotonic()
        try:
            out = await anyio.to_thread.run_sync(
                exec_blocking,
                self.spec,
                self.container_id,
                payload,
                timeout,
                request.timeout_s + 1.0,
                limit,
                self._remember_socket,
                limiter=self.limiter,
                abandon_on_cancel=True,
            )
        except anyio.get_cancelled_exc_class():
            self.clean = False
            self._abort()
            raise
        except Exception as exc:  # the daemon refused the exec: the container is gone or broken
            self.clean = False
            return self._error(f"exec failed: {type(exc).__name__}: {exc}", start)
        finally:
            self._socket = None
        return self._parse(out, timeout, start)

    def _error(self, message: str, start: float) -> RunResult:
        return RunResult(
            status="sandbox_error",
            error=message,
            wall_s=round(time.monotonic() - start, 4),
            backend=self.backend,
            sandbox_id=self.id,
        )

    def _parse(self, out: ExecOutput, timeout: float, start: float) -> RunResult:
        result: RunResult | None = None
        probe: _Probe | None = None
        stray = 0
        for line in out.stdout.splitlines():
            if not line.strip():
                continue
            if line.startswith(b'{"agentrl_probe"'):
                try:
                    probe = _probe_decoder.decode(line).agentrl_probe
                except msgspec.DecodeError:
                    stray += 1
                continue
            if result is None:
                try:
                    result = _result_decoder.decode(line)
                    continue
                except msgspec.DecodeError:
                    pass
            stray += 1
        self.last_probe = probe
        if (
            out.timed_out
            or out.overflow
            or out.error
            or probe is None
            or stray
            or probe.n_processes
            or probe.n_files
            or probe.ipc
        ):
            self.clean = False
        if out.timed_out:
            return self._error(f"no answer from the sandbox within {timeout:.1f} s", start)
        if out.error and result is None:
            return self._error(out.error, start)
        if out.overflow:
            return self._error("the sandbox wrote more output than the limits allow", start)
        if result is None:
            detail = out.error or "the supervisor produced no result"
            if probe is not None and probe.supervisor_exit != 0:
                detail += f" (supervisor exit {probe.supervisor_exit})"
            tail = out.stderr[-2000:].decode("utf-8", "replace").strip()
            if tail:
                detail += f"; stderr: {tail}"
            return self._error(detail, start)
        if result.status == "sandbox_error":
            self.clean = False
        result.backend = self.backend
        result.sandbox_id = self.id
        return result

    async def is_clean(self) -> bool:
        return self.clean
