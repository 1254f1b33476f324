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
