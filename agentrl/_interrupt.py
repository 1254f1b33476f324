"""Ctrl-C and SIGTERM for long-running commands (``agentrl rollout``, ``agentrl train``).

The first SIGINT (Ctrl-C) or SIGTERM (what a scheduler such as Slurm or Kubernetes sends to
preempt a job, before its SIGKILL at the end of a grace period) sets a ``stop`` event the work
watches: it winds down at its next safe point and returns what it finished. A second signal
(either one) aborts at once (``KeyboardInterrupt``). Because the signal is received by a task
(not raised wherever the main thread happens to be), it never lands in the middle of a file
write or a checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop the work at its next safe point (a second one aborts)."""


def signal_name(signum: int) -> str:
    """``Ctrl-C`` for SIGINT, the signal's name (``SIGTERM``) otherwise."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


async def run_until_interrupted(
    work: Callable[[anyio.Event], Awaitable[T]],
    *,
    on_interrupt: Callable[[int], None] | None = None,
    enabled: bool = True,
    same_stop_s: float = 0.0,
) -> tuple[T, int | None]:
    """``(work(stop)'s result, the signal that set stop or None)``. ``on_interrupt(signum)``
    runs on the first signal (e.g. to say what happens now). Exceptions of ``work`` propagate
    unchanged. Without ``enabled`` (or off the main thread, where signals cannot be received)
    SIGINT and SIGTERM keep their default behaviour. A signal less than ``same_stop_s`` after
    the first is taken for the same stop, not an abort (under torchrun a scheduler that signals
    every process of the job and torchrun forwarding its own signal reach each rank twice)."""
    stop = anyio.Event()
    if not enabled or threading.current_thread() is not threading.main_thread():
        return await work(stop), None
    outcome: dict[str, Any] = {}
    received: list[int] = []
    first = 0.0

    async def watch() -> None:
        nonlocal first
        with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
            async for signum in signals:
                if stop.is_set():
                    if time.monotonic() - first < same_stop_s:
                        continue
                    raise KeyboardInterrupt
                first = time.monotonic()
                received.append(int(signum))
                stop.set()
                if on_interrupt is not None:
                    on_interrupt(int(signum))

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
    return outcome["value"], (received[0] if received else None)


def is_interrupt(exc: BaseException) -> bool:
    """A ``KeyboardInterrupt``, alone or inside exception groups (with cancellations)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(KeyboardInterrupt) is not None
    return False
