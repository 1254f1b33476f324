"""``EmbeddedEngine``: a transformers model in this process, behind the async ``Engine`` protocol.

One background thread owns the model (see ``_worker``) and batches continuously: new requests are
prefilled one at a time between decode steps and join the running batch; finished ones leave.
``generate`` works under trio and asyncio (anyio): it hands the request to the thread and waits
on an ``anyio.Event`` that the thread sets through ``anyio.from_thread.run_sync(..., token=...)``.
Cancelling the waiting task aborts the request in the worker.

Sessions are recorded and validated only (no KV is kept between calls yet): the caller always
sends the whole context, so results do not depend on them; ``cached_tokens`` is always 0.

Weight updates are applied between decode steps once no request is running; requests that arrive
meanwhile wait, so every request runs on one weight version (``GenerateResult.weight_version``).

Batch invariance: a request's prompt is always prefilled alone; only decode steps are batched,
and fp32 CPU GEMMs of different batch sizes may differ in the last bits, so logprobs can differ
by ~1e-6 between a request run alone and in a batch (greedy ids are equal in our tests).

CPU threads: the worker calls ``torch.set_num_threads(num_threads or os.cpu_count())``. Every
thread that runs torch ops owns an OpenMP team; on this 2-core box a second live team in the
process (another thread that ran a forward pass) slows the worker's decode steps ~1.7x (measured
32 -> 55 ms per SmolLM2-135M step), so keep other torch work out of the engine's process or give
each side fewer threads.
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl._errors import EngineError
from agentrl._models import resolve_model
from agentrl._types import GenerateResult, SamplingParams

from ._sampling import check_sampling, make_generator
from ._worker import Request, WeightUpdate, Worker


class EngineStatistics(msgspec.Struct, frozen=True):
    """Counters since the engine started (``EmbeddedEngine.statistics()``)."""

    requests_done: int
    """Requests that ended with ``stop`` or ``length``."""
    requests_aborted: int
    requests_failed: int
    tokens_generated: int
    prefill_tokens: int
    decode_steps: int
    mean_batch_size: float
    """Mean number of rows per decode step (0 before the first step)."""
    running: int
    waiting: int
    weight_version: int


class EmbeddedEngine:
    """A Llama-family causal LM in fp32 on CPU with continuous batching. See the module docs."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object,
        *,
        max_batch_size: int = 16,
        num_threads: int | None = None,
        weight_version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {max_batch_size}")
        model.eval()
        model.requires_grad_(False)
        self._vocab_size = int(model.config.vocab_size)
        self._max_context = int(model.config.max_position_embeddings)
        self._sessions: dict[str, int | None] = {}
        self._closed = False
        self._worker = Worker(
            model,  # type: ignore[arg-type]
            tokenizer,  # type: ignore[arg-type]
            max_batch_size=max_batch_size,
            num_threads=num_threads or os.cpu_count() or 1,
            weight_version=weight_version,
        )
        self._worker.thread.start()
        weakref.finalize(self, self._worker.close)  # a forgotten engine still stops its thread

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        max_batch_size: int = 16,
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
    ) -> EmbeddedEngine:
        """Load an HF safetensors folder (or a registered model name) and start the worker.

        Blocking (model load, and on first use of a registered name, its download/build).
        """
        folder = resolve_model(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot load a causal LM from {folder}: {exc}") from exc
        return cls(model, tokenizer, max_batch_size=max_batch_size, num_threads=num_threads)

    @property
    def weight_version(self) -> int:
        return self._worker.weight_version

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + generated) a request may reach: ``max_position_embeddings``."""
        return self._max_context

    def statistics(self) -> EngineStatistics:
        c = self._worker.counters
        return EngineStatistics(
            requests_done=c.requests_done,
            requests_aborted=c.requests_aborted,
            requests_failed=c.requests_failed,
            tokens_generated=c.tokens_generated,
            prefill_tokens=c.prefill_tokens,
            decode_steps=c.decode_steps,
            mean_batch_size=c.decode_rows / c.decode_steps if c.decode_steps else 0.0,
            running=self._worker.running,
            waiting=self._worker.waiting,
            weight_version=self._worker.weight_version,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")
        if self._worker.broken is not None:
            raise EngineError(f"engine worker crashed: {self._worker.broken!r}")

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> GenerateResult:
        """Sample a continuation of the whole context ``input_ids``.

        Returns exactly the sampled ids (a matched stop token or the tokens covering a matched
        stop string included) and their unfiltered logprobs. Raises ``EngineError`` for an unknown
        session, invalid ids or sampling params, a context that leaves no room to generate, a
        closed engine, or a failure while generating this request.
        """
        self._check_open()
        limit = self._max_context
        if session is not None:
            if session not in self._sessions:
                raise EngineError(f"unknown session {session!r}")
            capacity = self._sessions[session]
            limit = min(limit, capacity) if capacity is not None else limit
        ids = [int(t) for t in input_ids]
        if not ids:
            raise EngineError("input_ids is empty")
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise EngineError(f"token ids out of range [0, {self._vocab_size}): {bad[:5]}")
        if len(ids) >= limit:
            raise EngineError(f"context of {len(ids)} tokens leaves no room under limit {limit}")
        check_sampling(sampling)
        if sampling.max_new_tokens == 0:
            return GenerateResult(
                [], [], "length", prompt_tokens=len(ids), weight_version=self.weight_version
            )
        request = Request(
            input_ids=ids,
            sampling=sampling,
            limit=limit,
            generator=make_generator(sampling.seed),
            token=anyio.lowlevel.current_token(),
            done=anyio.Event(),
        )
        self._worker.submit(request)
        try:
            await request.done.wait()
        except BaseException:  # cancelled: tell the worker to drop the request
            request.aborted = True
            self._worker.wake()
            raise
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    async def open_session(self, capacity_tokens: int | None = None) -> str:
        """Open a session; ``capacity_tokens`` caps prompt + generated tokens of its requests."""
        self._check_open()
        if capacity_tokens is not None and capacity_tokens < 2:
            raise EngineError(f"capacity_tokens must be >= 2, got {capacity_tokens}")
        session_id = uuid.uuid4().hex
        self._sessions[session_id] = capacity_tokens
        return session_id

    async def close_session(self, session_id: str) -> None:
        if self._sessions.pop(session_id, False) is False:
            raise EngineError(f"unknown session {session_id!r}")

    async def update_weights(self, version: int, source: str | dict[str, torch.Tensor]) -> None:
        """Load new weights (an HF folder with safetensors, a registered name, or a state dict).

        The source must hold every tensor of the model under its HF name and shape (a tied
        ``lm_head.weight`` may be omitted); values are copied (and cast) into the model. Applied
        by the worker once no request is running: in-flight requests finish on the old weights,
        requests submitted meanwhile wait. Raises ``EngineError`` when the source cannot be read
        or does not match the model (nothing is changed then).
        """
        self._check_open()
        if isinstance(source, dict):
            state = dict(source)
        else:
            state = await anyio.to_thread.run_sync(_read_safetensors, source)
        update = WeightUpdate(
            version=int(version),
            state=state,
            token=anyio.lowlevel.current_token(),
            done=anyio.Event(),
        )
        self._worker.submit(update)
        try:
            await update.done.wait()
        except BaseException:
            update.aborted = True  # skipped unless the worker already applied it
            self._worker.wake()
            raise
        if update.error is not None:
            raise update.error

    async def aclose(self) -> None:
        """Stop the worker; requests still running or waiting end with ``finish_reason="abort"``."""
        if self._closed:
            return
        self._closed = True
        self._worker.close()
        await anyio.to_thread.run_sync(self._worker.thread.join)

    async def __aenter__(self) -> EmbeddedEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()


def _read_safetensors(source: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    try:
        folder = resolve_model(source)
    except Exception as exc:
        raise EngineError(f"cannot resolve weights {source!r}: {exc}") from exc
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


@asynccontextmanager
async def open_embedded_engine(
    path: str | os.PathLike[str],
    *,
    max_batch_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_threads: int | None = None,
) -> AsyncIterator[EmbeddedEngine]:
    """Load the model in a thread, yield the engine, close it (aborting leftovers) on exit."""

    def load() -> EmbeddedEngine:
        return EmbeddedEngine.from_pretrained(
            path, max_batch_size=max_batch_size, dtype=dtype, num_threads=num_threads
        )

    engine = await anyio.to_thread.run_sync(load)
    async with engine:
        yield engine
