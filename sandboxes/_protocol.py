"""``SandboxRunner``: what verifiers and environments need from a sandbox.

Both an in-process ``SandboxPool`` and a ``SandboxClient`` talking to ``agentrl sandbox serve``
satisfy it, so code written against it runs with either (``--sandbox local`` or
``--sandbox http://HOST:PORT``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ._types import RunRequest, RunResult


@runtime_checkable
class SandboxRunner(Protocol):
    async def run(self, request: RunRequest) -> RunResult:
        """Run one program. A request that breaks a rule raises ``InvalidRequest`` (naming the
        field and value; nothing ran); over capacity raises ``PoolBusy`` (``SandboxBusy`` from
        the client is a subclass). What the program does is the result's ``status``."""
        ...

    async def run_batch(self, requests: Sequence[RunRequest]) -> list[RunResult]:
        """Run several programs; one result per request, in order. An item that breaks a rule
        comes back as ``status="invalid_request"`` without running; the others run."""
        ...
