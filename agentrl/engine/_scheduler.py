"""Continuous batching over the paged KV pool: which tokens each step computes.

Every step (``plan``) packs, in this order, under ``max_step_tokens`` and ``max_batch_size``:

1. one token for every running request in decode (decode never waits behind prefill);
2. the next prefill chunk of running requests still prefilling, oldest first (chunked
   prefill: a long prompt spreads over several steps while decodes continue);
3. new requests from the queue, strictly first come first served: the head is admitted when
   the KV blocks for its whole context (minus what its session or the radix tree already
   holds) plus one block of headroom per running request can be found, else admission stops
   for this step (no overtaking, so no starvation).

Memory, when a step needs blocks: take free blocks, else evict unlocked radix entries (LRU),
else unpin idle sessions (LRU, see ``_session``), else *preempt* the newest running request:
its computed full pages go to the radix tree (so resuming is cheap if they survive), its private
blocks are freed and it re-queues at its original place, to recompute what was lost and continue
with the same sampling generator. A queue head that shares pages with a request still
prefilling waits for those pages to reach the tree, then copies the running sibling's partial
last page too (a GRPO group's prompt is computed once, to the last token).

Weight updates (``in_flight`` rule, see ``EmbeddedEngine``): ``hold_new`` stops admitting
requests that have not started; ``abort_in_flight`` throws away in-flight work so it restarts
from scratch; ``interrupt_in_flight`` drops only the running requests' KV, keeping what they
sampled, so they re-queue, recompute their whole context (prompt and output so far) on the new
weights through the ordinary admission and prefill path, and continue; ``flush`` drops all
cached and pinned KV once nothing runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import anyio
import torch
from anyio.lowlevel import EventLoopToken

from agentrl._errors import EngineError
from agentrl._types import GenerateResult, SamplingParams

from ._batch import Row, build_forward_batch, extra_positions
from ._logprobs import LogprobCollector
from ._model import ForwardBatch
from ._protocol import Output
from ._sampling import make_generator
from ._seq import KVManager, SequenceKV
from ._session import SessionTable


@dataclass(eq=False)
class Request:
    """One generate call. ``tokens`` is the live context: ``input_ids`` then every sampled id."""

    input_ids: list[int]
    sampling: SamplingParams
    limit: int
    """Most tokens (prompt + generated) the request may reach."""
    seed: int
    token: EventLoopToken | None = None
    done: anyio.Event | None = None
    session: str | None = None
    arrival: int = 0
    aborted: bool = False
    """Set by the caller when its task is cancelled; the worker then drops the request."""
    tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    """The weight version that sampled each output token."""
    generator: torch.Generator = field(default_factory=torch.Generator)
    runs: int = 0
    """How many times its output started from nothing (``restart``; 1 once created)."""
    weight_version: int = 0
    cached_tokens: int = 0
    kv: SequenceKV | None = None
    closing: bool = False
    """Finished (``result`` set): its last sampled token is fed once more, without sampling,
    so its KV covers the whole context before it is pinned in its session."""
    logprobs: LogprobCollector | None = None
    """Input-token, top-k and chosen-id logprobs asked for (``LogprobQuery``), if any."""
    result: GenerateResult | None = None
    error: EngineError | None = None
    on_tokens: Callable[[Output], None] | None = None
    """Called in the caller's event loop with the ``Output`` so far, after each step that
    sampled a token for this request and did not finish it (streaming, aborts)."""

    stop_ids: frozenset[int] = frozenset()
    """``sampling.stop_token_ids`` as a set: looked up after every sampled token."""

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.sampling.stop_token_ids)
        self.restart()

    def restart(self) -> None:
        """Forget all output (a weight update aborted the request): start over, same seed."""
        self.tokens = list(self.input_ids)
        self.output_logprobs = []
        self.token_versions = []
        self.runs += 1  # after both lists: see output_so_far
        self.generator = make_generator(self.seed)
        if self.logprobs is not None:
            self.logprobs.reset_input()
            self.logprobs.reset_output()

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.input_ids) :]

    def output_so_far(self) -> Output:
        """Output ids, their logprobs, the ``LogprobDetails``, the weight versions so far (all
        equally long) and the cached tokens, safe to call from another thread while the worker
        runs this request (it collects a token's details, then appends the id, its logprob and
        its version; each slice is taken whole under the interpreter lock, the versions first;
        a restart in between is seen and the read taken again, so all are of one run)."""
        while True:
            run = self.runs
            versions = self.token_versions[:]
            logprobs = self.output_logprobs[:]
            ids = self.output_ids
            cached = self.cached_tokens
            n = min(len(ids), len(logprobs), len(versions))
            collector = self.logprobs
            pending = collector is None or collector.input_pending  # its prefill has not ended
            details = None if pending else collector.details(n)
            if self.runs == run:
                return Output(ids[:n], logprobs[:n], details, tuple(versions[:n]), cached)

    @property
    def started(self) -> bool:
        return len(self.tokens) > len(self.input_ids)


class Step(NamedTuple):
    packed: list[Row]
    """The step's rows as the forward sees them (decode rows first)."""
    rows: list[tuple[Request, int]]
    """Each request and how many tokens it feeds."""
    sampled: list[Request]
    """Requests that get a next-token distribution."""
    sample_rows: list[int]
    """The ``logits`` row of each of ``sampled``."""
    inputs: list[tuple[Request, int, int, int]]
    """``(request, first position, count, first logits row)``: logits of input positions a
    ``LogprobQuery`` asked for."""
    block_size: int
    device: torch.device

    def forward_batch(self) -> ForwardBatch:
        """The packed ``ForwardBatch`` of ``packed`` on ``device`` (built on demand: a step
        replayed from a captured graph needs none)."""
        return build_forward_batch(self.packed, self.block_size, self.device)


@dataclass
class SchedulerCounters:
    prefill_tokens: int = 0
    """Tokens computed that were not a just-sampled token fed back (prompts, recomputes)."""
    decode_tokens: int = 0
    cached_tokens: int = 0
    """Tokens whose KV a (re)admission reused instead of computing."""
    preemptions: int = 0
    interruptions: int = 0
    """Running requests a weight update moved onto the new weights (``interrupt_in_flight``)."""
    deferred: int = 0
    steps: int = 0


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        sessions: SessionTable,
        *,
        max_batch_size: int,
        max_step_tokens: int,
    ) -> None:
        self.kv = kv
        self.sessions = sessions
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # sorted by arrival
        self.hold_new = False
        self.closed: list[Request] = []
        """Closing requests finished without their last token's KV (preempted, or moved by a
        weight update); the worker hands their results back."""
        self.counters = SchedulerCounters()
        self._arrivals = 0

    @property
    def block_size(self) -> int:
        return self.kv.pool.block_size

    def add(self, request: Request) -> None:
        self._arrivals += 1
        request.arrival = self._arrivals
        self.waiting.append(request)

    # --- one step -------------------------------------------------------------------------------

    def plan(self) -> Step | None:
        """Choose this step's rows (may preempt); None when there is nothing to compute."""
        budget = self.max_step_tokens
        rows: list[tuple[Request, int]] = []
        page = self.block_size
        for request in list(self.running):
            seq = request.kv
            if seq is None or len(request.tokens) - seq.length != 1:
                continue  # preempted meanwhile, or still prefilling
            # most steps the token fits the last block: no call to reserve one
            if len(seq.blocks) * page > seq.length or self._reserve(request, seq.length + 1):
                rows.append((request, 1))
                budget -= 1
        for request in self.running:
            assert request.kv is not None
            left = len(request.tokens) - request.kv.length
            if left > 1 and budget > 0:
                rows.append((request, min(left, budget)))
                budget -= rows[-1][1]
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_batch_size:
                break
            if self.hold_new and not request.started:
                continue  # a weight update waits for started requests only
            if not self._admit(request):
                break
            assert request.kv is not None
            rows.append((request, min(len(request.tokens) - request.kv.length, budget)))
            budget -= rows[-1][1]
        if not rows:
            return None
        rows.sort(key=lambda row: row[1] != 1)  # decode-like rows first, order kept otherwise
        packed, sampled, sample_rows, inputs = [], [], [], []
        logits_rows = 0
        for request, count in rows:
            assert request.kv is not None
            start = request.kv.length
            sample = start + count == len(request.tokens) and not request.closing
            extra = request.logprobs.input_positions if request.logprobs else (0, 0)
            row = Row(request.tokens, start, count, request.kv.blocks, sample, extra)
            packed.append(row)
            positions = extra_positions(row) if extra[1] > extra[0] else None
            if positions:
                inputs.append((request, positions.start, len(positions), logits_rows))
                logits_rows += len(positions)
            if sample:
                sampled.append(request)
                sample_rows.append(logits_rows)
                logits_rows += 1
        pool = self.kv.pool
        return Step(packed, rows, sampled, sample_rows, inputs, pool.block_size, pool.device)

    def advance(self, step: Step) -> None:
        """Record that ``step`` ran: its tokens now have KV; full prefill pages go to the tree."""
        self.counters.steps += 1
        for request, count in step.rows:
            assert request.kv is not None
            fed_back = count == 1 and request.kv.length >= len(request.input_ids)
            if fed_back:
                self.counters.decode_tokens += 1
            else:
                self.counters.prefill_tokens += count
            request.kv.length += count
            if not fed_back:
                self.kv.commit(request.kv)

    # --- request ends ---------------------------------------------------------------------------

    def finish(self, request: Request) -> None:
        """The request is complete: pin its KV in its session, or hand it to the radix tree."""
        self.running.remove(request)
        seq, request.kv = request.kv, None
        assert seq is not None
        self.kv.trim(seq)
        if request.session is not None:
            seq.tokens = request.tokens[: seq.length]
            self.kv.commit(seq)
            if self.sessions.pin(request.session, seq):
                return
        self.kv.release(seq)

    def drop(self, request: Request) -> None:
        """Remove an aborted or failed request wherever it is, releasing its KV."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.kv is not None:
            self.kv.release(request.kv)
            request.kv = None

    # --- weight updates -------------------------------------------------------------------------

    def in_flight(self) -> bool:
        """Any request that computed on the current weights and has not finished."""
        return bool(self.running) or any(r.started for r in self.waiting)

    def abort_in_flight(self) -> None:
        """Throw away every running request's work and output; they re-queue from scratch."""
        for request in list(self.running):
            self._requeue(request, cache=False, restart=True)
        for request in self.waiting:
            if request.started:
                request.restart()

    def interrupt_in_flight(self) -> None:
        """Drop every running request's KV (computed by the weights being replaced) but keep
        its output, logprobs and generator: it re-queues at its place and recomputes its whole
        context on the next weights. Waiting requests hold no KV and need nothing."""
        for request in list(self.running):
            closing = request.closing  # finished already: pinned as it is, not interrupted
            self._requeue(request, cache=False, restart=False)
            self.counters.interruptions += not closing

    def flush(self) -> None:
        """Drop every cached and pinned KV block (nothing may be running)."""
        assert not self.running, "flush while requests run"
        self.sessions.unpin_all()
        if self.kv.tree is not None:
            self.kv.tree.reset()
        pool = self.kv.pool
        assert pool.num_free == pool.num_blocks, "KV blocks leaked"

    # --- internals ------------------------------------------------------------------------------

    def _admit(self, request: Request) -> bool:
        """Give the queue head its KV (reused prefix + blocks for the rest) or return False."""
        if self._should_defer(request):
            self.counters.deferred += 1
            return False
        pinned, limit = None, None
        collector = request.logprobs
        if collector is not None and collector.input_pending:
            # input logprobs need the logits of every reported position: reuse at most the
            # tokens before the first one (SGLang limits its prefix match the same way)
            collector.reset_input()
            limit = collector.input_positions[0]
        elif request.session is not None:
            pinned = self.sessions.take(request.session, request.tokens)
        if pinned is not None:
            pinned.tokens = request.tokens  # the live context, which extends the pinned tokens
        seq = pinned if pinned is not None else self.kv.match(request.tokens, limit)
        tail = self._sibling_tail(request, seq) if pinned is None and limit is None else None
        need = self.kv.pool.blocks_for(len(request.tokens)) - len(seq.blocks)
        assert need <= self.kv.pool.num_blocks, "request longer than the pool"
        if not self._make_room(need + len(self.running)):
            if pinned is not None and request.session is not None:
                pinned.tokens = request.tokens[: pinned.length]
                self.sessions.restore(request.session, pinned)
            else:
                self.kv.release(seq)
            return False
        self.kv.grow(seq, len(request.tokens))
        if tail is not None:  # copy the sibling's partial page: those tokens need no compute
            block, extra = tail
            self.kv.pool.copy_block(block, seq.blocks[seq.length // self.block_size])
            seq.length += extra
        request.kv = seq
        if not request.started:
            request.cached_tokens = seq.length
        self.counters.cached_tokens += seq.length
        self.waiting.remove(request)
        bisect.insort(self.running, request, key=lambda r: r.arrival)
        return True

    def _should_defer(self, request: Request) -> bool:
        """True when a request still prefilling will soon put more of our prefix in the tree."""
        if self.kv.tree is None:
            return False
        page = self.block_size
        usable = (len(request.tokens) - 1) // page  # whole pages a match could reuse
        if request.logprobs is not None and request.logprobs.input_pending:
            usable = min(usable, request.logprobs.input_positions[0] // page)
        tokens = request.tokens
        for other in self.running:
            seq = other.kv
            if seq is None or len(other.tokens) - seq.length <= 1:
                continue
            # it would put more of our prefix in the tree than it has there: we share at least
            # one page past its shared ones (one slice compare; admitting a batch of B requests
            # makes B^2 / 2 of these)
            need = seq.shared + 1
            if need <= usable and tokens[: need * page] == other.tokens[: need * page]:
                return True
        return False

    def _sibling_tail(self, request: Request, seq: SequenceKV) -> tuple[int, int] | None:
        """A running request's block holding the page after the tree match (its lock keeps the
        block alive), and how many of its tokens we share: the tree caches whole pages only and
        a match leaves the last token to compute, so a GRPO sibling would otherwise recompute
        up to a page of the prompt."""
        page = self.block_size
        index, limit = seq.length // page, len(request.tokens) - 1
        if self.kv.tree is None or seq.length % page or seq.length >= limit:
            return None
        tokens, start = request.tokens, seq.length
        for other in self.running:
            theirs = other.kv
            if theirs is None or len(theirs.blocks) <= index:
                continue
            end = min(theirs.length, limit, start + page)  # what their page could give us
            if end <= start or tokens[: start + 1] != other.tokens[: start + 1]:
                continue
            common = start + 1
            while common < end and tokens[common] == other.tokens[common]:
                common += 1
            return theirs.blocks[index], common - start
        return None

    def _reserve(self, request: Request, tokens: int) -> bool:
        """Make ``request``'s blocks cover ``tokens`` tokens, preempting newer requests (or
        ``request`` itself, returning False) when memory is short."""
        seq = request.kv
        assert seq is not None
        need = self.kv.pool.blocks_for(tokens) - len(seq.blocks)
        while need > 0 and not self._make_room(need):
            victim = self.running[-1]
            assert len(self.running) > 1, f"the KV pool cannot hold one request of {tokens}"
            self._requeue(victim, cache=True, restart=False)
            self.counters.preemptions += 1
            if victim is request:
                return False
        self.kv.grow(seq, tokens)
        return True

    def _make_room(self, blocks: int) -> bool:
        while not self.kv.ensure_free(blocks):
            if not self.sessions.unpin_for_memory():
                return False
        return True

    def _requeue(self, request: Request, *, cache: bool, restart: bool) -> None:
        """Back to the queue at its arrival place, its KV released (full pages cached in the
        tree if ``cache``); ``restart`` also forgets its output."""
        if request.closing:  # finished: pin what it has rather than recompute anything
            self.finish(request)
            self.closed.append(request)
            return
        self.running.remove(request)
        assert request.kv is not None
        self.kv.release(request.kv, cache=cache)
        request.kv = None
        if restart:
            request.restart()
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)
