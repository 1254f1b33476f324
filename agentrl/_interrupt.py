"""Ctrl-C for long-running commands (``agentrl rollout``, ``agentrl train``).

The first SIGINT sets a ``stop`` event the work watches: it winds down at its next safe point
and returns what it finished. A second SIGINT aborts at once (``KeyboardInterrupt``). Because
the signal is received by a task (not raised wherever the main thread happens to be), it never
lands in the middle of a file write or a checkpoint.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def run_until_interrupted(
    work: Callable[[anyio.Event], Awaitable[T]],
    *,
    on_interrupt: Callable[[], None] | None = None,
    enabled: bool = True,
) -> tuple[T, bool]:
    """``(work(stop)'s result, whether SIGINT set stop)``. ``on_interrupt`` runs on the first
    SIGINT (e.g. to say what happens now). Exceptions of ``work`` propagate unchanged. Without
    ``enabled`` (or off the main thread, where signals cannot be received) SIGINT keeps its
    default behaviour."""
    stop = anyio.Event()
    if not enabled or threading.current_thread() is not threading.main_thread():
        return await work(stop), False
    outcome: dict[str, Any] = {}

    async def watch() -> None:
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                if stop.is_set():
                    raise KeyboardInterrupt
                stop.set()
                if on_interrupt is not None:
                    on_interrupt()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            outcome["value"] = await work(stop)
        except Exception as exc:  # re-raised below, outside the task group (not as a group)
            outcome["error"] = exc
        finally:
            tg.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"], stop.is_set()


def is_interrupt(exc: BaseException) -> bool:
    """A ``KeyboardInterrupt``, alone or inside exception groups (with cancellations)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(KeyboardInterrupt) is not None
    return False
