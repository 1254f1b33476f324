"""Helpers for tests about the event loop and rollouts: a heartbeat that measures how long the
loop was frozen, and a rollout context on calc-v0 for scripted engines."""

from __future__ import annotations

import time
from typing import Any

import anyio

import agentrl
from agentrl._rollout import RolloutContext


async def heartbeat(gaps: list[float], stop: anyio.Event) -> None:
    """Append the time between 10 ms ticks to ``gaps`` until ``stop``: a gap much above 10 ms
    is a loop that something kept from running."""
    last = time.perf_counter()
    while not stop.is_set():
        await anyio.sleep(0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def calc_context(fmt: Any, engine: Any, **cfg: Any) -> RolloutContext:
    """A calc-v0 rollout context on ``engine`` with the format ``fmt``."""
    return RolloutContext(
        spec=agentrl.spec("calc-v0"),
        engine=engine,
        fmt=fmt,
        config=agentrl.RolloutConfig(**cfg),
        tokenizer_fingerprint="test",
        model_name="scripted",
    )


async def wait_abandoned_at_most(n: int, timeout_s: float = 15.0) -> None:
    """Wait until at most ``n`` abandoned tool/hook threads still run in this process (earlier
    tests' threads end once their envs close): a test that counts them starts from a known
    number."""
    from agentrl._threads import abandoned_threads

    with anyio.fail_after(timeout_s):
        while abandoned_threads() > n:
            await anyio.sleep(0.01)
