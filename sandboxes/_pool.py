"""The sandbox pool: warm sandboxes behind a bounded admission queue (backend-agnostic).

``open_sandbox_pool(config)`` starts a backend, creates ``size`` warm sandboxes and yields a
``SandboxPool``. Each ``run`` validates the request, leases an idle sandbox (waiting in a FIFO
queue of at most ``max_queue`` requests for at most ``queue_timeout_s``, else ``PoolBusy``), runs
exactly one exec, and gives the sandbox back, or recycles it after ``recycle_after`` execs, after
any anomaly the backend reports, after a ``sandbox_error`` and after a cancelled run. A recycled
sandbox is destroyed and replaced in the background, so the pool keeps ``size`` sandboxes.

Leaving the context destroys every sandbox and lets the backend remove anything else it made.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from ._backend import Backend, Guarantee, Sandbox
from ._config import BackendConfig, DockerConfig, GVisorConfig, LocalConfig, PoolConfig
from ._errors import PoolBusy
from ._types import InvalidRequest, RunRequest, RunResult
from ._validate import RequestLimits, request_limits, validate_request

_log = logging.getLogger(__name__)
_CREATE_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class PoolStatistics(msgspec.Struct):
    """Counters of one pool (``SandboxPool.statistics()``; the service exports them)."""

    backend: str
    in_use: int
    """Sandboxes running a request now."""
    idle: int
    """Warm sandboxes ready for the next request."""
    queued: int
    """Requests waiting for a sandbox."""
    execs: int
    """Requests that ran (any status but ``invalid_request``)."""
    recycles: int
    """Sandboxes replaced (after ``recycle_after`` execs, an anomaly, or a sandbox failure)."""
    created: int
    destroyed: int
    failures: dict[str, int]
    """Results by status, for every status but ``ok``."""
    creating: int = 0
    """Sandboxes being created (replacements in the background)."""
    create_failures: int = 0
    """Creates that failed (retried with backoff)."""


class _Waiter:
    __slots__ = ("event", "sandbox")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.sandbox: Sandbox | None = None


class SandboxPool:
    """Leases warm sandboxes to requests. Made by ``open_sandbox_pool``; safe to share between
    tasks of one event loop."""

    def __init__(self, config: PoolConfig, backend: Backend) -> None:
        self._config = config
        self._backend = backend
        self._limits = request_limits(config.backend)
        self._tg: TaskGroup | None = None  # background replacements; set by open_sandbox_pool
        self._idle: deque[Sandbox] = deque()
        self._waiters: deque[_Waiter] = deque()
        self._live: dict[str, Sandbox] = {}  # every sandbox not yet destroyed
        self._runs: dict[str, int] = {}
        self._in_use = 0
        self._creating = 0
        self._closing = False
        self._execs = 0
        self._recycles = 0
        self._created = 0
        self._destroyed = 0
        self._create_failures = 0
        self._failures: dict[str, int] = {}
        self._recent_wall: deque[float] = deque(maxlen=64)

    # -- public API ------------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def config(self) -> PoolConfig:
        return self._config

    def guarantees(self) -> list[Guarantee]:
        """What containment this host gives the backend (see ``Guarantee``)."""
        return self._backend.guarantees()

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            backend=self._backend.name,
            in_use=self._in_use,
            idle=len(self._idle),
            queued=len(self._waiters),
            execs=self._execs,
            recycles=self._recycles,
            created=self._created,
            destroyed=self._destroyed,
            failures=dict(self._failures),
            creating=self._creating,
            create_failures=self._create_failures,
        )

    @property
    def request_limits(self) -> RequestLimits:
        """What this pool's backend can give a request (checked by ``validate_request``)."""
        return self._limits

    async def run(self, request: RunRequest) -> RunResult:
        """Run one request. Raises ``InvalidRequest`` (naming the field and value) for a request
        that breaks a rule: nothing ran, no sandbox was touched; ``PoolBusy`` when over capacity
        (nothing ran). What the program does comes back as the result's status."""
        validate_request(request, self._limits)
        return await self._run_valid(request)

    async def _run_valid(self, request: RunRequest) -> RunResult:
        sandbox = await self._acquire()
        return await self._run_on(sandbox, request)

    async def run_batch(self, requests: list[RunRequest]) -> list[RunResult]:
        """Run requests concurrently (at most ``size`` at once); results in request order.

        An item that breaks a rule comes back as ``status="invalid_request"`` (the field named
        in ``error``) without running; the others run. Raises ``PoolBusy`` (nothing ran) when
        not even one request can be admitted now; an item that later cannot get a sandbox in
        time comes back as ``sandbox_error`` ("pool busy")."""
        results: list[RunResult | None] = [None] * len(requests)
        valid: list[int] = []
        for i, request in enumerate(requests):
            try:
                validate_request(request, self._limits)
            except InvalidRequest as exc:
                results[i] = self._count(
                    RunResult(status="invalid_request", error=str(exc), backend=self.backend_name)
                )
            else:
                valid.append(i)
        if not valid:
            return [r for r in results if r is not None]
        if not self._idle and len(self._waiters) >= self._config.max_queue:
            raise PoolBusy(self._busy_message(), self._retry_after())
        limit = anyio.Semaphore(self._config.size)

        async def one(i: int, request: RunRequest) -> None:
            async with limit:
                try:
                    results[i] = await self._run_valid(request)
                except PoolBusy as exc:
                    results[i] = self._count(
                        RunResult(
                            status="sandbox_error",
                            error=f"pool busy: {exc}",
                            backend=self.backend_name,
                        )
                    )

        async with anyio.create_task_group() as tg:
            for i in valid:
                tg.start_soon(one, i, requests[i])
        return [r for r in results if r is not None]

    # -- leasing ---------------------------------------------------------------------------------
    def _busy_message(self) -> str:
        return (
            f"{self._in_use} of {self._config.size} sandboxes busy and "
            f"{len(self._waiters)} requests queued (max_queue={self._config.max_queue})"
        )

    def _retry_after(self) -> float:
        wall = sorted(self._recent_wall)[len(self._recent_wall) // 2] if self._recent_wall else 1.0
        waves = (len(self._waiters) + 1) / self._config.size
        return float(min(max(math.ceil(wall * waves * 10) / 10, 0.1), 60.0))

    async def _acquire(self) -> Sandbox:
        if self._closing:
            raise PoolBusy("the pool is shutting down", 1.0)
        if self._idle:
            sandbox = self._idle.popleft()
        else:
            if len(self._waiters) >= self._config.max_queue:
                raise PoolBusy(self._busy_message(), self._retry_after())
            waiter = _Waiter()
            self._waiters.append(waiter)
            try:
                with anyio.move_on_after(self._config.queue_timeout_s):
                    await waiter.event.wait()
            except BaseException:
                if waiter.sandbox is not None:  # handed over just as we were cancelled
                    self._give_back(waiter.sandbox)
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if waiter.sandbox is None:
                raise PoolBusy(
                    f"no sandbox within queue_timeout_s={self._config.queue_timeout_s}",
                    self._retry_after(),
                )
            sandbox = waiter.sandbox
        self._in_use += 1
        return sandbox

    def _give_back(self, sandbox: Sandbox) -> None:
        """Hand an idle sandbox to the longest-waiting request, or park it."""
        if self._closing:
            return  # still in self._live: _shutdown destroys it (or already has)
        if self._waiters:  # every waiter still in the deque is waiting (cancelled ones leave)
            waiter = self._waiters.popleft()
            waiter.sandbox = sandbox
            waiter.event.set()
        else:
            self._idle.append(sandbox)

    async def _run_on(self, sandbox: Sandbox, request: RunRequest) -> RunResult:
        recycle = True
        try:
            start = time.monotonic()
            try:
                result = await sandbox.exec(request)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:  # the sandbox failed, not the program
                result = RunResult(
                    status="sandbox_error",
                    error=f"{type(exc).__name__}: {exc}",
                    backend=self.backend_name,
                    sandbox_id=sandbox.id,
                )
            self._recent_wall.append(time.monotonic() - start)
            self._execs += 1
            runs = self._runs.get(sandbox.id, 0) + 1
            self._runs[sandbox.id] = runs
            if result.status != "sandbox_error" and runs < self._config.recycle_after:
                try:
                    recycle = not await sandbox.is_clean()
                except Exception:
                    recycle = True
            return self._count(result)
        finally:
            self._in_use -= 1
            if self._closing:
                pass  # _shutdown destroys every live sandbox
            elif recycle:
                self._recycles += 1
                self._background(self._replace, sandbox)
            else:
                self._give_back(sandbox)

    def _background(self, fn: Any, *args: Any) -> None:
        if self._tg is None:
            raise RuntimeError("the pool is not open (use open_sandbox_pool)")
        self._tg.start_soon(fn, *args)

    def _count(self, result: RunResult) -> RunResult:
        if result.status != "ok":
            self._failures[result.status] = self._failures.get(result.status, 0) + 1
        return result

    # -- life cycle ------------------------------------------------------------------------------
    async def _create(self) -> Sandbox:
        self._creating += 1
        try:
            sandbox = await self._backend.create()
        except BaseException:
            self._create_failures += 1
            raise
        finally:
            self._creating -= 1
        self._created += 1
        self._live[sandbox.id] = sandbox
        return sandbox

    async def _destroy(self, sandbox: Sandbox) -> None:
        """Destroy one sandbox (shielded); a failure is logged, never raised: the backend's
        ``aclose`` removes whatever is left at the end."""
        if self._live.pop(sandbox.id, None) is None:
            return
        self._runs.pop(sandbox.id, None)
        with anyio.CancelScope(shield=True):
            try:
                await self._backend.destroy(sandbox)
            except Exception:
                _log.warning("destroying sandbox %s failed", sandbox.id, exc_info=True)
            finally:
                self._destroyed += 1

    async def _replace(self, sandbox: Sandbox) -> None:
        """Destroy and create at once: removing a wrecked container can be slow."""
        self._background(self._destroy, sandbox)
        await self._add_one()

    async def _add_one(self) -> None:
        """Create one sandbox (retrying with backoff) and make it available."""
        attempt = 0
        while not self._closing:
            try:
                sandbox = await self._create()
            except Exception:
                _log.warning("creating a %s sandbox failed", self.backend_name, exc_info=True)
                delay = _CREATE_BACKOFF_S[min(attempt, len(_CREATE_BACKOFF_S) - 1)]
                attempt += 1
                await anyio.sleep(delay)
                continue
            if self._closing:
                await self._destroy(sandbox)
            else:
                self._give_back(sandbox)
            return

    async def _fill(self) -> None:
        """Create the initial ``size`` sandboxes concurrently; raise the first failure."""
        errors: list[Exception] = []

        async def one() -> None:
            try:
                self._idle.append(await self._create())
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(self._config.size):
                tg.start_soon(one)
        if errors:
            raise errors[0]

    async def _destroy_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for sandbox in list(self._live.values()):
                tg.start_soon(self._destroy, sandbox)
        self._idle.clear()

    async def _shutdown(self) -> None:
        self._closing = True
        for waiter in list(self._waiters):
            waiter.event.set()  # wakes with no sandbox → PoolBusy
        if self._tg is not None:
            self._tg.cancel_scope.cancel()  # background creates and replacements
        with anyio.CancelScope(shield=True):
            await self._destroy_all()


def make_backend(config: BackendConfig) -> Backend:
    """The backend for a config (imports only the module that backend needs)."""
    match config:
        case DockerConfig() | GVisorConfig():
            from ._docker import ContainerBackend

            return ContainerBackend(config)
        case LocalConfig():
            from ._local import LocalBackend

            return LocalBackend(config)
    raise TypeError(f"unknown backend config {config!r}")


@asynccontextmanager
async def open_sandbox_pool(
    config: PoolConfig | dict[str, Any] | None = None,
) -> AsyncIterator[SandboxPool]:
    """Start a backend, fill the pool with warm sandboxes and yield it; on exit destroy every
    sandbox and let the backend remove whatever else it made (containers, temp dirs).

    Raises ``BackendUnavailable`` (host cannot give the backend) or the first create error
    when the initial sandboxes cannot be made. Errors raised by the body come out unchanged
    (not wrapped in an exception group)."""
    if config is None:
        config = PoolConfig()
    elif isinstance(config, dict):
        config = PoolConfig.model_validate(config)
    backend = make_backend(config.backend)
    await backend.start()
    body_error: Exception | None = None
    try:
        pool = SandboxPool(config, backend)
        try:
            await pool._fill()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await pool._destroy_all()
            raise
        async with anyio.create_task_group() as tg:
            pool._tg = tg
            try:
                yield pool
            except Exception as exc:  # re-raised below, outside the task group
                body_error = exc
            finally:
                await pool._shutdown()
    finally:
        with anyio.CancelScope(shield=True):
            await backend.aclose()
    if body_error is not None:
        raise body_error
