"""The docker and gvisor backends: warm, locked-down containers made through the docker SDK.

Each container: read-only rootfs; tmpfs ``/scratch`` (per-request dirs), ``/tmp`` and a small
``/dev/shm``; ``network_mode="none"``; memory (no swap), CPU and (runc only) pids limits; every
capability dropped but CHOWN, DAC_OVERRIDE, FOWNER, SETUID, SETGID and KILL, which the supervisor
needs to make the scratch dir, drop to the program's uid and clean up; ``no-new-privileges``.

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

from ._backend import Guarantee
from ._config import DockerConfig, GVisorConfig, check_docker_socket, docker_host_from_env
from ._container import ContainerSandbox, ExecSpec
from ._errors import BackendUnavailable, SandboxError
from ._types import RunRequest

LABEL = "agentrl.sandbox"
SCRATCH_ROOT = "/scratch"
PROBE_DIRS = [SCRATCH_ROOT, "/tmp", "/dev/shm", "/dev/mqueue"]
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
        stat = Path(f"/proc/{pid}/stat").read_text()
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
        self._spec = ExecSpec(
            api=self._client.api,
            cmd=["python3", "-I", "-S", "-c", wrapper, source, json.dumps(PROBE_DIRS)],
            environment=EXEC_ENV,
            scratch_root=SCRATCH_ROOT,
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
            user="0:0",
            network_mode="none",
            read_only=True,
            tmpfs={
                SCRATCH_ROOT: f"rw,nosuid,nodev,size={c.scratch_mb}m,mode=755",
                "/tmp": f"rw,nosuid,nodev,size={c.tmp_mb}m,mode=1777",
            },
            shm_size=f"{c.shm_mb}m",
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
        c = self.config
        gvisor = self.runtime is not None
        return [
            Guarantee("network_isolation", True, "network_mode=none (no interfaces but lo)"),
            Guarantee("readonly_root", True, "read-only rootfs; tmpfs /scratch, /tmp, /dev/shm"),
            Guarantee(
                "memory_limit",
                True,
                f"container cap {c.memory_mb} MB without swap; per-request RLIMIT_AS (requests "
                f"above {c.memory_mb - _SUPERVISOR_MB} MB get that)",
            ),
            Guarantee("cpu_limit", True, f"{c.cpus} CPUs per container; per-request RLIMIT_CPU"),
            Guarantee(
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
            Guarantee(
                "separate_uid",
                True,
                "programs run as a per-container uid; supervisor as root with "
                f"{', '.join(CAPABILITIES)} only; init as uid {c.init_uid}",
            ),
            Guarantee("no_new_privileges", True, "no-new-privileges, all other caps dropped"),
            Guarantee(
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
