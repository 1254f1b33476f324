"""The local backend: bubblewrap + rlimits + a uid per sandbox + cgroup memory/pids/cpu.

A sandbox is a *slot*: a host uid of its own (``uid_base + i``, held through a lock file so two
live pools never share one), cgroups of its own (``agentrl-local-<pool>/<i>`` under each
writable v1 hierarchy, or one v2 group), and a warm supervisor (``_supervisor.py --serve``:
root, outside the sandbox, in the slot's cgroups, at nice -20 and out of the OOM killer's reach)
that runs one request at a time. The program's memory and CPU time are accounted in a ``run``
group of its own inside the slot's (v1 memory, pids, cpuacct): the per-request ``memory_mb`` limit,
the OOM kill count, ``peak_memory_mb`` and ``cpu_s`` are then the program's alone. The
supervisor's zygote, moved into those groups once, forks each program's process there (so no
request waits for a cgroup attach, an RCU grace period); that process sets rlimits,
``oom_score_adj`` 1000 and a fresh session keyring, becomes the slot's uid and execs
bubblewrap; bubblewrap builds a fresh sandbox (user, pid, net, ipc, uts, mount namespaces;
read-only ``/usr`` and a generated ``/etc``; size-capped tmpfs ``/work`` holding the request's
files, ``/tmp`` and ``/dev/shm``; ``/`` and ``/dev`` read-only), installs the seccomp filter
(``--seccomp``: the keyring, io_uring, bpf, perf_event_open and userfaultfd syscalls answer
EPERM, sockets of a family other than unix, inet, inet6 and netlink EAFNOSUPPORT) and runs the
program as uid 1000 inside.
When the program exits, bubblewrap exits, and with it the sandbox's PID 1, which takes every
process left in the namespace down; the supervisor then checks the cgroups are empty. Nothing
outlives a request: the next one gets a new sandbox in the same slot (``docs/sandboxes.md``).

``guarantees()`` says what this host gives (``_hostcheck``); ``start()`` refuses with
``BackendUnavailable`` when a guarantee named in ``LocalConfig.require`` is missing. Settings
``LocalConfig`` may grow are read with defaults: ``max_processes`` (512), ``cpus`` (1.0),
``scratch_mb`` (256), ``tmp_mb`` (64), ``shm_mb`` (16), ``memory_mb`` (None: a cap on each
request's ``memory_mb``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from . import _local_host as host
from . import _supervisor
from ._backend import Guarantee
from ._config import LocalConfig
from ._errors import BackendUnavailable, SandboxError
from ._hostcheck import HostFacts, local_guarantees, probe_host
from ._types import RunRequest, RunResult, SupervisorResult, from_supervisor

SUPERVISOR = str(Path(_supervisor.__file__).resolve())
PREFIX = host.PREFIX
UID_SLOTS = 1000  # uids uid_base .. uid_base + 999
MARGIN_S = 10.0  # host deadline = request timeout + this (the supervisor's kill takes < 5 s)
_HEALTH = RunRequest(language="python", code="pass", timeout_s=20.0)
_encoder = msgspec.json.Encoder()
_result_decoder = msgspec.json.Decoder(SupervisorResult)


def _setting(config: LocalConfig, name: str, default: Any) -> Any:
    """Settings ``LocalConfig`` may grow (read with defaults until it does)."""
    return getattr(config, name, default)


class LocalSandbox:
    """One slot: a uid, its cgroups and a warm supervisor. ``exec`` runs one request."""

    def __init__(self, backend: LocalBackend, index: int, uid: int | None, lock: IO[bytes] | None):
        self.id = f"local-{backend.owner_id}-{index}"
        self.index = index
        self.uid = uid
        self.runs = 0
        self.cgroup_dirs: list[str] = []
        """The slot's cgroups (the supervisor lives in them)."""
        self.program_dirs: list[str] = []
        """The program's: the slot's, or a ``run`` group of its own inside (memory, cpuacct)."""
        self._program_cgroups: _supervisor.Cgroups | None = None
        self._backend = backend
        self._lock = lock
        self._process: anyio.abc.Process | None = None
        self._reader: BufferedByteReceiveStream | None = None
        self._log_path = os.path.join(backend.workdir, f"supervisor-{index}.log")
        self._envelope: dict[str, Any] = {}
        self._broken: str | None = None

    async def _start(self, envelope: dict[str, Any]) -> None:
        self._envelope = envelope
        with open(self._log_path, "wb") as log:
            self._process = await anyio.open_process(
                [sys.executable, "-I", "-S", SUPERVISOR, "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
            )
        assert self._process.stdout is not None
        self._reader = BufferedByteReceiveStream(self._process.stdout)
        await self._backend._blocking(self._adopt_supervisor, self._process.pid)
        result = await self.exec(_HEALTH)
        if result.status != "ok":
            raise SandboxError(f"sandbox {self.id} failed its health check: {result.error}")
        self.runs = 0

    def _adopt_supervisor(self, pid: int) -> None:
        """Put the supervisor into the slot's cgroups once (its programs are born there, or in
        the ``run`` groups its zygote joined once), out of the OOM killer's reach, and at nice
        -20 so a fork bomb cannot starve it where they share a CPU quota (v2; its programs run
        at nice 0)."""
        for path in self.cgroup_dirs:
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        host.write_best_effort(f"/proc/{pid}/oom_score_adj", "-1000")
        try:
            os.setpriority(os.PRIO_PROCESS, pid, -20)
        except OSError:
            pass

    def _stderr_tail(self) -> str:
        try:
            with open(self._log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 2000))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def _error(self, message: str) -> RunResult:
        return RunResult(status="sandbox_error", error=message, backend="local", sandbox_id=self.id)

    async def exec(self, request: RunRequest) -> RunResult:
        """Run one (validated) request; never raises for what the program does."""
        if request.network:
            return RunResult(
                status="invalid_request",
                error="network: the local backend runs programs without network",
                backend="local",
                sandbox_id=self.id,
            )
        if self._broken or self._process is None or self._reader is None:
            return self._error(f"sandbox {self.id} is broken: {self._broken or 'not started'}")
        assert self._process.stdin is not None
        self.runs += 1
        cap = self._backend.memory_cap_mb
        if cap is not None and request.memory_mb > cap:
            request = msgspec.structs.replace(request, memory_mb=cap)
        line = _encoder.encode({**self._envelope, "request": request}) + b"\n"
        limit = 3 * request.output_limit_bytes + (1 << 20)  # base64: 4/3 of each stream
        try:
            with anyio.fail_after(request.timeout_s + MARGIN_S):
                await self._process.stdin.send(line)
                answer = await self._reader.receive_until(b"\n", limit)
        except anyio.get_cancelled_exc_class():
            self._broken = "a run was cancelled mid-way"
            self._kill_program()  # the pool destroys this sandbox next
            raise
        except TimeoutError:
            self._broken = "the supervisor missed its deadline"
            await self._stop()
            return self._error(f"no answer within {request.timeout_s + MARGIN_S:.0f} s")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.IncompleteRead) as exc:
            self._broken = f"the supervisor went away ({type(exc).__name__})"
            await self._stop()
            return self._error(f"{self._broken}: {self._stderr_tail()}")
        except anyio.DelimiterNotFound:
            self._broken = "the supervisor answered more than the limits allow"
            await self._stop()
            return self._error(self._broken)
        try:
            wire = _result_decoder.decode(answer)
        except msgspec.DecodeError as exc:
            self._broken = f"unreadable answer: {exc}"
            return self._error(self._broken)
        del answer  # the outputs live on in ``wire`` alone, then in the result alone
        result = from_supervisor(wire)
        del wire
        if result.status == "sandbox_error":
            self._broken = result.error or "sandbox_error"
        result.backend = "local"
        result.sandbox_id = self.id
        return result

    def _cgroups(self) -> _supervisor.Cgroups:
        """The program's cgroups (where it runs: a program cannot leave them)."""
        if self._program_cgroups is None:
            self._program_cgroups = _supervisor.Cgroups(self.program_dirs)
        return self._program_cgroups

    async def is_clean(self) -> bool:
        """No anomaly: the supervisor alive and answering, nothing left in the cgroups but the
        supervisor and its helpers (children of the supervisor still running as root, which no
        program process is once it runs)."""
        if self._broken or self._process is None or self._process.returncode is not None:
            return False
        supervisor = self._process.pid
        left = self._cgroups().members() - {supervisor}
        return all(host.is_helper(pid, supervisor) for pid in left)

    def _kill_program(self) -> None:
        """SIGKILL everything in the slot's cgroups but the supervisor, which then reaps it,
        finishes its run and stays usable for a clean shutdown (no orphans left to PID 1)."""
        keep = {self._process.pid} if self._process is not None else set()
        group = self._cgroups()
        group.kill(group.members() - keep)

    async def _stop(self, grace_s: float = 2.0) -> None:
        """Stop the supervisor: kill the program, EOF on stdin (it exits once idle); past
        ``grace_s`` SIGKILL its process group (the program has a parent-death SIGKILL and
        ``--die-with-parent``; ``destroy`` sweeps the cgroups again)."""
        process = self._process
        self._broken = self._broken or "destroyed"
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                self._kill_program()
                try:
                    if process.stdin is not None:
                        await process.stdin.aclose()
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass
                with anyio.move_on_after(grace_s):
                    await process.wait()
            if process.returncode is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except OSError:
                    pass
            await process.aclose()


class LocalBackend:
    """Backend for ``LocalConfig``; see the module docstring."""

    name = "local"

    def __init__(self, config: LocalConfig) -> None:
        self.config = config
        self.owner_id = f"{os.getpid()}-{host.start_time(os.getpid())}-{os.urandom(3).hex()}"
        self.pool_id = self.owner_id  # names this pool's cgroups and temp dir
        self.workdir = ""
        self._facts: HostFacts | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._sandboxes: dict[int, LocalSandbox] = {}
        self._next_index = 0
        self._pool_dirs: list[str] = []
        self._argv: list[str] = []
        self.max_processes = int(_setting(config, "max_processes", 512))
        self.cpus = float(_setting(config, "cpus", 1.0))
        self.memory_cap_mb: int | None = _setting(config, "memory_mb", None)
        self.sizes_mb = {
            host.WORKDIR: int(_setting(config, "scratch_mb", 256)),
            "/tmp": int(_setting(config, "tmp_mb", 64)),
            "/dev/shm": int(_setting(config, "shm_mb", 16)),
        }

    # -- host ------------------------------------------------------------------------------------
    def _probe(self) -> HostFacts:
        if self._facts is None:
            self._facts = probe_host(self.config.uid_base)
        return self._facts

    def guarantees(self) -> list[Guarantee]:
        return local_guarantees(
            self._probe(),
            cgroups=self.config.cgroups,
            max_processes=self.max_processes,
            cpus=self.cpus,
            sizes_mb=self.sizes_mb,
        )

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        assert self._limiter is not None
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def start(self) -> None:
        """Probe the host, check ``require``, reap orphaned cgroups, prepare /etc and cgroups."""
        self._limiter = anyio.CapacityLimiter(4)
        facts = await self._blocking(self._probe)
        guarantees = {g.name: g for g in self.guarantees()}
        unknown = [name for name in self.config.require if name not in guarantees]
        if unknown:
            raise BackendUnavailable(
                f"unknown guarantee(s) {unknown} in require; known: {sorted(guarantees)}"
            )
        missing = [guarantees[n] for n in self.config.require if not guarantees[n].available]
        if facts.bwrap is None or not facts.userns:
            missing.insert(0, guarantees["bubblewrap"])
        if missing:
            reasons = "; ".join(f"{g.name}: {g.detail}" for g in missing)
            raise BackendUnavailable(f"the local backend cannot run on this host: {reasons}")
        if facts.root:  # the slots' uids are used (and swept with kill(-1)) only as root
            await self._blocking(self._check_uids_are_nobodys)
        try:
            await self._blocking(self._prepare, facts)
        except OSError as exc:
            await self._blocking(self._remove_all)
            raise BackendUnavailable(
                f"the local backend could not prepare its temp dir or cgroups: {exc} "
                "(LocalConfig(cgroups=False) runs without cgroups)"
            ) from exc
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._blocking(self._remove_all)
            raise

    def _check_uids_are_nobodys(self) -> None:
        """Refuse a uid range holding an account of the host: each slot's uid is swept (every
        process of it killed), which would kill that account's processes too."""
        base = self.config.uid_base
        accounts = host.host_accounts(base, UID_SLOTS)
        if accounts:
            named = ", ".join(f"uid {uid} ({name})" for uid, name in accounts[:5])
            more = f" and {len(accounts) - 5} more" if len(accounts) > 5 else ""
            raise BackendUnavailable(
                f"the local backend's sandbox uids {base}..{base + UID_SLOTS - 1} include "
                f"accounts of this host: {named}{more}. Every process of a sandbox uid is "
                "killed after each run: choose a LocalConfig(uid_base=...) whose "
                f"{UID_SLOTS} uids no account uses"
            )

    def _prepare(self, facts: HostFacts) -> None:
        root = self.config.scratch_root or tempfile.gettempdir()
        host.reap_orphans(facts, root, self.config.cgroups)
        self.workdir = tempfile.mkdtemp(prefix=f"{PREFIX}{self.owner_id}-", dir=root)
        os.chmod(self.workdir, 0o755)  # the sandbox uid (bubblewrap) binds etc/ from here
        self._argv = host.bwrap_argv(facts, host.make_etc(self.workdir), self.sizes_mb)
        if self.config.cgroups:
            self._pool_dirs = host.make_pool_cgroups(facts, PREFIX + self.owner_id)

    # -- sandboxes -------------------------------------------------------------------------------
    def _open_slot(self) -> LocalSandbox:
        index = self._next_index  # never reused: a dir that failed to go away cannot clash
        self._next_index += 1
        uid, lock = None, None
        if self._probe().root:
            try:
                uid, lock = host.lock_uid(self.config.uid_base, UID_SLOTS)
            except OSError as exc:
                raise SandboxError(str(exc)) from exc
        sandbox = LocalSandbox(self, index, uid, lock)
        self._sandboxes[index] = sandbox
        try:
            sandbox.cgroup_dirs, sandbox.program_dirs = host.make_slot_cgroups(
                self._pool_dirs, index, self.cpus
            )
        except BaseException:
            self._close_slot(sandbox)
            raise
        return sandbox

    def _close_slot(self, sandbox: LocalSandbox) -> None:
        for path in sandbox.cgroup_dirs:
            host.empty_cgroup_dir(path)
        if sandbox.uid is not None and not sandbox.cgroup_dirs:
            host.kill_uid(sandbox.uid)
        if sandbox._lock is not None:
            sandbox._lock.close()
            sandbox._lock = None
        self._sandboxes.pop(sandbox.index, None)

    async def create(self) -> LocalSandbox:
        sandbox = self._open_slot()
        envelope = {
            "uid": sandbox.uid,
            "gid": sandbox.uid,
            "cgroup": sandbox.program_dirs,
            "bwrap": {
                "argv": self._argv,
                "post_argv": ["--remount-ro", "/", "--remount-ro", "/dev"],
                "workdir": host.WORKDIR,
                "main_dir": "/opt/agentrl",
            },
            "python": "/usr/bin/python3",
            "bash": "bash",
            "max_processes": self.max_processes,
            "nice": 0,  # the supervisor itself runs at -20
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": host.WORKDIR,
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
                "TMPDIR": "/tmp",
            },
        }
        try:
            await sandbox._start(envelope)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.destroy(sandbox)
            raise
        return sandbox

    async def destroy(self, sandbox: Any) -> None:
        """Stop the supervisor, kill whatever is left in the slot, free its uid and cgroups."""
        assert isinstance(sandbox, LocalSandbox)
        with anyio.CancelScope(shield=True):
            await sandbox._stop()
            if sandbox.index in self._sandboxes:
                await self._blocking(self._close_slot, sandbox)

    async def aclose(self) -> None:
        """Destroy every slot; remove the pool's cgroups and temp dir."""
        with anyio.CancelScope(shield=True):
            for sandbox in list(self._sandboxes.values()):
                await self.destroy(sandbox)
            if self._limiter is not None:
                await self._blocking(self._remove_all)

    def _remove_all(self) -> None:
        for path in self._pool_dirs:
            host.empty_cgroup_dir(path)
        self._pool_dirs = []
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""
