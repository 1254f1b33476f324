"""``EmbeddedEngine``: our Llama/Qwen2 forward over a paged KV pool, behind the async ``Engine``.

One background thread owns the model, the KV pool, the radix cache and the sessions' pins
(``_worker``); ``_scheduler`` decides every step. ``generate`` works under trio and asyncio
(anyio): it hands the request to the thread and waits on an ``anyio.Event`` that the thread has
set in the caller's event loop (it schedules that and goes on; ``_worker``'s mailboxes).
Cancelling the waiting task aborts the request in the worker.

Reuse. A request's context is matched against its session's pinned KV (verified token by token)
and otherwise against the radix tree (whole pages of ``block_size`` tokens); only the rest is
computed. ``GenerateResult.cached_tokens`` counts the reused tokens. Sessions behave like
SGLang's streaming sessions (see ``_session``): turn k+1 reuses all of turn k's context, its
last sampled token included (the worker feeds that token once more, without sampling, before it
pins the turn). The caller still sends the whole context, and results never depend on
what was reused beyond fp32 rounding (see below).

Weight updates (``update_weights``). The rule for requests in flight is
``EngineOptions.in_flight``:

- ``"finish"`` (default): requests already started finish on the old weights; the update waits
  for them, and requests not yet started wait for the update.
- ``"abort"``: started requests are thrown back into the queue with their output discarded and
  their seed's generator reset, then recompute from scratch on the new weights (the caller
  only sees the longer latency).
- ``"partial"`` (interruptible generation, as in AReaL): the update is applied at the next step
  boundary without waiting. Each running request keeps the tokens it sampled and their
  logprobs; its KV, computed by the old weights, is dropped, and it re-queues at its place to
  recompute its whole context (prompt and output so far) on the new weights through the
  ordinary admission and chunked-prefill path, then continues decoding with the same sampling
  generator. One result can then span versions.

With ``"finish"`` and ``"abort"`` every token of a result comes from one version; with
``"partial"`` ``GenerateResult.token_versions`` records the version of each token (non-decreasing)
and ``weight_version`` is the first token's. Every rule then unpins every session, empties the
radix cache and reports the new version on every later token.

Numerics: fp32. A token's KV may come from a prefill chunk, a decode step or a cache hit, and a
row may share a step with others; GEMMs of different shapes can differ in the last bits, so
logprobs may differ by ~1e-6 between such runs (greedy ids are equal in our tests).

Devices: ``EngineOptions.device`` puts the weights, the rope tables, the KV pool and every step's
tensors on one CUDA device (``"cuda"``, ``"cuda:N"``; checked at construction, before weights
load). Each step's logits rows come back to the CPU as float32 and sampling runs there with the
same per-request generators, so sampling rules and seeds are the same on every device; only the
logits differ, by the device's arithmetic (``tests/engine/test_device.py`` holds fp32 on CUDA to
1e-3 logprob of the CPU engine, and ``dtype="bfloat16"``, the usual GPU choice, to 0.05 of an
fp32 forward; bf16 on a CPU measures ~0.008).

CPU threads: the worker calls ``torch.set_num_threads(num_threads or os.cpu_count())``. Every
thread that runs torch ops owns an OpenMP team; on this 2-core box a second live team in the
process slows the worker ~1.7x, so keep other torch work out of the engine's process.
"""

from __future__ import annotations

import os
import uuid
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from agentrl._errors import EngineError, GenerationError
from agentrl._models import load_tokenizer, resolve_model
from agentrl._types import GenerateResult, LogprobQuery, SamplingParams
from agentrl.kernels import triton_available
from agentrl.kernels._fused_ops import DTYPES as FUSED_OPS_DTYPES
from agentrl.kernels._fused_ops import probe as fused_ops_probe
from agentrl.kernels._fused_ops import unsupported as fused_ops_unsupported

from ._decode import AttentionKernelChooser, check_attention
from ._device import resolve_device, resolve_dtype
from ._graphs import DecodeGraphs
from ._kv import KVPool, device_memory_bytes
from ._logprobs import LogprobCollector
from ._model import CausalLM, ModelConfig, read_safetensors
from ._options import STEP_TOKENS, EngineOptions, EngineStatistics
from ._protocol import Output, PartialOutput
from ._radix import RadixCache
from ._sampling import check_sampling, effective_sampling
from ._scheduler import Request, Scheduler
from ._seq import KVManager
from ._session import SessionTable
from ._worker import (
    CloseSession,
    FlushCache,
    OpenSession,
    PauseGeneration,
    WeightUpdate,
    Worker,
)


def graph_replay(options: EngineOptions, device: torch.device) -> str | None:
    """How decode steps replay captured graphs (``DecodeGraphs``' ``replay``): ``"cuda"`` where
    ``cuda_graph`` applies (a CUDA device, the Triton decode kernel runs there and
    ``decode_attention`` is not ``"sdpa"``), else ``None`` (no graphs)."""
    usable = device.type == "cuda" and options.decode_attention != "sdpa"
    return "cuda" if options.cuda_graph and usable and triton_available(device) else None


def use_fused_ops(
    mode: str,
    device: torch.device,
    config: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
) -> bool:
    """Whether the model's forward runs the fused Triton elementwise kernels
    (``EngineOptions.fused_ops``); ``EngineError`` where ``"triton"`` cannot run (on this
    device, in this dtype, or for this model's shapes when ``config`` is given)."""
    if mode == "torch":
        return False
    why = None
    if dtype not in FUSED_OPS_DTYPES:
        why = f"the kernels take float32, float16 and bfloat16, not {dtype}"
    elif config is not None:
        heads = config.num_heads + config.num_kv_heads
        why = fused_ops_unsupported(config.hidden_size, heads, config.head_dim)
    if mode == "auto":
        return device.type == "cuda" and triton_available(device) and why is None
    if not triton_available(device):
        raise EngineError(
            f"fused_ops='triton' cannot run on {device}: it needs triton installed and a CUDA "
            "device, or TRITON_INTERPRET=1 (Triton's CPU interpreter, for tests); use 'auto' "
            "or 'torch'"
        )
    if why is not None:
        raise EngineError(f"fused_ops='triton' cannot run this model: {why}; use 'auto' or 'torch'")
    return True


_CALLS: dict[type, str] = {
    Request: "generate()",
    WeightUpdate: "update_weights()",
    CloseSession: "close_session()",
    FlushCache: "flush_cache()",
    PauseGeneration: "pause_generation()/continue_generation()",
}
"""The engine call each worker item comes from, as an error names it."""


def _current_task_id() -> int | None:
    """The running async task's id (None outside one)."""
    try:
        return anyio.get_current_task().id
    except RuntimeError:
        return None


class EmbeddedEngine:
    """A Llama/Qwen2-family causal LM (fp32 on CPU by default, or on a CUDA device) with paged KV,
    a radix prefix cache, sessions and continuous batching. See the module docs.

    ``model``: a ``CausalLM`` already on ``options.device`` (its dtype is kept), or an HF model
    (its config and weights are copied in ``options.dtype`` onto ``options.device``)."""

    def __init__(
        self,
        model: CausalLM | torch.nn.Module,
        tokenizer: Any,
        options: EngineOptions | None = None,
        *,
        weight_version: int = 0,
        model_path: str | None = None,
        **overrides: Any,
    ) -> None:
        opts = (options or EngineOptions()).replace(**overrides)
        device = resolve_device(opts.device)
        if not isinstance(model, CausalLM):  # an HF model: take its config and weights
            config = ModelConfig.from_dict(model.config.to_dict())  # type: ignore[union-attr]
            model = CausalLM(config, model.state_dict(), resolve_dtype(opts.dtype), device)
        elif model.device != device:
            raise EngineError(
                f"the model is on {model.device} but device={opts.device!r} ({device}): build "
                f"the CausalLM with device={str(device)!r}"
            )
        # before any thread starts: an unusable attention kernel fails here, not mid-request
        attention = AttentionKernelChooser(
            opts.decode_attention, device, model.dtype, opts.prefill_attention
        )
        model.fused_ops = use_fused_ops(opts.fused_ops, device, model.config, model.dtype)
        if model.fused_ops and device.type == "cuda":  # they build and run here, or not at all
            try:
                fused_ops_probe(device, model.dtype)
            except RuntimeError as exc:
                if opts.fused_ops == "triton":
                    raise EngineError(f"fused_ops='triton': {exc}") from exc
                warnings.warn(
                    f"{exc}; running torch's elementwise operations instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
                model.fused_ops = False
        self.options = opts
        self.model_path = model_path
        config = model.config
        context = config.max_context
        if opts.context_length is not None:
            if opts.context_length > context:
                raise EngineError(
                    f"context_length {opts.context_length} is larger than the model's "
                    f"max_position_embeddings ({context})"
                )
            context = opts.context_length
        replay = graph_replay(opts, device)
        bytes_per_token = config.kv_bytes_per_token(model.dtype)
        tokens = opts.kv_cache_tokens or min(
            opts.kv_cache_bytes // bytes_per_token, opts.max_batch_size * context
        )
        if opts.block_size > context:
            raise EngineError(
                f"block_size={opts.block_size} is larger than the context ({context} tokens): "
                "one KV block would hold more than any request; use a smaller block_size"
            )
        num_blocks = max(1, tokens // opts.block_size)
        pool_bytes = (num_blocks + (replay is not None)) * opts.block_size * bytes_per_token
        sized_by = (
            f"kv_cache_tokens={opts.kv_cache_tokens}"
            if opts.kv_cache_tokens
            else f"kv_cache_bytes={opts.kv_cache_bytes}"
        )
        asked = (
            f"a KV pool of {num_blocks} blocks x block_size={opts.block_size} tokens "
            f"({sized_by}) asks for {pool_bytes} bytes"
        )
        lower = "lower kv_cache_tokens, kv_cache_bytes or block_size"
        total = device_memory_bytes(device)
        if total is not None and pool_bytes > total:
            raise EngineError(f"{asked}, more than {device} has ({total} bytes): {lower}")
        try:
            pool = KVPool(
                num_layers=config.num_layers,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                num_blocks=num_blocks,
                block_size=opts.block_size,
                dtype=model.dtype,
                device=device,
                pad_block=replay is not None,
            )
        except RuntimeError as exc:  # torch.OutOfMemoryError, or the CPU allocator's refusal
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise EngineError(
                f"{asked}, which {device} cannot allocate ({reason}): {lower}"
            ) from None
        tree = (
            RadixCache(opts.block_size, pool.free, opts.radix_token_budget)
            if opts.radix_cache
            else None
        )
        kv = KVManager(pool, tree)
        sessions = SessionTable(
            cap_tokens=opts.session_cap_tokens or pool.capacity_tokens // 2,
            ttl_s=opts.session_ttl_s,
            release=kv.release,
        )
        self._device = device
        self._bytes_per_token = bytes_per_token
        self._vocab_size = config.vocab_size
        self._max_context = min(context, pool.capacity_tokens)
        self._sessions: dict[str, int | None] = {}
        self._closed = False
        self._holders: list[int | None] = []
        """The tasks inside ``admitted_together`` blocks now."""
        self.max_step_tokens = opts.max_step_tokens or STEP_TOKENS[device.type]
        """The step budget in force (``EngineOptions.max_step_tokens`` or its device default)."""
        scheduler = Scheduler(
            kv, sessions, max_batch_size=opts.max_batch_size, max_step_tokens=self.max_step_tokens
        )
        graphs = None
        self.cuda_graph_error: str | None = None
        """Why capturing failed (a ``RuntimeWarning`` said so at start); ``None`` otherwise."""
        if replay is not None:
            largest = min(opts.cuda_graph_max_bs or opts.max_batch_size, opts.max_batch_size)
            try:
                graphs = DecodeGraphs(
                    model,
                    pool,
                    max_batch_size=largest,
                    max_context=self._max_context,
                    replay=replay,
                )
            except Exception as exc:  # out of memory, a kernel that does not compile, ...
                # the engine is correct without graphs, only slower: it says so and runs
                self.cuda_graph_error = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"capturing CUDA graphs for decode batches up to {largest} rows on {device} "
                    f"failed ({self.cuda_graph_error}); decode steps run uncaptured. Lower "
                    "cuda_graph_max_bs, or set cuda_graph=False (agentrl serve "
                    "--disable-cuda-graph) to skip the capture",
                    RuntimeWarning,
                    stacklevel=2,
                )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        self._worker = Worker(
            model,
            tokenizer,
            scheduler,
            num_threads=opts.num_threads or os.cpu_count() or 1,
            in_flight=opts.in_flight,
            weight_version=weight_version,
            attention=attention,
            graphs=graphs,
        )
        self._worker.thread.start()
        weakref.finalize(self, self._worker.close)  # a forgotten engine still stops its thread

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], options: EngineOptions | None = None, **overrides: Any
    ) -> EmbeddedEngine:
        """Load an HF safetensors folder (or a registered model name) and start the worker.

        Blocking (model load, and on first use of a registered name, its download/build).
        ``overrides`` are ``EngineOptions`` fields.
        """
        folder = resolve_model(path)
        opts = (options or EngineOptions()).replace(**overrides)
        # refuse an unusable device or attention kernel before loading the weights
        device, dtype = resolve_device(opts.device), resolve_dtype(opts.dtype)
        check_attention(opts.decode_attention, device, dtype, "decode_attention")
        check_attention(opts.prefill_attention, device, dtype, "prefill_attention")
        use_fused_ops(opts.fused_ops, device, dtype=dtype)
        try:
            model = CausalLM.from_folder(folder, dtype, device)
            tokenizer = load_tokenizer(folder)
        except (OSError, ValueError, KeyError, torch.OutOfMemoryError) as exc:
            raise EngineError(f"cannot load a causal LM from {folder}: {exc}") from exc
        return cls(model, tokenizer, opts, model_path=str(folder))

    @property
    def cuda_graph_sizes(self) -> list[int]:
        """The batch sizes decode steps replay captured graphs for (empty: none)."""
        graphs = self._worker.graphs
        return graphs.sizes if graphs is not None else []

    @property
    def device(self) -> torch.device:
        """Where the model and the KV pool live (``EngineOptions.device`` resolved: ``"cuda"``
        becomes ``cuda:N``)."""
        return self._device

    @property
    def weight_version(self) -> int:
        return self._worker.weight_version

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + generated) a request may reach: the model's positions, or the
        KV pool's capacity if smaller."""
        return self._max_context

    def statistics(self) -> EngineStatistics:
        c = self._worker.counters
        scheduler = self._worker.scheduler
        s, pool, sessions = scheduler.counters, scheduler.kv.pool, scheduler.sessions
        tree = scheduler.kv.tree
        radix = tree.statistics() if tree is not None else None
        free = pool.num_free
        waiting = self._worker.waiting_requests()
        cached = radix.cached_tokens // pool.block_size if radix is not None else 0
        evictable = radix.evictable_tokens // pool.block_size if radix is not None else 0
        return EngineStatistics(
            requests_done=c.requests_done,
            requests_aborted=c.requests_aborted,
            requests_failed=c.requests_failed,
            tokens_generated=c.tokens_generated,
            prefill_tokens=s.prefill_tokens,
            decode_steps=c.decode_steps,
            mean_batch_size=c.decode_rows / c.decode_steps if c.decode_steps else 0.0,
            running=self._worker.running,
            waiting=len(waiting),
            waiting_tokens=sum(len(r.tokens) for r in waiting),
            weight_version=self._worker.weight_version,
            cached_tokens=s.cached_tokens,
            preemptions=s.preemptions,
            interruptions=s.interruptions,
            kv_blocks=pool.num_blocks,
            kv_blocks_free=free,
            kv_blocks_cached=cached,
            kv_blocks_evictable=evictable,
            kv_blocks_in_use=pool.num_blocks - free - cached,
            block_size=pool.block_size,
            sessions_open=len(self._sessions),
            sessions_pinned=sessions.pinned_sessions,
            session_pinned_tokens=sessions.pinned_tokens,
            session_pinned_bytes=sessions.pinned_tokens * self._bytes_per_token,
            session_mismatches=sessions.mismatches,
            sessions_unpinned=(
                sessions.unpinned_by_ttl + sessions.unpinned_by_cap + sessions.unpinned_by_pressure
            ),
            radix=radix,
            graph_steps=self._worker.graphs.replays if self._worker.graphs is not None else 0,
            steps=c.steps,
            prefill_steps=c.prefill_steps,
            prefill_step_seconds=c.prefill_step_seconds,
            decode_step_seconds=c.decode_step_seconds,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")
        if self._worker.broken is not None:
            raise GenerationError(f"engine worker crashed: {self._worker.broken!r}")

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        session: str | None = None,
        *,
        logprobs: LogprobQuery | None = None,
        on_tokens: Callable[[Output], None] | None = None,
        partial: PartialOutput | None = None,
    ) -> GenerateResult:
        """Sample a continuation of the whole context ``input_ids``.

        Returns exactly the sampled ids (a matched stop token or the tokens covering a matched
        stop string included), their unfiltered logprobs and ``cached_tokens`` (context tokens
        whose KV was reused); ``logprobs`` asks for input-token, top-k and chosen-id logprobs
        too (``GenerateResult.details``, see ``_logprobs``). Raises ``EngineError`` for an
        unknown session, invalid ids, sampling params or logprob query, a context that leaves
        no room to generate or a closed engine; ``GenerationError`` (an ``EngineError``) for a
        failure while generating this request.

        ``on_tokens`` (optional) is called in this event loop with the ``Output`` so far
        (ids, logprobs, the ``LogprobDetails`` a ``logprobs`` query asked for, the weight
        versions and the cached tokens) after each step that sampled a token and did not finish
        the request (what ``agentrl serve`` streams). It must not block.
        ``partial`` (optional) is attached to the request, so its ``read()`` gives the output
        so far at any time, from any thread (what ``agentrl serve`` answers for an aborted
        request) at no cost per step.
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
        sampling = effective_sampling(sampling)
        if logprobs is not None:
            self._check_query(logprobs, len(ids))
        prefill_only = logprobs is not None and logprobs.input_start is not None
        if sampling.max_new_tokens == 0 and not prefill_only:  # nothing to compute
            return GenerateResult(
                [], [], "length", prompt_tokens=len(ids), weight_version=self.weight_version
            )
        seed = sampling.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        request = Request(
            input_ids=ids,
            sampling=sampling,
            limit=limit,
            seed=seed,
            token=anyio.lowlevel.current_token(),
            done=anyio.Event(),
            session=session,
            logprobs=LogprobCollector(logprobs, len(ids)) if logprobs is not None else None,
            on_tokens=on_tokens,
        )
        if partial is not None:
            partial.attach(request.output_so_far)
        await self._submit_and_wait(request)
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _check_query(self, query: LogprobQuery, context_len: int) -> None:
        start = query.input_start
        if start is not None and not 0 <= start <= context_len:
            raise EngineError(f"input_start must be in [0, {context_len}], got {start}")
        if query.top_k < 0:
            raise EngineError(f"top_k must be >= 0, got {query.top_k}")
        bad = [t for t in query.token_ids or () if not 0 <= t < self._vocab_size]
        if bad:
            raise EngineError(f"token_ids out of range [0, {self._vocab_size}): {bad[:5]}")

    async def open_session(self, capacity_tokens: int | None = None) -> str:
        """Open a session; ``capacity_tokens`` caps prompt + generated tokens of its requests."""
        self._check_open()
        if capacity_tokens is not None and capacity_tokens < 2:
            raise EngineError(f"capacity_tokens must be >= 2, got {capacity_tokens}")
        session_id = uuid.uuid4().hex
        self._worker.submit(OpenSession(session_id))
        self._sessions[session_id] = capacity_tokens
        return session_id

    async def close_session(self, session_id: str) -> None:
        """Release a session and its pinned KV (returns once the worker dropped the pin)."""
        if self._sessions.pop(session_id, False) is False:
            raise EngineError(f"unknown session {session_id!r}")
        if self._closed or self._worker.broken is not None:
            return
        await self._submit_and_wait(
            CloseSession(session_id, anyio.lowlevel.current_token(), anyio.Event())
        )

    async def update_weights(self, version: int, source: str | dict[str, torch.Tensor]) -> None:
        """Load new weights (an HF folder with safetensors, a registered name, or a state dict).

        The source must hold every tensor of the model under its HF name and shape (a tied
        ``lm_head.weight`` may be omitted); values are copied (and cast). In-flight requests
        follow ``EngineOptions.in_flight``; the radix cache and every session pin are flushed.
        Raises ``EngineError`` when the source cannot be read or does not match the model
        (nothing is changed then).
        """
        self._check_open()
        if isinstance(source, dict):
            state = dict(source)
        else:
            state = await anyio.to_thread.run_sync(_read_weights, source)
        # every check (names, shapes, values) before anything is disturbed; off the event loop
        await anyio.to_thread.run_sync(self._worker.model.check_state_dict, state)
        update = WeightUpdate(
            version=int(version),
            state=state,
            token=anyio.lowlevel.current_token(),
            done=anyio.Event(),
        )
        await self._submit_and_wait(update)
        if update.error is not None:
            raise update.error

    async def flush_cache(self) -> bool:
        """Drop every cached and pinned KV block (SGLang's ``/flush_cache``). Returns False, and
        changes nothing, while requests are running or waiting."""
        self._check_open()
        item = FlushCache(anyio.lowlevel.current_token(), anyio.Event())
        await self._submit_and_wait(item)
        return item.flushed

    async def pause_generation(self, mode: str = "in_place") -> None:
        """Stop stepping until ``continue_generation`` (SGLang's ``/pause_generation``).
        ``in_place``: running requests keep their KV; ``retract``: their KV is dropped and they
        recompute their context (prompt and output so far) when they go on. Either way new
        requests queue, aborts are handled, and a weight update applies at once, the paused
        requests continuing on the new weights (their KV recomputed: ``in_flight="finish"``
        acts as ``"partial"`` then)."""
        if mode not in ("in_place", "retract"):
            raise EngineError(f"pause mode must be 'in_place' or 'retract', got {mode!r}")
        self._check_open()
        await self._submit_and_wait(
            PauseGeneration(mode, anyio.lowlevel.current_token(), anyio.Event())
        )

    async def continue_generation(self) -> None:
        """Step again after ``pause_generation`` (a no-op when not paused)."""
        self._check_open()
        await self._submit_and_wait(
            PauseGeneration(None, anyio.lowlevel.current_token(), anyio.Event())
        )

    @property
    def paused(self) -> bool:
        return self._worker.paused

    @contextmanager
    def admitted_together(self) -> Iterator[None]:
        """Requests whose ``generate`` is called inside this block (from this event loop, as
        tasks that run before it ends) are admitted together: the worker takes none of them
        until the block ends, then all at once, so one step prefills them all (as far as
        ``max_step_tokens`` allows) wherever the worker thread was. Requests already running
        are not held up. Awaiting the engine (``generate``, ``update_weights``...) in the
        block's own task would wait for the block's end forever: that is an ``EngineError``
        (start it as a task instead)."""
        holder = _current_task_id()
        self._holders.append(holder)
        self._worker.hold()
        try:
            yield
        finally:
            self._worker.release()
            self._holders.remove(holder)

    async def _submit_and_wait(
        self, item: Request | WeightUpdate | CloseSession | FlushCache | PauseGeneration
    ) -> None:
        if self._holders and _current_task_id() in self._holders:
            what = _CALLS[type(item)]
            raise EngineError(
                f"{what} awaited inside admitted_together() in the same task would wait for "
                "the block's end: start it as a task inside the block instead"
            )
        self._worker.submit(item)
        assert item.done is not None
        try:
            await item.done.wait()
        except BaseException:  # cancelled: tell the worker to drop the item
            item.aborted = True
            self._worker.wake()
            raise

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


def _read_weights(source: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    try:
        folder = resolve_model(source)
    except Exception as exc:
        raise EngineError(f"cannot resolve weights {source!r}: {exc}") from exc
    return read_safetensors(folder)


@asynccontextmanager
async def open_embedded_engine(
    path: str | os.PathLike[str], options: EngineOptions | None = None, **overrides: Any
) -> AsyncIterator[EmbeddedEngine]:
    """Load the model in a thread, yield the engine, close it (aborting leftovers) on exit.
    ``overrides`` are ``EngineOptions`` fields (``max_batch_size=4``, ``num_threads=2``...)."""
    opts = (options or EngineOptions()).replace(**overrides)
    # "cuda" is the caller's current device (a torchrun rank's, after torch.cuda.set_device),
    # not the loading thread's: resolve it here
    opts = opts.replace(device=str(resolve_device(opts.device)))

    def load() -> EmbeddedEngine:
        return EmbeddedEngine.from_pretrained(path, opts)

    engine = await anyio.to_thread.run_sync(load)
    async with engine:
        yield engine
