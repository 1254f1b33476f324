"""The backend interface: what the pool needs from docker, gvisor and local backends.

A backend makes *sandboxes* (a warm container, or a local bubblewrap slot); the pool leases them
to requests, runs one request per exec, and recycles them. All methods are async (anyio: the
pool runs under trio in a rollout process and under asyncio in the service); blocking calls go to
worker threads under an explicit ``anyio.CapacityLimiter``.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from ._types import RunRequest, RunResult


class Guarantee(msgspec.Struct):
    """One containment property and whether this host gives it to the backend."""

    name: str
    """e.g. network_isolation, memory_limit, pids_limit, cpu_limit, readonly_root, user_ns."""
    available: bool
    detail: str = ""
    """How it is enforced, or why it is not."""


class Sandbox(Protocol):
    """One warm slot. ``exec`` runs exactly one request in a fresh scratch dir."""

    id: str
    runs: int

    async def exec(self, request: RunRequest) -> RunResult: ...

    async def is_clean(self) -> bool:
        """False after an anomaly (leftover processes, changed files): the pool recycles."""
        ...


class Backend(Protocol):
    name: str

    async def start(self) -> None:
        """Check the host, reap orphans left by earlier runs (labelled), prepare images."""
        ...

    async def create(self) -> Sandbox: ...

    async def destroy(self, sandbox: Sandbox) -> None:
        """Remove the sandbox and everything it made; never raises for an already-dead one."""
        ...

    def guarantees(self) -> list[Guarantee]: ...

    async def aclose(self) -> None: ...
