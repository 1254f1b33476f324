"""Worker processes for tools declared ``@agentrl.tool(isolation="process")``.

A thread cannot be stopped and a tool that holds the GIL freezes the event loop; a process can
be killed. Each call takes an idle worker (or starts one: a fresh interpreter running
``_tool_worker.py`` with this process's ``sys.path``), makes sure the tool's module is imported
there (not part of the deadline), then sends the function and its arguments (pickled) and waits
for the result under the deadline. A worker past its deadline is killed and never reused; the
next call starts a fresh one. Each worker leads its own process group, and the kill reaches
the whole group (processes the tool started included). At most ``size`` calls run at once; the
rest wait for a worker (also not part of the deadline).
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

WORKER = Path(__file__).with_name("_tool_worker.py")
SETUP_TIMEOUT_S = 60.0
"""Starting a worker and importing a tool's module there (outside the tool's deadline)."""


class WorkerTimeout(Exception):
    """The call ran past its deadline: its worker was killed."""


class WorkerFailed(Exception):
    """The worker could not run the call (it died, or could not start or import the tool)."""


class ToolException(Exception):
    """The tool raised in its worker: ``type_name`` and ``message`` of that exception."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


class _Worker:
    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.imported: set[str] = set()

    async def send(self, message: object) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        assert self.process.stdin is not None
        await self.process.stdin.send(struct.pack(">I", len(data)) + data)

    async def receive(self) -> tuple[Any, ...]:
        head = await self._exactly(4)
        (size,) = struct.unpack(">I", head)
        return pickle.loads(await self._exactly(size))

    async def _exactly(self, size: int) -> bytes:
        assert self.process.stdout is not None
        data = b""
        while len(data) < size:
            try:
                data += await self.process.stdout.receive(size - len(data))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                code = await self.process.wait()
                raise WorkerFailed(f"the tool's worker process exited (code {code})") from None
        return data

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            await self.process.wait()
            await self.process.aclose()


class ToolProcesses:
    """A pool of worker processes (at most ``size`` calls at once), owned by one event loop."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._limiter = anyio.CapacityLimiter(size)
        self._idle: list[_Worker] = []
        self.killed = 0
        """Workers killed at a deadline (or after a failure)."""

    async def _start(self) -> _Worker:
        process = await anyio.open_process(
            [sys.executable, "-P", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            start_new_session=True,  # its own process group: a kill reaches what it started
        )
        worker = _Worker(process)
        try:
            await worker.send(list(sys.path))
        except BaseException:
            await worker.kill()
            raise
        return worker

    async def call(
        self, fn: Callable[..., Any], kwargs: dict[str, Any], *, timeout_s: float
    ) -> Any:
        """``fn(**kwargs)`` in a worker; ``WorkerTimeout`` past ``timeout_s``, ``ToolException``
        when the tool raised, ``WorkerFailed`` when the worker could not run it."""
        try:
            pickle.dumps((fn, kwargs))
        except Exception as exc:
            raise WorkerFailed(f"the tool or its arguments cannot be pickled: {exc}") from None
        async with self._limiter:
            worker = self._idle.pop() if self._idle else None
            reuse = False
            try:
                with anyio.fail_after(SETUP_TIMEOUT_S):
                    if worker is None:
                        worker = await self._start()
                    module = getattr(fn, "__module__", None)
                    if module and module not in worker.imported:
                        await worker.send(("import", module))
                        reply = await worker.receive()
                        if reply[0] != "ok":
                            raise WorkerFailed(f"cannot import {module!r}: {reply[1]}: {reply[2]}")
                        worker.imported.add(module)
                with anyio.move_on_after(timeout_s) as scope:
                    await worker.send(("call", fn, kwargs))
                    reply = await worker.receive()
                if scope.cancelled_caught:
                    raise WorkerTimeout()
                reuse = True
            except TimeoutError:
                raise WorkerFailed(
                    f"the worker did not start within {SETUP_TIMEOUT_S:g} s"
                ) from None
            finally:
                if worker is not None:
                    if reuse:
                        self._idle.append(worker)
                    else:  # past its deadline, failed, or the caller was cancelled mid-call
                        self.killed += 1
                        await worker.kill()
        if reply[0] == "error":
            raise ToolException(reply[1], reply[2])
        return reply[1]

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for worker in idle:
            await worker.kill()


@asynccontextmanager
async def open_tool_processes(size: int) -> AsyncIterator[ToolProcesses]:
    """A ``ToolProcesses`` whose workers are killed when the block ends."""
    pool = ToolProcesses(size)
    try:
        yield pool
    finally:
        with anyio.CancelScope(shield=True):
            await pool.aclose()
