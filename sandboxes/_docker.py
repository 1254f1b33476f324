"""The docker and gvisor backends: warm, locked-down containers made through the docker SDK.

Each container: read-only rootfs; tmpfs ``/scratch`` (per-request dirs), ``/tmp`` and a small
``/dev/shm``, each capped in bytes and inodes; System V shared memory capped at ``shm_mb`` and
few message queues (IPC sysctls of its own IPC namespace); ``network_mode="none"``; memory (no
swap), CPU and (runc only) pids limits; every capability dropped but CHOWN, DAC_OVERRIDE, FOWNER,
SETUID, SETGID and KILL, which the supervisor needs to make the scratch dir, drop to the
program's uid and clean up; ``no-new-privileges``. A request's ``memory_mb`` and ``cpu_time_s``
are held by the supervisor sampling the container's own counters; after each request the exec
wrapper looks for leftovers (processes, files, System V IPC objects, sockets) and a container
with any, or one it cannot check, is recycled (``docs/sandboxes.md``).

Three identities per container: a reaping init (PID 1, ``python3`` waiting on orphans) starts as
root and drops to ``init_uid`` at once (the container must start as root: Docker gives the execs
of a non-root container no capabilities, even with ``user="0"``); the supervisor runs as root, in
one long-lived ``docker exec`` with ``user="0"`` serving every request of the container over its
attached stdin/stdout (see ``_container``), bounded by the capabilities above; the program runs
as a uid unique to the container, so it can signal neither init nor its supervisor, and
RLIMIT_NPROC (counted per uid by the host kernel under runc) is not shared across containers.

Containers are labelled ``agentrl.sandbox=1``, ``agentrl.pool=<uuid>`` and ``agentrl.owner=
<host>:<pid>:<start time>``; ``start`` removes containers whose owner process is gone (orphans of
a crashed run), ``aclose`` every container of this pool. gvisor is the same through the ``runsc``
runtime; see ``GVisorConfig`` for what it cannot contain the way runc does.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import anyio

from . import _supervisor
from ._backend import Guarantee
from ._config import DockerConfig, GVisorConfig, check_docker_socket, docker_host_from_env
from ._container import ContainerSandbox, ExecSpec
from ._errors import BackendUnavailable, SandboxError
from ._types import RunRequest

LABEL = "agentrl.sandbox"
SCRATCH_ROOT = "/scratch"
# The writable dirs the leftover probe lists after each request (it must be able to: a dir it
# cannot list recycles the container). gVisor mounts no /dev/mqueue, so it cannot list POSIX
# message queues there: its programs may not open one (the seccomp filter refuses mq_open).
PROBE_DIRS = [SCRATCH_ROOT, "/tmp", "/dev/shm", "/dev/mqueue"]
GVISOR_PROBE_DIRS = [SCRATCH_ROOT, "/tmp", "/dev/shm"]
MQUEUE_SYSCALLS = ["mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify"]
BYTES_PER_INODE = 4096  # each tmpfs gets one inode per this many bytes of its size,
MIN_ENTRIES = 1024  # and room for this many (what request validation allows in files and dirs)
SYSV_MSG_QUEUES = 32  # kernel.msgmni: 32 queues of at most 16 KB each
CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID", "KILL"]
# PID 1: drops root, then reaps orphans (double-forked daemons the supervisor killed) so no
# zombies pile up. The container itself must start as root: Docker gives execs of a container
# whose user is non-root no capabilities, even with user="0".
INIT_SOURCE = """\
import os, signal, sys
uid = int(sys.argv[1])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
sigs = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
while True:
    if signal.sigwait(sigs) != signal.SIGCHLD:
        os._exit(0)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
"""
EXEC_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}
_HEALTH_REQUEST = RunRequest(language="python", code="print('ok')", timeout_s=20.0)
_SUPERVISOR_MB = 64  # container memory kept for the supervisor and init
_PROGRAM_UIDS = 50_000  # programs run as uid program_uid_base + k, k unique per container


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text("utf-8", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks


def _owner_alive(owner: str) -> bool:
    host, _, rest = owner.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname():
        return True  # another machine's container on a shared daemon: not ours to judge
    try:
        return _start_time(int(pid)) == started
    except ValueError:
        return False


def _tmpfs_options(size_mb: int, mode: str) -> str:
    inodes = max((size_mb << 20) // BYTES_PER_INODE, MIN_ENTRIES + 1)  # + its root dir
    return f"rw,nosuid,nodev,size={size_mb}m,nr_inodes={inodes},mode={mode}"


def _supervisor_source() -> str:
    path = Path(__file__).with_name("_supervisor.py")
    try:
        return path.read_text()
    except OSError as exc:
        raise BackendUnavailable(f"the sandbox supervisor {path} is missing") from exc


class ContainerBackend:
    """Backend for ``DockerConfig`` (runc) and ``GVisorConfig`` (runsc)."""

    def __init__(self, config: DockerConfig | GVisorConfig) -> None:
        self.config = config
        self.name = config.type
        self.runtime = config.runtime if isinstance(config, GVisorConfig) else None
        self.pool_id = uuid.uuid4().hex
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"
        self.created: list[str] = []
        """Ids of every container this backend made (for leak checks and debugging)."""
        self._client: Any = None
        self._spec: ExecSpec | None = None
        self._uids = itertools.count(int(self.pool_id[:8], 16) % _PROGRAM_UIDS)
        self._api_limiter: anyio.CapacityLimiter | None = None
        self._exec_limiter: anyio.CapacityLimiter | None = None
        self._create_limiter: anyio.CapacityLimiter | None = None

    # -- helpers ---------------------------------------------------------------------------------
    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        assert self._api_limiter is not None
        return await anyio.to_thread.run_sync(
            lambda: fn(*args, **kwargs), limiter=self._api_limiter
        )

    def _labels(self) -> dict[str, str]:
        return {
            **self.config.labels,
            LABEL: "1",
            "agentrl.pool": self.pool_id,
            "agentrl.owner": self.owner,
            "agentrl.backend": self.name,
        }

    # -- Backend protocol ------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, check the image and runtime, reap orphaned containers of earlier runs."""
        import docker

        self._api_limiter = anyio.CapacityLimiter(16)
        self._exec_limiter = anyio.CapacityLimiter(512)
        self._create_limiter = anyio.CapacityLimiter(self.config.max_concurrent_creates)
        host = self.config.docker_host or docker_host_from_env()
        source = _supervisor_source()
        wrapper = Path(__file__).with_name("_exec_wrapper.py").read_text()

        def connect() -> Any:
            check_docker_socket(host)
            client = docker.DockerClient(base_url=host, timeout=120, max_pool_size=64)
            try:
                client.ping()
                info = client.info()
            except Exception:
                client.close()
                raise
            return client, info

        try:
            self._client, info = await anyio.to_thread.run_sync(connect, limiter=self._api_limiter)
        except Exception as exc:
            raise BackendUnavailable(
                f"Docker daemon at {host} unreachable ({type(exc).__name__}: {exc}); "
                "start it with scripts/services start (or set AGENTRL_DOCKER_HOST)"
            ) from exc
        if self.runtime and self.runtime not in (info.get("Runtimes") or {}):
            await self.aclose()
            raise BackendUnavailable(
                f"the Docker daemon at {host} has no '{self.runtime}' runtime; register runsc in "
                "its daemon.json (scripts/services start does)"
            )
        try:
            await self._call(self._client.images.get, self.config.image)
        except docker.errors.ImageNotFound as exc:
            await self.aclose()
            raise BackendUnavailable(
                f"image {self.config.image} not found; build it with `agentrl sandbox image build`"
            ) from exc
        gvisor = self.runtime is not None
        probe_dirs = GVISOR_PROBE_DIRS if gvisor else PROBE_DIRS
        self._spec = ExecSpec(
            api=self._client.api,
            cmd=["python3", "-I", "-S", "-c", wrapper, source, json.dumps(probe_dirs)],
            environment=EXEC_ENV,
            scratch_root=SCRATCH_ROOT,
            deny_syscalls=[*_supervisor.DEFAULT_DENY, *(MQUEUE_SYSCALLS if gvisor else [])],
            watch_s=1.0 if gvisor else None,
        )
        await self.reap_orphans()

    async def reap_orphans(self) -> int:
        """Remove labelled containers whose owner process is gone; return how many."""
        orphans = [
            c["Id"]
            for c in await self._list({"label": f"{LABEL}=1"})
            if not _owner_alive((c.get("Labels") or {}).get("agentrl.owner", ""))
        ]
        async with anyio.create_task_group() as tg:
            for container_id in orphans:
                tg.start_soon(self._remove, container_id)
        return len(orphans)

    async def _list(self, filters: dict[str, str]) -> list[dict[str, Any]]:
        """One list call (``containers.list`` would inspect each container afterwards, racing
        with removals by other pools)."""
        return await self._call(self._client.api.containers, all=True, filters=filters)

    async def _remove(self, container_id: str) -> None:
        import docker

        try:
            await self._call(self._client.api.remove_container, container_id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in str(exc):
                raise

    def _run_kwargs(self) -> dict[str, Any]:
        c = self.config
        kwargs: dict[str, Any] = dict(
            command=["python3", "-c", INIT_SOURCE, str(c.init_uid)],
            detach=True,
            # a pipe for the init's stdin, not the host's /dev/null: runsc hands its stdio
            # files to the sandbox user and chowned the host's /dev/null to nobody (65534)
            # with every gVisor container it started
            stdin_open=True,
            user="0:0",
            network_mode="none",
            read_only=True,
            tmpfs={
                SCRATCH_ROOT: _tmpfs_options(c.scratch_mb, "755"),
                "/tmp": _tmpfs_options(c.tmp_mb, "1777"),
                "/dev/shm": _tmpfs_options(c.shm_mb, "1777"),
            },
            # the container's own IPC namespace: System V shared memory within shm_mb, few
            # message queues (memory no process holds: it must stay small; runsc ignores these)
            sysctls={
                "kernel.shmmax": str(c.shm_mb << 20),
                "kernel.shmall": str((c.shm_mb << 20) // 4096),
                "kernel.msgmni": str(SYSV_MSG_QUEUES),
            },
            mem_limit=f"{c.memory_mb}m",
            memswap_limit=f"{c.memory_mb}m",
            nano_cpus=int(c.cpus * 1e9),
            cap_drop=["ALL"],
            cap_add=CAPABILITIES,
            security_opt=["no-new-privileges"],
            labels=self._labels(),
            hostname="sandbox",
            environment={"PYTHONDONTWRITEBYTECODE": "1"},
            log_config={"type": "none", "config": {}},
            stop_signal="SIGKILL",
        )
        if self.runtime:
            kwargs["runtime"] = self.runtime
        if c.pids_limit is not None:
            kwargs["pids_limit"] = c.pids_limit
        return kwargs

    async def create(self) -> ContainerSandbox:
        """Start a container and its serve exec; health-check it with a trivial program."""
        assert self._create_limiter is not None and self._spec is not None
        assert self._exec_limiter is not None
        uid = self.config.program_uid_base + next(self._uids) % _PROGRAM_UIDS
        container_id: str | None = None
        sandbox: ContainerSandbox | None = None
        try:
            with anyio.fail_after(self.config.create_timeout_s):
                async with self._create_limiter:
                    container = await self._call(
                        self._client.containers.run, self.config.image, **self._run_kwargs()
                    )
                container_id = container.id
                self.created.append(container.id)
                sandbox = ContainerSandbox(
                    id=container.id[:12],
                    container_id=container.id,
                    backend=self.name,
                    program_uid=uid,
                    spec=self._spec,
                    limiter=self._exec_limiter,
                    margin_s=self.config.exec_margin_s,
                    memory_cap_mb=max(self.config.memory_mb - _SUPERVISOR_MB, 16),
                )
                await sandbox.start()
                result = await sandbox.exec(_HEALTH_REQUEST)
                if result.status != "ok" or result.stdout != "ok\n" or not sandbox.clean:
                    raise SandboxError(
                        f"health check of container {sandbox.id} failed: status={result.status} "
                        f"error={result.error!r} stdout={result.stdout[:200]!r} "
                        f"stderr={result.stderr[:500]!r} probe={sandbox.last_probe}"
                    )
                sandbox.runs = 0
                return sandbox
        except BaseException:
            if sandbox is not None:
                sandbox.close()
            if container_id is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await self._remove(container_id)
                    except Exception:
                        pass  # aclose() removes every container of this pool
            raise

    async def destroy(self, sandbox: ContainerSandbox) -> None:  # type: ignore[override]
        """Close its serve stream and remove the container (``force``: kills every process
        in it)."""
        sandbox.close()
        await self._remove(sandbox.container_id)

    def guarantees(self) -> list[Guarantee]:
        """What this backend holds a program to, each with how; a row that is not available
        names a gap (``agentrl doctor`` prints them)."""
        c = self.config
        gvisor = self.runtime is not None
        tmpfs_mb = c.scratch_mb + c.tmp_mb + c.shm_mb
        fits = tmpfs_mb + _SUPERVISOR_MB <= c.memory_mb
        g = Guarantee
        return [
            g("network_isolation", True, "network_mode=none (no interfaces but lo)"),
            g("readonly_root", True, "read-only rootfs; tmpfs /scratch, /tmp, /dev/shm"),
            g(
                "memory_limit",
                True,
                "memory_mb per request: the container's memory (anonymous, tmpfs files, "
                "memfds, System V shared memory, every process) sampled every "
                + ("~40 ms" if gvisor else "10 ms")
                + ", the program "
                "killed past it (oom); "
                + (
                    "under gVisor from its /proc/meminfo"
                    if gvisor
                    else "from the container's cgroup, whose high-water mark peak_memory_mb "
                    "uses when the request set a new one"
                )
                + f"; container cap {c.memory_mb} MB without swap (requests above "
                f"{c.memory_mb - _SUPERVISOR_MB} MB get that); RLIMIT_AS per process",
            ),
            g(
                "memory_hard_limit",
                False,
                "sampled, not enforced by the kernel per request: between two samples a "
                "program can pass memory_mb, up to the container cap"
                + (
                    ", where the host's OOM killer ends the whole runsc sandbox (oom, without "
                    "peak_memory_mb; the pool replaces the container)"
                    if gvisor
                    else ", where the kernel's OOM killer picks the program (oom_score_adj 1000)"
                ),
            ),
            g(
                "oom_keeps_the_container",
                fits and not gvisor,
                "runsc ignores the IPC sysctls, so System V shared memory is not capped, and "
                "pipe and socket buffers live in gVisor's own kernel memory, which memory_mb "
                "does not see and gVisor keeps after the program exits: memory no process "
                "holds can reach the container cap, which the host enforces on the whole runsc "
                "sandbox (oom, or a later request's sandbox_error; the pool replaces the "
                "container)"
                if gvisor
                else f"the tmpfs mounts ({tmpfs_mb} MB), System V shared memory (shm_mb) and the "
                f"supervisor's share ({_SUPERVISOR_MB} MB) fit under the container cap: memory "
                "no process holds cannot make the OOM killer take the supervisor"
                if fits
                else f"the tmpfs mounts ({tmpfs_mb} MB) and the supervisor's share "
                f"({_SUPERVISOR_MB} MB) exceed the container cap ({c.memory_mb} MB): a program "
                "that fills them can get its supervisor killed (raise memory_mb or lower "
                "scratch_mb/tmp_mb/shm_mb)",
            ),
            g("cpu_limit", True, f"{c.cpus} CPUs per container; per-request RLIMIT_CPU"),
            g(
                "cpu_time_per_request",
                not gvisor,
                "cpu_time_s counts every process of the request (the container's cpuacct less "
                "its supervisor and init, checked every 50 ms); cpu_s reports the same"
                if not gvisor
                else "cpu_time_s counts the live processes of the program's uid (as gVisor's "
                "kernel times them) and the ones the supervisor reaped: children a program "
                "lets the kernel reap (SIGCHLD ignored) and orphans (gVisor has no child "
                "subreaper: they go to the container's init) escape the sum, each still under "
                "RLIMIT_CPU",
            ),
            g(
                "pids_limit",
                c.pids_limit is not None,
                (
                    f"pids_limit={c.pids_limit} host tasks of the runsc sandbox; gVisor ignores "
                    "RLIMIT_NPROC, so a fork bomb reaches it and the container dies (the request "
                    "gets sandbox_error, the pool replaces the container)"
                    if gvisor
                    else f"pids_limit={c.pids_limit} per container; RLIMIT_NPROC per request"
                )
                if c.pids_limit is not None
                else "no pids limit configured",
            ),
            g(
                "disk_limit",
                True,
                f"size-capped tmpfs: /scratch {c.scratch_mb} MB, /tmp {c.tmp_mb} MB, /dev/shm "
                f"{c.shm_mb} MB; RLIMIT_FSIZE",
            ),
            g(
                "tmpfs_inodes",
                not gvisor,
                "nr_inodes = size / 4 KiB (at least 1024) on each tmpfs"
                if not gvisor
                else "runsc ignores nr_inodes: empty files are bounded only by the container's "
                "memory cap",
            ),
            g(
                "separate_uid",
                True,
                "programs run as a per-container uid; supervisor as root with "
                f"{', '.join(CAPABILITIES)} only; init as uid {c.init_uid}",
            ),
            g("no_new_privileges", True, "no-new-privileges, all other caps dropped"),
            g(
                "seccomp",
                True,
                "a BPF filter of the supervisor's: the keyring calls, io_uring_*, bpf, "
                "perf_event_open, userfaultfd"
                + (
                    " and the mq_* calls answer EPERM"
                    if gvisor
                    else " answer EPERM (Docker's default profile refuses them too)"
                )
                + "; sockets other than unix, inet, inet6, netlink answer EAFNOSUPPORT",
            ),
            g(
                "kernel_objects",
                True,
                "after each request the container is recycled when anything is left or cannot "
                "be checked: processes (zombies too), entries in "
                + ", ".join(GVISOR_PROBE_DIRS if gvisor else PROBE_DIRS)
                + ", System V message queues, shared memory and semaphore sets (counted through "
                "msgctl/shmctl/semctl *_INFO, proven on a canary at start), unix sockets "
                "(/proc/net/unix)",
            ),
            g(
                "posix_mqueue",
                not gvisor,
                "POSIX message queues are files in the container's /dev/mqueue (listed after "
                "each request)"
                if not gvisor
                else "refused (mq_open answers EPERM): gVisor mounts no /dev/mqueue, so leftover "
                "queues could not be listed",
            ),
            g(
                "kernel_isolation",
                gvisor,
                "gVisor user-space kernel (runsc, platform ptrace)"
                if gvisor
                else "runc shares the host kernel (use gvisor for a second boundary)",
            ),
        ]

    async def aclose(self) -> None:
        """Remove every container of this pool and close the client."""
        if self._client is None:
            return
        try:
            with anyio.CancelScope(shield=True):
                containers = await self._list({"label": f"agentrl.pool={self.pool_id}"})
                async with anyio.create_task_group() as tg:
                    for container in containers:
                        tg.start_soon(self._remove, container["Id"])
        finally:
            client, self._client = self._client, None
            client.close()
