"""One warm container (docker or gvisor backend): one long-lived ``docker exec`` serving requests.

When the container is made, one exec starts ``_exec_wrapper.py`` as root (with the few
capabilities the container keeps), which compiles the supervisor once and serves: the host keeps
the exec's stdin and stdout open (a hijacked socket carrying docker's multiplexed stream) and
sends one request line at a time; the answer is one line holding the request's ``seq``, the
supervisor's result and the wrapper's anomaly probe. A request thus costs one line each way, not
an exec plus a Python start.

Nothing uncertain is ever reused: a broken stream (EOF, the serve process killed), no answer by
the host's deadline (request timeout + margin), an answer that does not parse or does not carry
the request's ``seq``, output past the limits, stray bytes between answers, anything on the
serve process's stderr, a cancelled run — each marks the sandbox unclean, so the pool destroys the
container (killing everything in it) and makes a new one; the request gets ``sandbox_error``
(it is never re-sent: it may have run). Blocking socket work runs in a worker thread; one request
at a time per sandbox (the pool leases a sandbox to one request; ``exec`` refuses a second).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from ._types import RunRequest, RunResult, RunStatus, SupervisorResult, from_supervisor

_LOST_POLL_S = 1.0
_STDERR_TAIL = 4000
_OOM_KILLED = (
    "the container went over its memory cap and the kernel's OOM killer stopped it "
    "(the program allocated faster than the supervisor samples); the pool replaces the container"
)
_encoder = msgspec.json.Encoder()


class _Probe(msgspec.Struct):
    """What the wrapper found after a request (see ``_exec_wrapper.probe``)."""

    processes: list[str]
    n_processes: int
    files: list[str]
    n_files: int
    ipc: int
    sockets: int = 0
    unknown: list[str] = msgspec.field(default_factory=list)
    """Kinds of leftovers the wrapper could not look for: the container is recycled."""

    def anomalies(self) -> bool:
        return bool(self.n_processes or self.n_files or self.ipc or self.sockets or self.unknown)


class _Answer(msgspec.Struct):
    seq: int | None
    result: SupervisorResult  # type: ignore[valid-type]
    probe: _Probe


_answer_decoder = msgspec.json.Decoder(_Answer)


@dataclass
class ExecSpec:
    """How to start the serve exec (built by the backend, shared by its sandboxes)."""

    api: Any  # docker.APIClient
    cmd: list[str]
    environment: dict[str, str]
    scratch_root: str
    deny_syscalls: list[str] = field(default_factory=list)
    """What the program's seccomp filter refuses (the supervisor's default when empty)."""
    watch_s: float | None = None
    """How often a run checks that its container still runs (gVisor: an exec into a container
    the host killed may never see EOF); None: only once the request is overdue (runc ends the
    exec's stream when the container dies)."""


@dataclass
class Exchange:
    """What one request got back from the stream (raw, before parsing)."""

    answer: bytes | None = None
    timed_out: bool = False
    error: str | None = None
    stray: bool = False
    """Bytes on the stream that answer nothing (before the request, or after the answer)."""
    oom_killed: bool = False
    """The container went over its memory cap and the kernel's OOM killer ended it."""


class ServeStream:
    """The attached stdin/stdout of one serve exec. Blocking; used from worker threads, one
    exchange at a time. ``close`` may come from another thread: the socket is shut down at
    once, and closed by whoever uses it last (an fd number is never reused under a reader)."""

    def __init__(self, spec: ExecSpec, container_id: str) -> None:
        self.spec = spec
        self.container_id = container_id
        self.exec_id: str | None = None
        self._sock: Any = None  # what the SDK returned (keeps the HTTP response alive)
        self._raw: socket.socket | None = None
        self._frames = bytearray()  # docker's multiplexed stream, not yet split into frames
        self._stdout = bytearray()
        self.stderr = bytearray()  # the serve process's stderr (its tail)
        self.stderr_seen = False
        self._lock = threading.Lock()
        self._active = False
        self._closed = False

    def open(self) -> None:
        api = self.spec.api
        self.exec_id = api.exec_create(
            self.container_id,
            self.spec.cmd,
            stdin=True,
            stdout=True,
            stderr=True,
            tty=False,
            user="0",
            workdir="/",
            environment=self.spec.environment,
        )["Id"]
        sock = api.exec_start(self.exec_id, socket=True)
        with self._lock:
            self._sock, self._raw = sock, getattr(sock, "_sock", sock)
            if self._closed:  # closed while starting
                self._release()

    def close(self) -> None:
        """Shut the stream down (the serve process sees EOF and exits); idempotent."""
        with self._lock:
            self._closed = True
            if self._raw is not None:
                try:
                    self._raw.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if not self._active:
                self._release()

    def _release(self) -> None:
        sock, raw, self._sock, self._raw = self._sock, self._raw, None, None
        for s in (sock, raw):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass

    def exit_code(self) -> int | None:
        """The serve process's exit code once it ended (for error messages), else None."""
        try:
            return self.spec.api.exec_inspect(self.exec_id).get("ExitCode")
        except Exception:
            return None

    def container_state(self) -> str:
        """``running``; ``oom`` (stopped by the kernel's OOM killer at the container's memory
        cap: under gVisor the host sees one sandbox, so a program that outruns the supervisor's
        sampling takes the whole container); ``lost`` (stopped otherwise, paused, or gone); or
        ``unknown`` (Docker did not answer). Docker's ``OOMKilled`` also turns true when the
        kernel kills one process of a container that runs on (runc's path for a program past
        the cap), and stays so: only a stopped container is ``oom``."""
        import docker  # a container exists, so the SDK is there

        for attempt in range(2):
            try:
                state = self.spec.api.inspect_container(self.container_id)["State"]
            except docker.errors.NotFound:
                return "lost"
            except Exception:
                return "unknown"
            if state.get("Running") and not state.get("Paused"):
                return "running"
            if state.get("OOMKilled") or state.get("Paused"):
                break
            if attempt == 0:  # Docker may record the exit before the OOM event: ask again
                time.sleep(0.2)
        return "oom" if state.get("OOMKilled") and not state.get("Running") else "lost"

    def exchange(self, line: bytes, timeout_s: float, overdue_s: float, limit: int) -> Exchange:
        """Send one request line, read one answer line by the host deadline ``timeout_s``,
        checking that the container still runs every ``spec.watch_s`` and, from ``overdue_s``
        on, every ``_LOST_POLL_S`` (an exec into a container that died, e.g. gVisor killed at
        its memory cap or its pids limit, may never see EOF)."""
        with self._lock:
            if self._closed or self._raw is None:
                return Exchange(error="the serve stream is closed")
            self._active = True
            raw = self._raw
        try:
            return self._exchange(raw, line, timeout_s, overdue_s, limit)
        except OSError as exc:
            return Exchange(error=f"the serve stream failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._active = False
                if self._closed:
                    self._release()

    def _exchange(
        self, raw: socket.socket, line: bytes, timeout_s: float, overdue_s: float, limit: int
    ) -> Exchange:
        start = time.monotonic()
        deadline = start + timeout_s
        check = start + min(self.spec.watch_s or overdue_s, overdue_s)
        # Idle since the last answer: anything readable now (bytes or EOF) is an anomaly.
        idle = select.poll()  # (not select.select: a busy service may hold fds past 1024)
        idle.register(raw, select.POLLIN)
        if idle.poll(0):
            raw.settimeout(0.05)
            try:
                if not self._receive(raw):
                    return self._ended("while idle")
            except TimeoutError:
                pass
        if self._stdout or self._frames or self.stderr_seen:
            tail = bytes(self._stdout[:200] or self.stderr[-200:])
            return Exchange(stray=True, error=f"output on the serve stream while idle: {tail!r}")
        raw.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            raw.sendall(line)
        except TimeoutError:
            return Exchange(timed_out=True)
        except OSError as exc:
            return self._ended(f"before reading the request ({exc})")
        scanned = 0  # the answer may be megabytes: look for its end in new bytes only
        while True:
            end = self._stdout.find(b"\n", scanned)
            if end >= 0:
                answer = bytes(self._stdout[:end])
                del self._stdout[: end + 1]
                return Exchange(answer=answer, stray=bool(self._stdout))
            scanned = len(self._stdout)
            if scanned > limit:
                return Exchange(error="the sandbox answered more than the limits allow")
            now = time.monotonic()
            if now >= deadline:
                return Exchange(timed_out=True)
            raw.settimeout(max(min(deadline, check) - now, 0.001))
            try:
                if not self._receive(raw):
                    return self._ended("during the run")
            except TimeoutError:
                if time.monotonic() >= check:
                    check = time.monotonic() + min(self.spec.watch_s or _LOST_POLL_S, _LOST_POLL_S)
                    state = self.container_state()
                    if state == "oom":
                        return Exchange(error=_OOM_KILLED, oom_killed=True)
                    if state == "lost":
                        return Exchange(error="the container stopped during the run (lost)")

    def _receive(self, raw: socket.socket) -> bool:
        """One recv, split into frames (8-byte headers: stream, size); False at EOF."""
        chunk = raw.recv(1 << 16)
        if not chunk:
            return False
        buf = self._frames
        buf += chunk
        while len(buf) >= 8:
            kind, size = struct.unpack(">BxxxL", bytes(buf[:8]))
            if len(buf) < 8 + size:
                break
            if kind == 1:
                self._stdout += buf[8 : 8 + size]
            elif kind == 2:
                self.stderr_seen = True
                self.stderr += buf[8 : 8 + size]
                del self.stderr[:-_STDERR_TAIL]
            del buf[: 8 + size]
        return True

    def _ended(self, when: str) -> Exchange:
        # the serve stream ended: a container the kernel is stopping at its memory cap may
        # still read as running, or stopped without OOMKilled yet, for a moment
        deadline = time.monotonic() + _OOM_SETTLE_S
        while True:
            state = self.container_state()
            if state == "oom":
                return Exchange(error=_OOM_KILLED, oom_killed=True)
            if state == "unknown" or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        code = self.exit_code()
        message = "the serve process ended " + when
        if code is not None:
            message += f" (exit code {code})"
        tail = self.stderr.decode("utf-8", "replace").strip()
        return Exchange(error=message + (f"; stderr: {tail[-2000:]}" if tail else ""))


_OOM_SETTLE_S = 2.0
"""How long a serve stream's end waits for Docker to say whether the container was OOM-killed."""


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
    share), so a big program ends as ``oom`` by the supervisor's sampled limit before the
    container's cap (where the kernel's OOM killer takes the program, ``oom_score_adj`` 1000)."""
    runs: int = 0
    clean: bool = True
    last_probe: Any = None
    _stream: ServeStream | None = field(default=None, repr=False)
    _seq: int = 0
    _busy: bool = False

    async def start(self) -> None:
        """Start the serve exec (the caller health-checks it with a request)."""
        self._stream = ServeStream(self.spec, self.container_id)
        await self._blocking(self._stream.open)

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(
            fn, *args, limiter=self.limiter, abandon_on_cancel=True
        )

    def close(self) -> None:
        """Shut the serve stream down (non-blocking; the container is removed next)."""
        self.clean = False
        if self._stream is not None:
            self._stream.close()

    def _line(self, request: RunRequest) -> bytes:
        if request.memory_mb > self.memory_cap_mb:
            request = msgspec.structs.replace(request, memory_mb=self.memory_cap_mb)
        self._seq += 1
        envelope = {
            "seq": self._seq,
            "request": request,
            "scratch_root": self.spec.scratch_root,
            "uid": self.program_uid,
            "gid": self.program_uid,
            "cgroup": None,
            "meter": "container",
        }
        if self.spec.deny_syscalls:
            envelope["deny_syscalls"] = self.spec.deny_syscalls
        return _encoder.encode(envelope) + b"\n"

    async def exec(self, request: RunRequest) -> RunResult:
        """Run one (already validated) request. Never raises for what the program does."""
        if request.network:
            return RunResult(
                status="invalid_request",
                error="network: this backend runs without network (network_mode=none)",
                backend=self.backend,
                sandbox_id=self.id,
            )
        start = time.monotonic()
        if self._busy:  # the pool never does this: one lease, one request
            self.clean = False
            return self._error("the sandbox is already running a request", start)
        if not self.clean or self._stream is None:
            return self._error("the sandbox was already marked for recycling", start)
        self._busy = True
        self.runs += 1
        line = self._line(request)
        # stdout+stderr each at most output_limit_bytes, in base64 (4/3), plus the probe
        limit = 3 * request.output_limit_bytes + (1 << 20)
        timeout = request.timeout_s + self.margin_s
        try:
            out = await self._blocking(
                self._stream.exchange, line, timeout, request.timeout_s + 1.0, limit
            )
        except anyio.get_cancelled_exc_class():
            self.close()  # the thread's recv returns; the pool destroys the container
            raise
        except Exception as exc:
            self.close()
            return self._error(f"serve stream failed: {type(exc).__name__}: {exc}", start)
        finally:
            self._busy = False
        return self._parse(out, timeout, start)

    def _error(
        self, message: str, start: float, status: RunStatus = "sandbox_error", **more: Any
    ) -> RunResult:
        return RunResult(
            status=status,
            error=message,
            **more,
            wall_s=round(time.monotonic() - start, 4),
            backend=self.backend,
            sandbox_id=self.id,
        )

    def _parse(self, out: Exchange, timeout: float, start: float) -> RunResult:
        assert self._stream is not None
        answer: _Answer | None = None
        problem = out.error
        if out.timed_out:
            problem = f"no answer from the sandbox within {timeout:.1f} s"
        elif out.answer is not None:
            try:
                answer = _answer_decoder.decode(out.answer)
            except msgspec.DecodeError as exc:
                problem = f"unreadable answer from the sandbox ({exc}): {out.answer[:200]!r}"
            else:
                if answer.seq != self._seq:
                    problem = f"the sandbox answered request {answer.seq}, not {self._seq}"
            out.answer = None  # the outputs live on in the answer alone
        if answer is None or problem or out.stray or self._stream.stderr_seen:
            self.clean = False
        if answer is None or problem:
            self.close()
            if out.oom_killed:  # the kernel's SIGKILL, to the whole container
                return self._error(_OOM_KILLED, start, "oom", signal=9)
            return self._error(problem or "no answer from the sandbox", start)
        probe, result = answer.probe, from_supervisor(answer.result)
        del answer
        self.last_probe = probe
        if probe.anomalies() or result.status == "sandbox_error":
            self.clean = False
        result.backend = self.backend
        result.sandbox_id = self.id
        return result

    async def is_clean(self) -> bool:
        return self.clean
