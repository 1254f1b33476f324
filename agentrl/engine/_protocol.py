"""The engine client protocol every engine (embedded, SGLang adapter) implements.

The caller always passes the *whole* context in ``input_ids``, also inside a session: an engine
that holds a session's KV (or an adapter talking to a server that prepends it) may reuse what it
holds, but the result must be the same as without the session. Logprobs are always
``log_softmax(logits / temperature)`` over the full vocabulary at the sampled token, before any
filtering (temperature 0 = greedy, logprob at temperature 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from agentrl._types import GenerateResult, LogprobDetails, SamplingParams

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Engine(Protocol):
    """An async inference engine. Errors the caller caused, and failed requests, raise
    ``EngineError``; a failed request never fails its neighbours."""

    @property
    def weight_version(self) -> int:
        """The version of the weights new requests will run on."""
        ...

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + generated) one request may reach."""
        ...

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> GenerateResult:
        """Sample a continuation of ``input_ids`` (the whole context)."""
        ...

    async def open_session(self, capacity_tokens: int | None = None) -> str:
        """Open a session (one trajectory's turns); returns its id."""
        ...

    async def close_session(self, session_id: str) -> None:
        """Release a session; ``EngineError`` for an unknown id."""
        ...

    async def update_weights(self, version: int, source: str | dict[str, torch.Tensor]) -> None:
        """Replace the weights (a folder/path, or a state dict) and set ``weight_version``."""
        ...

    async def aclose(self) -> None:
        """Release the engine; pending requests end with ``finish_reason="abort"``."""
        ...


class Output(NamedTuple):
    """A running request's output so far (what ``on_tokens`` is called with and what
    ``PartialOutput.read`` gives): every list as long as ``ids``."""

    ids: list[int]
    logprobs: list[float]
    """The sampled ids' logprobs."""
    details: LogprobDetails | None = None
    """For a request with a ``LogprobQuery``, the lists it asked for, else None."""
    token_versions: tuple[int, ...] = ()
    """The weight version that sampled each id (empty from an engine that cannot tell)."""
    cached_tokens: int = 0
    """Context tokens whose KV was reused when the request was admitted."""


class PartialOutput:
    """The output so far of one running request, read on demand from any thread (what an
    aborted request answers with): the pull twin of a per-step ``on_tokens`` callback, so a
    caller that needs the output only if it aborts costs the engine nothing per step. An engine
    whose ``generate`` takes ``partial=`` attaches its reader when the request starts."""

    def __init__(self) -> None:
        self._reader: Callable[[], Output] | None = None

    def attach(self, reader: Callable[[], Output]) -> None:
        self._reader = reader

    def read(self) -> Output:
        """The output so far, of one run of the request (empty before it started)."""
        return self._reader() if self._reader is not None else Output([], [])
