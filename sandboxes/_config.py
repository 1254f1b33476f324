"""Pool and backend configuration (pydantic: what people write in YAML or on the command line).

The backend is a discriminated union on ``type``::

    PoolConfig(backend={"type": "docker", "cpus": 1.0}, size=8)
"""

from __future__ import annotations

import os
import socket
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_DOCKER_HOST = "unix:///run/agentrl-docker.sock"
DEFAULT_IMAGE = "agentrl-sandbox:bookworm"


def docker_host_from_env() -> str:
    """The Docker daemon the sandboxes use: ``$AGENTRL_DOCKER_HOST`` or the agentrl socket."""
    return os.environ.get("AGENTRL_DOCKER_HOST") or DEFAULT_DOCKER_HOST


def check_docker_socket(host: str) -> None:
    """For a ``unix://`` host, raise ``OSError`` unless something accepts on the socket.

    (The docker SDK leaks the socket of a failed connect, a ResourceWarning.)"""
    if not host.startswith("unix://"):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(host.removeprefix("unix://"))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:
        """``size: true`` is refused, naming the field (pydantic would read it as 1)."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if isinstance(data.get(name), bool) and field.annotation in _NUMBERS:
                    raise ValueError(f"{name}: a number is due here, not a boolean")
        return data


_NUMBERS = (int, float, int | None, float | None)
"""The numeric field types of the sandbox configs (a boolean is not one of their values)."""


class _ContainerConfig(_Model):
    """Settings shared by the docker and gvisor backends (one warm container per sandbox)."""

    image: str = DEFAULT_IMAGE
    """Image with ``python3`` (and ``bash`` for bash programs); any user image is accepted."""
    docker_host: str | None = None
    """Docker daemon URL; ``None`` reads ``$AGENTRL_DOCKER_HOST`` (default the agentrl socket)."""
    memory_mb: int = Field(1024, ge=64)
    """Memory cap of the whole container (``mem_limit``, swap disabled). A request's own
    ``memory_mb`` is held inside this cap by the supervisor, which samples the container's memory
    and ends the program past it (``oom``); requests asking for more get this cap less 64 MB."""
    cpus: float = Field(1.0, gt=0)
    """CPU cap of the whole container (``nano_cpus``): a runaway program cannot starve the host."""
    pids_limit: int | None = Field(512, ge=16)
    """Max host tasks (processes and threads) of the container's cgroup; ``None``: no limit."""
    scratch_mb: int = Field(256, ge=8)
    """Size of the ``/scratch`` tmpfs holding each request's fresh working dir."""
    tmp_mb: int = Field(64, ge=8)
    """Size of the ``/tmp`` tmpfs."""
    shm_mb: int = Field(16, ge=1)
    """Size of ``/dev/shm``."""
    init_uid: int = Field(65532, ge=1)
    """Non-root uid the container's init (PID 1, a reaper) switches to right after starting."""
    program_uid_base: int = Field(200_000, ge=1000)
    """Programs run as uid/gid ``program_uid_base + k``, ``k`` unique per container of a pool
    (< 50000): never root, never the supervisor's or init's uid, so a program can signal neither,
    and RLIMIT_NPROC (per uid on the host kernel under runc) is not shared across containers."""
    max_concurrent_creates: int = Field(4, ge=1)
    """Containers created at once (bounded: 20 concurrent starts take seconds here)."""
    create_timeout_s: float = Field(60.0, gt=0)
    """A container that is not healthy by then is removed and the create fails."""
    exec_margin_s: float = Field(10.0, gt=0)
    """Host-side deadline of one request = its timeout + this margin; past it the request
    gets ``sandbox_error`` and the container is removed (killing everything in it)."""
    labels: dict[str, str] = {}
    """Extra labels on every container (``agentrl.sandbox=1``, ``agentrl.pool`` are always set)."""


class DockerConfig(_ContainerConfig):
    """Warm containers under Docker's default runtime (runc)."""

    type: Literal["docker"] = "docker"
    """Backend discriminator."""


class GVisorConfig(_ContainerConfig):
    """Warm containers under gVisor (``runsc``, registered in the daemon's config by
    ``scripts/services start`` with ``--platform=ptrace --network=none``).

    gVisor does not enforce RLIMIT_NPROC, so a fork bomb is stopped by the pids cgroup of the
    runsc sandbox instead: reaching it kills the whole container within 1-2 s (measured here).
    The request then ends as ``sandbox_error`` (the host notices the container is gone), the pool
    replaces the container and keeps serving; the CPU cap keeps the host responsive meanwhile."""

    type: Literal["gvisor"] = "gvisor"
    """Backend discriminator."""
    runtime: str = "runsc"
    """Name of the gVisor runtime in the daemon's config."""
    pids_limit: int | None = Field(1024, ge=256)
    """Limit on the runsc sandbox's *host* tasks (sentry threads, ptrace stubs: about 70 with
    its serve exec, levelling off near 95 however many requests it serves, measured here).
    Reaching it kills the container, which is how a fork bomb ends here. ``None`` lets a bomb
    fill the memory cap instead, and such a container can take minutes to remove."""
    exec_margin_s: float = Field(20.0, gt=0)
    """Host-side margin over the request timeout (gVisor forks and starts programs slower)."""


class LocalConfig(_Model):
    """bubblewrap + rlimits + a per-sandbox uid + cgroup v1 memory/pids where writable."""

    type: Literal["local"] = "local"
    """Backend discriminator."""
    require: list[str] = []
    """Guarantees (by name, see ``SandboxPool.guarantees()``) that must be available, else the
    pool refuses to start with ``BackendUnavailable``."""
    uid_base: int = Field(61000, ge=1000)
    """Sandbox ``i`` runs its programs as uid/gid ``uid_base + i`` (needs root; otherwise the
    programs run as the caller and the ``separate_uid`` guarantee is reported missing). Every
    process of a sandbox uid is killed after each run, so the 1000 uids from ``uid_base`` must
    be no account's: as root, the pool refuses to start when the host's passwd database has
    one there (naming it)."""
    scratch_root: str | None = None
    """Where per-sandbox temp dirs are made; ``None`` uses the system temp dir."""
    cgroups: bool = True
    """Use cgroup v1 memory/pids controllers where writable."""
    max_processes: int = Field(512, ge=16)
    """Processes per sandbox (cgroup ``pids.max`` and RLIMIT_NPROC of the sandbox uid)."""
    cpus: float = Field(1.0, gt=0)
    """CPU share per sandbox (cgroup cpu quota, where writable)."""
    memory_mb: int | None = Field(None, ge=64)
    """Memory cap of a whole sandbox (cgroup); ``None``: each request's ``memory_mb``."""
    scratch_mb: int = Field(256, ge=8)
    """Size of the tmpfs holding the request's working dir."""
    tmp_mb: int = Field(64, ge=8)
    """Size of the sandbox's ``/tmp`` tmpfs."""
    shm_mb: int = Field(16, ge=1)
    """Size of the sandbox's ``/dev/shm``."""


BackendConfig = Annotated[DockerConfig | GVisorConfig | LocalConfig, Field(discriminator="type")]


class PoolConfig(_Model):
    """A pool of warm sandboxes behind a bounded admission queue."""

    backend: BackendConfig = LocalConfig()
    """Which backend makes the sandboxes, with its settings."""
    size: int = Field(4, ge=1, le=256)
    """Warm sandboxes kept ready, and the most requests running at once."""
    max_queue: int = Field(64, ge=0)
    """Requests allowed to wait for a sandbox; one more raises ``PoolBusy``."""
    queue_timeout_s: float = Field(30.0, gt=0)
    """A waiting request gives up after this long with ``PoolBusy``."""
    recycle_after: int = Field(100, ge=1)
    """Execs per sandbox before it is replaced by a fresh one."""


class ServiceConfig(_Model):
    """Limits of ``agentrl sandbox serve`` itself: its memory, connections and clients' pace.

    Every POST reserves its body (its ``Content-Length`` before reading it; a chunked body as
    it arrives) and, once parsed, its answer (2 × ``output_limit_bytes`` per
    item: stdout and stderr) from one budget of ``max_inflight_bytes``, twice each (the service
    holds a body as bytes, then text, then values; an answer's output as it comes from the
    sandbox, then as text), settles all of it to what the results take once they are known and
    the request's own values dropped (their texts at 1, 2 or 4 bytes a character: charged even
    past the budget), and gives it back once the answer is sent. A request that can never fit is
    refused with 413; one that does not fit *now* with 503 and ``Retry-After`` (nothing ran).
    The memory the service holds for requests thus stays near ``max_inflight_bytes``."""

    max_request_bytes: int = Field(64 * 2**20, ge=64 * 2**10)
    """Largest request body (413 ``request_too_large`` past it)."""
    max_batch: int = Field(256, ge=1)
    """Most items in one ``/v1/run_batch`` (400 past it)."""
    max_answer_bytes: int = Field(64 * 2**20, ge=2**20)
    """Largest answer a request may ask for: the sum over its items of 2 ×
    ``output_limit_bytes`` (413 ``answer_too_large`` up front, before anything runs)."""
    max_inflight_bytes: int = Field(256 * 2**20, ge=2**20)
    """Memory for bodies and answers held at once, over all requests (503 ``overloaded`` past
    it). At least 2 × (``max_request_bytes`` + ``max_answer_bytes``), so any acceptable request
    fits alone."""
    max_head_bytes: int = Field(32 * 2**10, ge=1024)
    """Largest request head (request line and headers); past it the connection is closed."""
    max_connections: int = Field(256, ge=2)
    """Open client connections. At the cap, a new connection evicts the one that has waited
    longest for a request head (idle keep-alive or a slow client), or else the one receiving
    its body longest; when every connection is busy with a request, the new one gets 503
    ``overloaded`` and is closed."""
    idle_timeout_s: float = Field(30.0, gt=0)
    """A connection with no request started (after it opened, or between requests) is closed
    after this long."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A request head (request line and headers) must arrive whole within this long of its
    first byte, else the connection is closed."""
    body_timeout_s: float = Field(60.0, gt=0)
    """A request body must arrive whole within this long (408 ``request_timeout``)."""
    send_timeout_s: float = Field(60.0, gt=0)
    """The client must take the whole answer within this long, else the connection is closed."""
    shutdown_timeout_s: float = Field(30.0, gt=0)
    """On SIGTERM/SIGINT, running requests get this long to finish."""

    @model_validator(mode="after")
    def _budget_fits_one_request(self) -> ServiceConfig:
        if self.max_inflight_bytes < 2 * (self.max_request_bytes + self.max_answer_bytes):
            raise ValueError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) must be at least 2 × "
                f"(max_request_bytes + max_answer_bytes) = 2 × ({self.max_request_bytes} + "
                f"{self.max_answer_bytes}): otherwise a valid request could never be served"
            )
        return self
