"""What the sandbox service's handlers share: the pool, its limits, the byte budget, the
connection guard and the service's own counters (``STATE`` on the aiohttp app)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from aiohttp import web

from ._budget import ByteBudget, Reservation
from ._config import ServiceConfig
from ._connections import ConnectionGuard
from ._metrics import Histogram
from ._pool import SandboxPool


class ServiceState:
    """What the handlers share: the pool, the limits, the budget and the service's metrics."""

    def __init__(
        self,
        pool: SandboxPool,
        token: str | None,
        config: ServiceConfig,
        guard: ConnectionGuard | None,
    ) -> None:
        self.pool = pool
        self.token = token.encode() if token else None
        self.config = config
        self.guard = guard
        self.budget = ByteBudget(config.max_inflight_bytes)
        self.http_requests: Counter[tuple[str, int]] = Counter()
        self.results: Counter[str] = Counter()
        self.busy_rejections = 0
        self.body_timeouts = 0
        self.send_timeouts = 0
        self.exec_seconds = Histogram()
        self.request_seconds = Histogram()
        self.started = time.time()
        self.reservations: dict[int, Reservation] = {}
        """What each request being handled holds of the budget (by ``id(request)``)."""
        self.handlers: set[asyncio.Task[Any]] = set()
        """The tasks handling a request now (a stop waits for them, then cancels them)."""

    def reservation(self, request: web.Request) -> Reservation:
        return self.reservations[id(request)]


STATE = web.AppKey("agentrl_sandbox_state", ServiceState)
