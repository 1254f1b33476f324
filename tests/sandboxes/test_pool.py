"""The pool's own logic: admission queue, PoolBusy, recycling, cancellation, shutdown.

The pool is backend-agnostic; these tests drive it with an in-process backend whose sandboxes
run until the test releases them, so queue order, timeouts and cancellation races can be
asserted exactly (the real backends are exercised by test_docker.py and test_adversarial.py).
Both anyio backends: the pool runs under trio in rollouts and under asyncio in the service.
"""

from __future__ import annotations

import itertools

import anyio
import pytest
from pydantic import ValidationError

from agentrl.sandboxes import (
    DockerConfig,
    GVisorConfig,
    LocalConfig,
    PoolBusy,
    PoolConfig,
    SandboxError,
    SandboxPool,
)
from agentrl.sandboxes import _pool as pool_module
from agentrl.sandboxes._backend import Guarantee
from agentrl.sandboxes._types import InvalidRequest, RunRequest, RunResult

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]


class GateSandbox:
    """Runs ``code`` as a tiny command language: "ok", "hold" (until released), "dirty", "raise"."""

    def __init__(self, backend: GateBackend, number: int) -> None:
        self.id = f"gate-{number}"
        self.runs = 0
        self.backend = backend
        self.clean = True

    async def exec(self, request: RunRequest) -> RunResult:
        self.runs += 1
        self.backend.started.append(request.code)
        if request.code.startswith("hold"):
            await self.backend.release.wait()
        if request.code == "raise":
            raise RuntimeError("sandbox broke")
        if request.code == "dirty":
            self.clean = False
        return RunResult(status="ok", stdout=request.code, backend="gate", sandbox_id=self.id)

    async def is_clean(self) -> bool:
        return self.clean


class GateBackend:
    name = "gate"

    def __init__(self) -> None:
        self.numbers = itertools.count()
        self.live: set[str] = set()
        self.started: list[str] = []
        self.release = anyio.Event()
        self.fail_creates = 0
        self.closed = False

    async def start(self) -> None:
        pass

    async def create(self) -> GateSandbox:
        await anyio.sleep(0)
        if self.fail_creates:
            self.fail_creates -= 1
            raise SandboxError("create failed")
        sandbox = GateSandbox(self, next(self.numbers))
        self.live.add(sandbox.id)
        return sandbox

    async def destroy(self, sandbox: GateSandbox) -> None:
        self.live.discard(sandbox.id)

    def guarantees(self) -> list[Guarantee]:
        return [Guarantee("nothing", False, "an in-process test backend")]

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> GateBackend:
    backend = GateBackend()
    monkeypatch.setattr(pool_module, "make_backend", lambda config: backend)
    return backend


def req(code: str = "ok", **kw) -> RunRequest:
    return RunRequest(language="python", code=code, **kw)


async def wait_until(predicate) -> None:
    with anyio.fail_after(5):
        while not predicate():
            await anyio.sleep(0.001)


async def test_runs_and_counts(gate):
    async with pool_module.open_sandbox_pool({"size": 2}) as pool:
        result = await pool.run(req("hello"))
        assert result.status == "ok" and result.stdout == "hello"
        stats = pool.statistics()
        assert (stats.backend, stats.idle, stats.in_use, stats.execs) == ("gate", 2, 0, 1)
        assert stats.created == 2 and stats.failures == {}
        assert pool.backend_name == "gate"
        assert pool.guarantees()[0].name == "nothing"
    assert gate.live == set() and gate.closed


async def test_invalid_request_raises_and_touches_no_sandbox(gate):
    async with pool_module.open_sandbox_pool({"size": 1}) as pool:
        with pytest.raises(InvalidRequest, match=r"timeout_s: must be in \(0, 120\], got 0"):
            await pool.run(req(timeout_s=0))
        with pytest.raises(InvalidRequest, match=r"files\['\.\./x'\]"):
            await pool.run(req(files={"../x": ""}))
        assert gate.started == []
        assert pool.statistics().failures == {} and pool.statistics().execs == 0


async def test_full_queue_raises_pool_busy_at_once(gate):
    async with pool_module.open_sandbox_pool({"size": 1, "max_queue": 1}) as pool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, req("hold-1"))
            await wait_until(lambda: pool.statistics().in_use == 1)
            tg.start_soon(pool.run, req("hold-2"))
            await wait_until(lambda: pool.statistics().queued == 1)
            with pytest.raises(PoolBusy) as busy:
                await pool.run(req("third"))
            assert busy.value.retry_after_s > 0
            gate.release.set()
        assert gate.started == ["hold-1", "hold-2"]
        assert pool.statistics().queued == 0


async def test_queue_timeout_raises_pool_busy(gate):
    async with pool_module.open_sandbox_pool({"size": 1, "queue_timeout_s": 0.05}) as pool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, req("hold"))
            await wait_until(lambda: pool.statistics().in_use == 1)
            with pytest.raises(PoolBusy, match="queue_timeout_s"):
                await pool.run(req("waits"))
            gate.release.set()
        assert pool.statistics().queued == 0 and pool.statistics().idle == 1


async def test_waiters_are_served_in_order(gate):
    async with pool_module.open_sandbox_pool({"size": 1}) as pool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, req("hold"))
            await wait_until(lambda: pool.statistics().in_use == 1)
            for i in range(5):
                tg.start_soon(pool.run, req(f"w{i}"))
                await wait_until(lambda i=i: pool.statistics().queued == i + 1)
            gate.release.set()
        assert gate.started == ["hold", "w0", "w1", "w2", "w3", "w4"]


async def test_recycle_after_n_execs(gate):
    async with pool_module.open_sandbox_pool({"size": 1, "recycle_after": 2}) as pool:
        ids = [(await pool.run(req())).sandbox_id for _ in range(5)]
        await wait_until(lambda: pool.statistics().idle == 1)
        assert ids[0] == ids[1] != ids[2] == ids[3] != ids[4]
        stats = pool.statistics()
        assert stats.recycles == 2 and stats.destroyed == 2 and stats.created == 3
        assert len(gate.live) == 1


async def test_anomaly_and_sandbox_error_recycle(gate):
    async with pool_module.open_sandbox_pool({"size": 1}) as pool:
        first = await pool.run(req("dirty"))
        second = await pool.run(req("raise"))
        assert second.status == "sandbox_error" and "sandbox broke" in (second.error or "")
        third = await pool.run(req())
        assert len({first.sandbox_id, second.sandbox_id, third.sandbox_id}) == 3
        stats = pool.statistics()
        assert stats.recycles == 2 and stats.failures == {"sandbox_error": 1}


async def test_cancelled_run_recycles_its_sandbox(gate):
    async with pool_module.open_sandbox_pool({"size": 1}) as pool:
        with anyio.move_on_after(0.05):
            await pool.run(req("hold"))
        await wait_until(lambda: pool.statistics().idle == 1)
        assert pool.statistics().recycles == 1 and len(gate.live) == 1
        assert (await pool.run(req("after"))).status == "ok"


async def test_cancelled_waiter_loses_no_sandbox(gate):
    async with pool_module.open_sandbox_pool({"size": 1}) as pool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, req("hold"))
            await wait_until(lambda: pool.statistics().in_use == 1)
            with anyio.move_on_after(0.02):
                await pool.run(req("never"))
            gate.release.set()
        assert pool.statistics().idle == 1 and pool.statistics().queued == 0
        assert "never" not in gate.started


async def test_failed_replacement_is_retried(gate):
    async with pool_module.open_sandbox_pool({"size": 1, "recycle_after": 1}) as pool:
        gate.fail_creates = 2
        await pool.run(req())
        await wait_until(lambda: pool.statistics().idle == 1)
        assert pool.statistics().create_failures == 2
        assert (await pool.run(req())).status == "ok"


async def test_failing_initial_fill_raises_the_error(gate):
    gate.fail_creates = 1
    with pytest.raises(SandboxError, match="create failed"):
        async with pool_module.open_sandbox_pool({"size": 3}):
            pass
    assert gate.live == set() and gate.closed


async def test_body_errors_are_not_wrapped(gate):
    with pytest.raises(KeyError):
        async with pool_module.open_sandbox_pool({"size": 1}):
            raise KeyError("mine")
    assert gate.live == set()


async def test_shutdown_wakes_waiters_and_destroys_everything(gate):
    busy: list[PoolBusy] = []

    async def waiter(pool: SandboxPool) -> None:
        try:
            await pool.run(req("late"))
        except PoolBusy as exc:
            busy.append(exc)

    async with anyio.create_task_group() as tg:
        async with pool_module.open_sandbox_pool({"size": 2}) as pool:
            tg.start_soon(pool.run, req("hold-a"))
            tg.start_soon(pool.run, req("hold-b"))
            await wait_until(lambda: pool.statistics().in_use == 2)
            tg.start_soon(waiter, pool)
            await wait_until(lambda: pool.statistics().queued == 1)
        assert gate.live == set() and gate.closed
        assert len(busy) == 1
        gate.release.set()


async def test_run_batch_keeps_order_and_per_item_status(gate):
    async with pool_module.open_sandbox_pool({"size": 2}) as pool:
        results = await pool.run_batch(
            [req("a"), req("b", memory_mb=1), req("raise"), req("d"), req("e")]
        )
        assert [r.status for r in results] == [
            "ok",
            "invalid_request",
            "sandbox_error",
            "ok",
            "ok",
        ]
        assert results[0].stdout == "a" and results[4].stdout == "e"
        assert await pool.run_batch([]) == []


async def test_run_batch_when_full_raises_pool_busy(gate):
    async with pool_module.open_sandbox_pool({"size": 1, "max_queue": 0}) as pool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, req("hold"))
            await wait_until(lambda: pool.statistics().in_use == 1)
            with pytest.raises(PoolBusy):
                await pool.run_batch([req("x")])
            gate.release.set()


def test_configs_are_discriminated_and_strict():
    config = PoolConfig.model_validate({"backend": {"type": "gvisor", "cpus": 0.5}, "size": 3})
    assert isinstance(config.backend, GVisorConfig) and config.backend.runtime == "runsc"
    assert isinstance(
        PoolConfig.model_validate({"backend": {"type": "docker"}}).backend, DockerConfig
    )
    assert isinstance(PoolConfig().backend, LocalConfig)
    with pytest.raises(ValidationError):
        PoolConfig.model_validate({"backend": {"type": "docker", "imagee": "x"}})
    with pytest.raises(ValidationError):
        PoolConfig.model_validate({"backend": {"type": "firecracker"}})
    with pytest.raises(ValidationError):
        PoolConfig(size=0)
