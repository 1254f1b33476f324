"""Fixtures for the sandbox tests: the Docker daemon, the image, and pools per backend.

Tests marked ``docker`` skip with the reason when the daemon at ``$AGENTRL_DOCKER_HOST`` (default
the agentrl socket, started by ``scripts/services start``) is unreachable, except under
``AGENTRL_REQUIRE_DOCKER=1`` (CI), where they fail. The image ``agentrl-sandbox:bookworm`` is
built once when missing.

``sandbox_backend`` is parametrized over ``local``, ``docker`` and ``gvisor``; its ``open()``
opens a pool and, after the pool is closed, checks that nothing leaked (containers of the pool,
processes of the sandbox uids, temp dirs, cgroups). ``backend_pool`` is such a pool, open.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from sandbox_procs import host_processes, processes_mentioning

from agentrl.sandboxes import (
    BackendUnavailable,
    DockerConfig,
    GVisorConfig,
    LocalConfig,
    PoolConfig,
    SandboxPool,
    open_sandbox_pool,
)
from agentrl.sandboxes._config import DEFAULT_IMAGE, check_docker_socket, docker_host_from_env

REQUIRE_DOCKER = os.environ.get("AGENTRL_REQUIRE_DOCKER") == "1"
# uid ranges for this suite (distinct from other tests' defaults, so leak checks see only ours)
LOCAL_UID_BASE = 63_000
CONTAINER_UID_BASE = 300_000
UID_SPAN = 50_000


def _unavailable(reason: str) -> None:
    if REQUIRE_DOCKER:
        pytest.fail(f"{reason} (AGENTRL_REQUIRE_DOCKER=1)")
    pytest.skip(reason)


@functools.cache
def _docker_state() -> tuple[str | None, frozenset[str]]:
    """(reason it is unusable or None, runtimes) for the daemon, probed once per session."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed (pip install docker)", frozenset()
    host = docker_host_from_env()
    try:
        check_docker_socket(host)
        client = docker.DockerClient(base_url=host, timeout=10)
    except Exception as exc:
        return (
            f"Docker daemon at {host} unreachable ({exc}); run scripts/services start",
            frozenset(),
        )
    try:
        client.ping()
        runtimes = frozenset((client.info().get("Runtimes") or {}).keys())
    except Exception as exc:
        return (
            f"Docker daemon at {host} unreachable ({exc}); run scripts/services start",
            frozenset(),
        )
    finally:
        client.close()
    return None, runtimes


@functools.cache
def _image_state() -> str | None:
    """Build the sandbox image when missing; the reason it is unusable, or None."""
    from agentrl.sandboxes import BackendUnavailable, build_image

    try:
        build_image(DEFAULT_IMAGE, progress=lambda line: print(f"[image] {line}", flush=True))
    except BackendUnavailable as exc:
        return f"cannot build {DEFAULT_IMAGE}: {exc}"
    except PermissionError as exc:
        return f"cannot build {DEFAULT_IMAGE} (needs root for debootstrap): {exc}"
    return None


def require_docker(runtime: str | None = None) -> None:
    """Skip (or fail under AGENTRL_REQUIRE_DOCKER=1) unless Docker, the image and ``runtime``
    are usable."""
    reason, runtimes = _docker_state()
    if reason:
        _unavailable(reason)
    if runtime and runtime not in runtimes:
        _unavailable(f"the Docker daemon has no '{runtime}' runtime (scripts/services start)")
    reason = _image_state()
    if reason:
        _unavailable(reason)


@pytest.fixture(autouse=True)
def _docker_marker_gate(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("docker") is not None:
        require_docker()


# -- leak checks -----------------------------------------------------------------------------------
def cgroups_named(needles: set[str]) -> list[str]:
    """cgroup v1/v2 dirs whose name contains one of ``needles`` (a pool id, container ids)."""
    found: list[str] = []
    if not needles:
        return found
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        for name in dirnames:
            if any(n in name for n in needles):
                found.append(os.path.join(dirpath, name))
    return found


def pool_containers(pool_label: str | None = None) -> list[str]:
    import docker

    client = docker.DockerClient(base_url=docker_host_from_env(), timeout=30)
    try:
        label = f"agentrl.pool={pool_label}" if pool_label else "agentrl.sandbox=1"
        return [c["Id"] for c in client.api.containers(all=True, filters={"label": label})]
    finally:
        client.close()


def eventually_empty(probe: Any, what: str, timeout_s: float = 10.0) -> None:
    """Assert ``probe()`` returns nothing, polling briefly (killed processes take a moment)."""
    deadline = time.monotonic() + timeout_s
    found = probe()
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = probe()
    assert not found, f"{what} left behind: {found}"


class SandboxBackendUnderTest:
    """One backend of the parametrized suite: opens pools and checks for leaks afterwards."""

    def __init__(self, name: str, scratch_root: Path) -> None:
        self.name = name
        self.scratch_root = scratch_root
        if name == "local":
            self.uid_range = (LOCAL_UID_BASE, LOCAL_UID_BASE + 1000)
        else:
            self.uid_range = (CONTAINER_UID_BASE, CONTAINER_UID_BASE + UID_SPAN)

    @property
    def host_sees_processes(self) -> bool:
        """Program processes are host processes (runc, local), not inside gVisor's kernel."""
        return self.name != "gvisor"

    def backend_config(self, **overrides: Any) -> Any:
        if self.name == "local":
            return LocalConfig(
                uid_base=LOCAL_UID_BASE, scratch_root=str(self.scratch_root), **overrides
            )
        common = dict(program_uid_base=CONTAINER_UID_BASE, cpus=1.0, memory_mb=512)
        common.update(overrides)
        if self.name == "docker":
            return DockerConfig(**common)
        return GVisorConfig(**common)

    def pool_config(self, backend: dict[str, Any] | None = None, **pool: Any) -> PoolConfig:
        pool.setdefault("size", 1)
        return PoolConfig(backend=self.backend_config(**(backend or {})), **pool)

    def sandbox_processes(self) -> list[str]:
        return host_processes(*self.uid_range) if self.host_sees_processes else []

    def assert_no_sandbox_processes(self, timeout_s: float = 10.0) -> None:
        """No host process of the sandbox uids (a no-op under gVisor, whose processes live in
        its own kernel: the anomaly probe and container removal cover them)."""
        eventually_empty(self.sandbox_processes, "sandbox processes", timeout_s)

    @asynccontextmanager
    async def open(
        self, backend: dict[str, Any] | None = None, **pool: Any
    ) -> AsyncIterator[SandboxPool]:
        config = self.pool_config(backend, **pool)
        try:
            async with open_sandbox_pool(config) as sandbox_pool:
                yield sandbox_pool
        except BackendUnavailable as exc:  # e.g. the local backend without root or bwrap
            _unavailable(f"the {self.name} backend is unavailable here: {exc}")
        self.assert_no_leaks(sandbox_pool._backend)

    def assert_no_leaks(self, backend: Any) -> None:
        if self.name == "local":
            left = sorted(str(p) for p in self.scratch_root.iterdir())
            assert not left, f"temp dirs left behind: {left}"
        else:
            assert not pool_containers(backend.pool_id), "containers of the pool left behind"
            eventually_empty(
                lambda: processes_mentioning(set(backend.created)), "container processes"
            )
        self.assert_no_sandbox_processes()
        # only this pool's: other pools may run beside the tests (pids/names are unique)
        if self.name == "local":
            needles = {getattr(backend, "pool_id", "")} - {""}
        else:
            needles = set(backend.created)
        eventually_empty(lambda: cgroups_named(needles), "cgroups")


BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("docker", id="docker", marks=pytest.mark.docker),
    pytest.param("gvisor", id="gvisor", marks=pytest.mark.docker),
]


@pytest.fixture(params=BACKENDS)
def sandbox_backend(request: pytest.FixtureRequest) -> Iterator[SandboxBackendUnderTest]:
    yield from _backend_under_test(request.param)


@pytest.fixture(params=BACKENDS[1:])
def container_backend(request: pytest.FixtureRequest) -> Iterator[SandboxBackendUnderTest]:
    """Only the container backends (docker, gvisor)."""
    yield from _backend_under_test(request.param)


def _backend_under_test(name: str) -> Iterator[SandboxBackendUnderTest]:
    if name != "local":
        require_docker("runsc" if name == "gvisor" else None)
    scratch = Path(tempfile.mkdtemp(prefix=f"agentrl-test-{name}-"))
    scratch.chmod(0o755)
    try:
        yield SandboxBackendUnderTest(name, scratch)
    finally:
        try:
            scratch.rmdir()
        except OSError:
            pass  # the leak check reports what is left


@pytest.fixture
async def backend_pool(sandbox_backend: SandboxBackendUnderTest) -> AsyncIterator[SandboxPool]:
    """An open pool (size 2) of each backend; leak-checked after it closes."""
    async with sandbox_backend.open(size=2) as pool:
        yield pool
