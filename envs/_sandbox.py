"""How environments get a sandbox from the runtime.

The runtime opens **one** sandbox runner per rollout — an in-process ``SandboxPool`` for
``--sandbox local|docker|gvisor`` or a ``SandboxClient`` for ``--sandbox http(s)://HOST:PORT`` —
with ``open_sandbox_runner(spec)``, and passes it to the environment factory as the keyword
argument ``sandbox`` (only to environments whose factory takes one: ``wants_sandbox``). Each
environment instance (one per trajectory) wraps it in a ``SandboxLease``: the trajectory's handle,
which waits and retries when the pool is over capacity (nothing ran, so retrying is safe) and
refuses use after ``close()``.

This module lives in ``agentrl.envs`` (which may import ``agentrl.sandboxes``) so that the core
never imports sandboxes; the composition root (``agentrl.cli``) imports it.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from agentrl import SandboxError as CoreSandboxError
from agentrl.sandboxes import (
    PoolBusy,
    PoolConfig,
    RunRequest,
    RunResult,
    SandboxClient,
    SandboxRunner,
    open_sandbox_pool,
)

BACKENDS = ("local", "docker", "gvisor")
TOKEN_ENV = "AGENTRL_SANDBOX_TOKEN"


def wants_sandbox(factory: Callable[..., Any]) -> bool:
    """Does an environment factory (class or function) take a ``sandbox`` keyword?"""
    try:
        return "sandbox" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


@asynccontextmanager
async def open_sandbox_runner(
    spec: str, *, size: int | None = None, token: str | None = None
) -> AsyncIterator[SandboxRunner]:
    """Open the sandbox a rollout shares: ``local``/``docker``/``gvisor`` (an in-process pool of
    ``size`` warm sandboxes), ``http(s)://HOST:PORT`` (the service; bearer token from ``token``
    or ``$AGENTRL_SANDBOX_TOKEN``), or a path to a ``PoolConfig`` JSON file."""
    if spec.startswith(("http://", "https://")):
        client = SandboxClient(spec, token=token or os.environ.get(TOKEN_ENV) or None)
        async with client:
            await client.health()  # fail now, clearly, if the service is not there
            yield client
        return
    if spec in BACKENDS:
        data: dict[str, Any] = {"backend": {"type": spec}}
    elif spec.endswith(".json") and os.path.isfile(spec):
        with open(spec) as f:
            data = json.load(f)
    else:
        raise ValueError(
            f"unknown sandbox {spec!r}: expected one of {', '.join(BACKENDS)}, "
            "http(s)://HOST:PORT, or a PoolConfig .json file"
        )
    if size is not None:
        data["size"] = size
    async with open_sandbox_pool(PoolConfig.model_validate(data)) as pool:
        yield pool


class SandboxLease:
    """One trajectory's handle on the rollout's shared sandbox runner.

    ``run``/``run_batch`` wait ``retry_after_s`` and retry when the runner is over capacity
    (``PoolBusy``: nothing ran), at most ``busy_retries`` times. Without a runner (e.g. under
    ``check_env``) or after ``close()`` they raise ``agentrl.SandboxError`` with what to do."""

    def __init__(
        self,
        runner: SandboxRunner | None,
        *,
        env_id: str = "",
        busy_retries: int = 10,
        max_busy_wait_s: float = 5.0,
    ) -> None:
        self._runner = runner
        self._env_id = env_id
        self._closed = False
        self.busy_retries = busy_retries
        self.max_busy_wait_s = max_busy_wait_s
        self.runs = 0
        """Programs this trajectory ran."""
        self.busy_waits = 0

    @property
    def available(self) -> bool:
        return self._runner is not None and not self._closed

    def _get(self) -> SandboxRunner:
        if self._closed:
            raise CoreSandboxError(f"{self._env_id}: the sandbox lease is closed")
        if self._runner is None:
            raise CoreSandboxError(
                f"{self._env_id} needs a sandbox: run `agentrl rollout --sandbox "
                "local|docker|gvisor|http://HOST:PORT`, or pass sandbox=<SandboxPool or "
                "SandboxClient> to the environment"
            )
        return self._runner

    async def _retrying(self, call: Callable[[SandboxRunner], Any]) -> Any:
        runner = self._get()
        attempt = 0
        while True:
            try:
                return await call(runner)
            except PoolBusy as exc:
                if attempt >= self.busy_retries:
                    raise
                attempt += 1
                self.busy_waits += 1
                await anyio.sleep(min(max(exc.retry_after_s, 0.05), self.max_busy_wait_s))

    async def run(self, request: RunRequest) -> RunResult:
        result = await self._retrying(lambda r: r.run(request))
        self.runs += 1
        return result

    async def run_batch(self, requests: Sequence[RunRequest]) -> list[RunResult]:
        results = await self._retrying(lambda r: r.run_batch(list(requests)))
        self.runs += len(requests)
        return results

    def close(self) -> None:
        """End the lease (the shared runner stays open: the rollout owns it)."""
        self._closed = True


def format_run_result(result: RunResult, *, limit: int = 4000) -> str:
    """A program's outcome as text for the model: status, exit code, stdout, stderr."""
    lines = [f"status: {result.status}"]
    if result.exit_code not in (None, 0):
        lines.append(f"exit code: {result.exit_code}")
    if result.error:
        lines.append(f"error: {result.error}")
    half = limit // 2
    for name, text, truncated in (
        ("stdout", result.stdout, result.stdout_truncated),
        ("stderr", result.stderr, result.stderr_truncated),
    ):
        if text or truncated:
            shown = text if len(text) <= half else text[:half] + f"\n… ({len(text) - half} more)"
            lines.append(f"{name}:\n{shown.rstrip()}" + ("\n… (truncated)" if truncated else ""))
    if len(lines) == 1 and result.status == "ok":
        lines.append("(no output: use print() to see values)")
    return "\n".join(lines)
