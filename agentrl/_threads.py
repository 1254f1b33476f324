"""Blocking code (sync tools, sync environment hooks) in daemon threads, with a deadline.

Python cannot stop a thread. A call past its deadline is *abandoned*: the caller goes on at the
deadline, the thread runs on in the background until its function returns, and it never keeps
the process from exiting (anyio's own worker threads are not daemons: a function that never
returned held the process at exit on asyncio). Abandoned threads still running are counted per
process (``abandoned_threads()``); past a caller's cap new calls are refused with a clear error
instead of piling up threads that silently slow everything else down.

The deadline measures the function's own running time: waiting for a slot of the caller's
``CapacityLimiter`` is not part of it, and an abandoned call gives its slot back at its deadline.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from ._errors import AgentRLError

_lock = threading.Lock()
_abandoned = 0


def abandoned_threads() -> int:
    """Threads of this process whose caller gave up on them and that are still running."""
    return _abandoned


class ThreadTimeout(Exception):
    """The function did not return within its deadline (its thread was abandoned)."""


class TooManyAbandonedThreads(AgentRLError):
    """New blocking calls are refused: too many abandoned threads are still running."""


class _Call:
    __slots__ = ("abandoned", "finished")

    def __init__(self) -> None:
        self.finished = False
        self.abandoned = False


def _abandon(call: _Call) -> None:
    global _abandoned
    with _lock:
        if not call.finished and not call.abandoned:
            call.abandoned = True
            _abandoned += 1


def _finish(call: _Call) -> None:
    global _abandoned
    with _lock:
        call.finished = True
        if call.abandoned:
            _abandoned -= 1


async def run_in_daemon_thread(
    fn: Callable[[], Any],
    *,
    name: str,
    timeout_s: float,
    limiter: anyio.CapacityLimiter | None = None,
    max_abandoned: int | None = None,
    cap_setting: str = "max_abandoned_threads",
) -> Any:
    """``fn()`` in a new daemon thread; raise ``ThreadTimeout`` when it runs past ``timeout_s``
    (counted from the thread's start: a wait for ``limiter`` is not), ``TooManyAbandonedThreads``
    when ``max_abandoned`` abandoned threads still run, or whatever ``fn`` raised. Cancelling
    the caller abandons the thread too."""
    if max_abandoned is not None and _abandoned >= max_abandoned:
        raise TooManyAbandonedThreads(
            f"{_abandoned} abandoned threads are still running ({cap_setting} = {max_abandoned}):"
            f" blocking calls past their deadline that Python cannot stop; refusing {name!r} "
            "until they end (make the code return within its deadline, or run it in a worker "
            "process: @agentrl.tool(isolation='process'))"
        )
    limiter = limiter or anyio.to_thread.current_default_thread_limiter()
    async with limiter:
        done = anyio.Event()
        outcome: dict[str, Any] = {}
        call = _Call()
        token = anyio.lowlevel.current_token()
        context = contextvars.copy_context()

        def target() -> None:
            try:
                outcome["value"] = context.run(fn)
            except BaseException as exc:  # delivered to the caller (SystemExit included)
                outcome["error"] = exc
            finally:
                _finish(call)
            try:
                anyio.from_thread.run_sync(done.set, token=token)
            except Exception:  # the event loop is gone: nobody waits for this call any more
                pass

        threading.Thread(target=target, name=f"agentrl {name}", daemon=True).start()
        try:
            with anyio.move_on_after(timeout_s) as scope:
                await done.wait()
        finally:
            if not done.is_set():
                _abandon(call)  # past the deadline or cancelled: the slot is given back now
    if scope.cancelled_caught:
        raise ThreadTimeout(name)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
