"""Whether the served model can generate: what ``/health`` and ``/health_generate`` answer.

SGLang's ``/health`` and ``/health_generate`` both push a one-token request through the model and
answer 503 when nothing comes back. ``agentrl serve`` does the same, so a model that cannot
generate (its worker crashed, or weights that passed every check still produce NaN logits) is
never reported healthy:

- ``/health_generate`` always runs the probe: one greedy token from the BOS token, which must
  come back with a finite logprob within ``timeout_s``.
- ``/health`` reuses a passing probe for ``fresh_s`` seconds, so frequent polling (a router, a
  load balancer) costs at most one token per ``fresh_s``; a weight update or a failed
  ``/generate`` forgets it.
"""

from __future__ import annotations

import asyncio
import math
import time

import anyio

from agentrl._errors import AgentRLError
from agentrl._types import SamplingParams

from ._protocol import Engine
from ._server_metrics import engine_statistics


class ModelHealth:
    """The served model's health, probed on demand (single event loop)."""

    def __init__(
        self, engine: Engine, probe_token: int, *, fresh_s: float = 5.0, timeout_s: float = 20.0
    ) -> None:
        self._engine = engine
        self._probe_token = probe_token
        self._fresh_s = fresh_s
        self._timeout_s = timeout_s
        self._passed_at: float | None = None
        self._epoch = 0
        self._lock = asyncio.Lock()

    def forget(self) -> None:
        """The weights changed or a request failed: the next ``/health`` probes again."""
        self._passed_at = None
        self._epoch += 1

    def _fresh(self) -> bool:
        passed = self._passed_at
        return passed is not None and time.monotonic() - passed < self._fresh_s

    async def healthy(self, *, probe: bool = False) -> bool:
        """True when the engine answers and a probe passed (now, or within ``fresh_s`` unless
        ``probe``)."""
        try:
            engine_statistics(self._engine)
        except AgentRLError:
            return False
        if getattr(getattr(self._engine, "_worker", None), "broken", None) is not None:
            return False
        if not probe and self._fresh():
            return True
        async with self._lock:  # concurrent polls share one probe
            if not probe and self._fresh():
                return True
            started, epoch = time.monotonic(), self._epoch
            ok = await self._probe()
            if self._epoch == epoch:  # no weight update or failure while it ran
                self._passed_at = started if ok else None
            return ok

    async def _probe(self) -> bool:
        try:
            with anyio.fail_after(self._timeout_s):
                for _ in range(2):  # a weight update may abort one probe (in_flight="abort")
                    result = await self._engine.generate(
                        [self._probe_token], SamplingParams(1, 0.0)
                    )
                    if result is not None and result.finish_reason != "abort":
                        break
        except (AgentRLError, TimeoutError):
            return False
        if result is None or result.finish_reason == "abort" or not result.token_ids:
            return False
        return all(math.isfinite(lp) for lp in result.logprobs)
