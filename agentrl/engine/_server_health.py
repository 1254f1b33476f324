"""Whether the served model can generate: what ``/health`` and ``/health_generate`` answer.

SGLang's ``/health`` and ``/health_generate`` push a one-token request (input ``[0]``) through the
model and answer 200 as soon as the server produces output (the probe's, or any running
request's), 503 when nothing comes within 20 s. ``agentrl serve`` does the same, so a model that
cannot generate (its worker crashed, or weights that passed every check still produce NaN logits)
is never reported healthy, and a busy server is not reported dead because the probe waits in its
queue:

- ``/health_generate`` probes on every call: one greedy token from token 0, which must come back
  with a finite logprob; while it waits, the engine generating tokens for other requests with no
  new failure counts as a pass.
- ``/health`` reuses a passing probe for ``fresh_s`` seconds, so frequent polling (a router, a load
  balancer) costs at most one token per ``fresh_s``; a weight update or a failed ``/generate``
  forgets it.
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

PROBE_INPUT = [0]
"""The probe's prompt (SGLang's): token 0, so it never shares a cached prefix with prompts that
start with BOS."""


class ModelHealth:
    """The served model's health, probed on demand (single event loop)."""

    def __init__(
        self,
        engine: Engine,
        *,
        fresh_s: float = 5.0,
        timeout_s: float = 20.0,
        progress_poll_s: float = 0.25,
    ) -> None:
        self._engine = engine
        self._fresh_s = fresh_s
        self._timeout_s = timeout_s
        self._poll_s = progress_poll_s
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

    def _progress(self) -> tuple[int, int] | None:
        """(tokens generated, requests failed) so far, when the engine counts them."""
        try:
            stats = engine_statistics(self._engine)
        except AgentRLError:
            return None
        generated = getattr(stats, "tokens_generated", None)
        failed = getattr(stats, "requests_failed", None)
        if not isinstance(generated, int) or not isinstance(failed, int):
            return None
        return generated, failed

    async def _probe(self) -> bool:
        outcome: list[bool] = []
        base = self._progress()

        async def generate_one(scope: anyio.CancelScope) -> None:
            outcome.append(await self._generate_one())
            scope.cancel()

        async def watch_progress(scope: anyio.CancelScope) -> None:
            while base is not None:
                await anyio.sleep(self._poll_s)
                now = self._progress()
                if now is not None and now[0] > base[0] and now[1] == base[1]:
                    outcome.append(True)  # other requests are producing tokens, none failed
                    scope.cancel()

        with anyio.move_on_after(self._timeout_s):
            async with anyio.create_task_group() as tg:
                tg.start_soon(generate_one, tg.cancel_scope)
                tg.start_soon(watch_progress, tg.cancel_scope)
        return bool(outcome) and outcome[0]

    async def _generate_one(self) -> bool:
        for _ in range(2):  # a weight update may abort one probe (in_flight="abort")
            try:
                result = await self._engine.generate(PROBE_INPUT, SamplingParams(1, 0.0))
            except AgentRLError:
                return False
            if result is not None and result.finish_reason != "abort":
                break
        if result is None or result.finish_reason == "abort" or not result.token_ids:
            return False
        return all(math.isfinite(lp) for lp in result.logprobs)
