"""Where tool code runs: threads that cannot starve each other, a cap on abandoned threads,
and worker processes that are killed at the deadline."""

from __future__ import annotations

import os
import threading
import time

import anyio
import pytest
from isolated_tools import big_power, chatty, exits, fails, sleeper, worker_pid
from loop_probes import heartbeat, wait_abandoned_at_most

import agentrl
from agentrl import ToolError
from agentrl._threads import abandoned_threads
from agentrl._tool_process import open_tool_processes
from agentrl._tools import BoundTool, invoke_tool, tool_spec

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]


def _bound(*fns) -> dict[str, BoundTool]:
    return {tool_spec(f).name: BoundTool(tool_spec(f), f) for f in fns}


class _Stuck:
    """A sync tool that blocks until released, counting the calls that started."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = 0
        self.lock = threading.Lock()

        @agentrl.tool
        def stuck() -> str:
            """Blocks its thread until released."""
            with self.lock:
                self.started += 1
            self.release.wait(30)
            return "released"

        self.tool = stuck

    async def wait_started(self, n: int) -> None:
        with anyio.fail_after(10):
            while self.started < n:
                await anyio.sleep(0.01)


@agentrl.tool
def fast() -> str:
    """Returns at once."""
    return "fast"


async def test_abandoned_sync_tools_do_not_starve_a_fast_one():
    """Two stuck calls fill both thread slots; a fast call queued behind them must not time out:
    its deadline counts its own running time, and an abandoned call frees its slot at its
    deadline."""
    stuck = _Stuck()
    limiter = anyio.CapacityLimiter(2)
    tools = _bound(stuck.tool, fast)
    records = {}

    async def call(key, name, timeout_s):
        records[key] = await invoke_tool(
            tools, name, "{}", turn=0, timeout_s=timeout_s, limiter=limiter
        )

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "a", "stuck", 3.0)
                tg.start_soon(call, "b", "stuck", 3.0)
                await stuck.wait_started(2)
                # its deadline is shorter than its wait for a slot (deadlines that counted the
                # wait would end it) and long enough for a loaded machine's stalls
                tg.start_soon(call, "fast", "fast", 1.5)
    finally:
        stuck.release.set()
    assert records["a"].error_kind == records["b"].error_kind == "tool_timeout"
    assert records["fast"].ok and records["fast"].output == "fast", records["fast"]
    await wait_abandoned_at_most(0)


async def test_past_the_cap_new_sync_calls_fail_loudly():
    before = abandoned_threads()
    stuck = _Stuck()
    tools = _bound(stuck.tool, fast)
    cap = before + 2
    try:
        for _ in range(2):
            record = await invoke_tool(
                tools, "stuck", "{}", turn=0, timeout_s=0.1, max_abandoned=cap
            )
            assert record.error_kind == "tool_timeout"
        assert abandoned_threads() >= cap
        with pytest.raises(ToolError, match=rf"max_abandoned_threads = {cap}\)"):
            await invoke_tool(tools, "fast", "{}", turn=0, max_abandoned=cap)
    finally:
        stuck.release.set()
    await wait_abandoned_at_most(before)  # the threads ended: they are no longer counted
    record = await invoke_tool(tools, "fast", "{}", turn=0, max_abandoned=cap)
    assert record.ok


async def test_a_process_tool_past_its_deadline_is_killed_and_the_next_call_works():
    """``big_power`` holds the GIL for minutes in one C call: in a thread it would freeze the
    event loop past any deadline; in a worker process the loop stays responsive and the worker
    is killed at the deadline."""
    tools = _bound(worker_pid, big_power, sleeper)
    async with open_tool_processes(1) as pool:
        first = await invoke_tool(tools, "worker_pid", "{}", turn=0, processes=pool)
        assert first.ok
        pid = int(first.output)
        gaps: list[float] = []
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, gaps, stop)
            started = time.perf_counter()
            record = await invoke_tool(
                tools,
                "big_power",
                '{"exponent": 4000000000}',
                turn=0,
                timeout_s=0.5,
                processes=pool,
            )
            elapsed = time.perf_counter() - started
            stop.set()
        assert record.error_kind == "tool_timeout", record
        assert record.output == (
            "Error (tool_timeout): tool 'big_power' did not finish within 0.5 s "
            "(its worker process was killed)"
        )
        # in a thread, the call would hold the loop for minutes; the bounds leave room for stalls
        assert elapsed < 8 and max(gaps) < 3, (elapsed, max(gaps))
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped
        assert pool.killed == 1
        again = await invoke_tool(tools, "worker_pid", "{}", turn=0, processes=pool)
        assert again.ok and int(again.output) != pid  # a fresh worker
        slept = await invoke_tool(
            tools, "sleeper", '{"seconds": 60}', turn=0, timeout_s=0.3, processes=pool
        )
        assert slept.error_kind == "tool_timeout"


async def test_process_tool_errors_are_observations_and_stdio_stays_out_of_the_protocol():
    tools = _bound(fails, exits, chatty, worker_pid)
    async with open_tool_processes(2) as pool:
        record = await invoke_tool(tools, "fails", '{"reason": "x"}', turn=0, processes=pool)
        assert record.output == "Error (tool_exception): ValueError: failed: x"
        record = await invoke_tool(tools, "exits", '{"code": 3}', turn=0, processes=pool)
        assert record.error_kind == "tool_exception"
        assert "the tool's worker process exited (code 3)" in record.output
        record = await invoke_tool(tools, "chatty", "{}", turn=0, processes=pool)
        assert record.ok and record.output == "b''"
        assert (await invoke_tool(tools, "worker_pid", "{}", turn=0, processes=pool)).ok
    # without a pool, a call runs in a worker of its own
    record = await invoke_tool(tools, "fails", '{"reason": "y"}', turn=0)
    assert record.output == "Error (tool_exception): ValueError: failed: y"


def _method_tool():
    class Env:
        @agentrl.tool(isolation="process")
        def run(self) -> str:
            """A method."""
            return ""


def _closure_tool():
    @agentrl.tool(isolation="process")
    def inner() -> str:
        """A closure."""
        return ""


def _async_tool():
    @agentrl.tool(isolation="process")
    async def run() -> str:
        """Async."""
        return ""


def _bad_isolation():
    @agentrl.tool(isolation="fork")
    def run() -> str:
        """Unknown isolation."""
        return ""


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (_method_tool, "needs a module-level function"),
        (_closure_tool, "needs a module-level function"),
        (_async_tool, "is for sync functions"),
        (_bad_isolation, "isolation must be 'thread' or 'process', got 'fork'"),
    ],
)
def test_process_isolation_is_refused_where_it_cannot_work(make, match):
    with pytest.raises(ToolError, match=match):
        make()
