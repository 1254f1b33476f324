"""Errors of the sandbox package: one root, one subclass per failure a caller handles.

A request that breaks a rule raises ``_types.InvalidRequest`` (a ``ValueError`` naming the field
and value; nothing ran) from ``run`` (in a batch, that item comes back as
``status="invalid_request"``); a sandbox that breaks during a run comes back as
``status="sandbox_error"``. These exceptions are for the pool and the host: too many requests,
or a backend the host cannot give.

``SandboxError`` is this package's own root, not a subclass of ``agentrl.AgentRLError``: the
package imports nothing else of agentrl, so that it runs alone as a service. Code that calls it
directly catches ``agentrl.sandboxes.SandboxError``; where agentrl itself uses a sandbox, these
errors are translated into ``agentrl.SandboxError`` (see ``agentrl/_errors.py``).
"""

from __future__ import annotations


class SandboxError(Exception):
    """Root of this package's errors."""


class PoolBusy(SandboxError):
    """The pool is over capacity (queue full, or a queued request waited too long).

    The service answers 429 with ``Retry-After: retry_after_s``; nothing ran."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendUnavailable(SandboxError):
    """This host cannot give the backend (or a guarantee it was asked for); the message says why."""
