"""How environments get a sandbox from the runtime.

The runtime opens **one** sandbox runner per run — an in-process ``SandboxPool`` for
``sandbox: local|docker|gvisor`` or ``SandboxClient``s for ``sandbox: http(s)://HOST:PORT`` —
with ``open_env_sandbox`` (``_sandbox_open``), and passes it to the environment factory as the
keyword argument ``sandbox`` (only to environments whose factory takes one: ``wants_sandbox``). Each
environment instance (one per trajectory) wraps it in a ``SandboxLease``: the trajectory's handle,
which waits and retries when the pool is over capacity (nothing ran, so retrying is safe) and
refuses use after ``close()``.

This is where agentrl meets ``agentrl.sandboxes``, whose errors have their own root (the package
runs alone): ``sandbox_errors`` translates them into ``agentrl.SandboxError`` (the original as
``__cause__``), so ``except agentrl.AgentRLError`` sees every failure that crosses it.

This module lives in ``agentrl.envs`` (which may import ``agentrl.sandboxes``) so that the core
never imports sandboxes; the composition roots (``agentrl.cli``, ``agentrl.loop``) import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio

from agentrl import SandboxError
from agentrl import sandboxes as _sandboxes
from agentrl.sandboxes import PoolBusy, RunRequest, RunResult, SandboxRunner


def wants_sandbox(factory: Callable[..., Any]) -> bool:
    """Does an environment factory (class or function) take a ``sandbox`` keyword?"""
    try:
        return "sandbox" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


@contextmanager
def sandbox_errors(where: str) -> Iterator[None]:
    """Raise ``agentrl.SandboxError`` (message prefixed with ``where``, the original as
    ``__cause__``) for any ``agentrl.sandboxes`` error raised inside the block, a refused
    request (``InvalidRequest``, which names the field and value; nothing ran) included."""
    try:
        yield
    except _sandboxes.SandboxError as exc:
        raise SandboxError(f"{where}: {type(exc).__name__}: {exc}") from exc


class SandboxLease:
    """One trajectory's handle on the rollout's shared sandbox runner.

    ``run``/``run_batch`` wait ``retry_after_s`` and retry when the runner is over capacity
    (``PoolBusy``: nothing ran), at most ``busy_retries`` times. Without a runner (e.g. under
    ``check_env``), after ``close()``, when the runner stays busy or fails, they raise
    ``agentrl.SandboxError`` saying why."""

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
            raise SandboxError(f"{self._env_id}: the sandbox lease is closed")
        if self._runner is None:
            raise SandboxError(
                f"{self._env_id} needs a sandbox: set `sandbox:` in the run's config or run "
                "`agentrl rollout --sandbox local|docker|gvisor|http://HOST:PORT`, or pass "
                "sandbox=<SandboxPool or SandboxClient> to the environment"
            )
        return self._runner

    async def _retrying(self, call: Callable[[SandboxRunner], Any]) -> Any:
        runner = self._get()
        attempt = 0
        with sandbox_errors(self._env_id or "sandbox"):
            while True:
                try:
                    return await call(runner)
                except PoolBusy as exc:
                    if attempt >= self.busy_retries:
                        raise SandboxError(
                            f"{self._env_id or 'sandbox'}: still over capacity after "
                            f"{attempt} retries: {exc}"
                        ) from exc
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
