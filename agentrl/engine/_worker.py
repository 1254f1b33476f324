"""The embedded engine's worker thread: it alone touches the model, the KV pool and the cache.

Loop: take new commands (requests, weight updates, session closes); drop cancelled requests;
unpin sessions past their TTL; handle a pending weight update (see ``EmbeddedEngine`` for the
``in_flight`` rule); let the scheduler plan a step (``_scheduler``), run the model on it, sample
for the rows that completed their context, finish requests that stopped; hand results back to
their event loops. Handing back never waits for a loop: each step posts its progress
(``on_tokens``) and finished items to a per-loop mailbox, and one callback scheduled in that loop
delivers whatever is there when it runs.

Devices: the model and the KV pool may live on a CUDA device (``EngineOptions.device``). The
thread makes that device current (Triton launches and CUDA events use the current device). Each
step reads back what the host needs of its logits in one transfer per kind (which also waits for
the step to finish): plain greedy rows' ids and logprobs, picked on the device for the whole step
(``_read_logits``), and the float32 rows that sample with a generator or feed a logprob query,
sampled on the CPU exactly as on a CPU-only engine. On a CUDA device a decode-only step replays a
captured CUDA graph when ``graphs`` accepts it (``_graphs``); every other step runs the forward.

Failures: an exception while sampling for one request fails that request only (``EngineError``);
an exception in the forward pass cannot be pinned on one row and fails every request of the
step. An unexpected error in the loop itself fails everything and marks the engine broken.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import sniffio  # how anyio tells which async library runs the current code
import torch
from anyio.lowlevel import EventLoopToken
from transformers import PreTrainedTokenizerBase

from agentrl._errors import EngineError, GenerationError
from agentrl._types import FinishReason, GenerateResult, SamplingParams

from ._batch import take_rows
from ._decode import AttentionKernelChooser
from ._graphs import DecodeGraphs
from ._model import CausalLM
from ._protocol import Output
from ._sampling import (
    check_logprob,
    draw_uniform,
    greedy_picks,
    match_stop_string,
    read_back,
    sample_token,
    sampled_picks,
)
from ._scheduler import Request, Scheduler, Step


@dataclass(eq=False)
class WeightUpdate:
    version: int
    state: dict[str, torch.Tensor]
    token: EventLoopToken
    done: anyio.Event
    aborted: bool = False
    error: EngineError | None = None


@dataclass(eq=False)
class CloseSession:
    session_id: str
    token: EventLoopToken
    done: anyio.Event
    aborted: bool = False
    error: EngineError | None = field(default=None)


@dataclass(eq=False)
class OpenSession:
    """Fire and forget: ordered before any request of the session, nobody waits on it."""

    session_id: str
    token: None = None
    done: None = None
    aborted: bool = False


@dataclass(eq=False)
class FlushCache:
    token: EventLoopToken
    done: anyio.Event
    aborted: bool = False
    flushed: bool = False
    """False when requests were running or waiting (nothing was flushed)."""


@dataclass(eq=False)
class PauseGeneration:
    """SGLang's ``/pause_generation`` (``mode`` ``in_place`` or ``retract``) and, with
    ``mode=None``, ``/continue_generation``."""

    mode: str | None
    token: EventLoopToken
    done: anyio.Event
    aborted: bool = False


Command = Request | WeightUpdate | OpenSession | CloseSession | FlushCache | PauseGeneration


@dataclass
class Counters:
    requests_done: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    steps: int = 0
    prefill_steps: int = 0
    prefill_step_seconds: float = 0.0
    decode_step_seconds: float = 0.0


def _call_soon(token: EventLoopToken, fn: Callable[[], None]) -> None:
    """Schedule ``fn`` in the event loop of ``token`` without waiting for it to run (asyncio's
    ``call_soon_threadsafe``, trio's ``run_sync_soon``); raises if that loop is gone. Under
    asyncio ``fn`` runs marked as asyncio code (sniffio), as ``anyio.from_thread`` would run it,
    so that anyio calls inside it (``anyio.current_time()``...) work."""
    native: Any = token.native_token
    if hasattr(native, "call_soon_threadsafe"):

        def in_asyncio() -> None:
            reset = sniffio.current_async_library_cvar.set("asyncio")
            try:
                fn()
            finally:
                sniffio.current_async_library_cvar.reset(reset)

        native.call_soon_threadsafe(in_asyncio)
    elif hasattr(native, "run_sync_soon"):
        native.run_sync_soon(fn)
    else:  # another backend: its blocking hop
        anyio.from_thread.run_sync(fn, token=token)


Progress = tuple[Request, Output]
"""One request's output after a step."""


class _Mailbox:
    """What the worker hands one event loop: each request's latest progress (``on_tokens``)
    and the finished items whose awaiting tasks to wake. The worker posts and goes on; one
    callback at a time is scheduled in the loop, and it takes everything posted until it runs
    (progress first, then the wake-ups), so a busy loop costs the worker nothing and gets
    fewer, larger updates."""

    def __init__(self, token: EventLoopToken) -> None:
        self.token = token
        self._lock = threading.Lock()
        self._progress: dict[int, Progress] = {}
        self._done: list[Command] = []
        self._scheduled = False

    @property
    def idle(self) -> bool:
        """Nothing scheduled (or its asyncio loop closed before running it): safe to drop."""
        native: Any = self.token.native_token
        if hasattr(native, "is_closed") and native.is_closed():
            return True
        with self._lock:
            return not self._scheduled

    def post(self, progress: list[Progress], done: list[Command]) -> None:
        with self._lock:
            for snapshot in progress:
                self._progress[id(snapshot[0])] = snapshot
            self._done.extend(done)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            _call_soon(self.token, self._deliver)
        except Exception:  # the loop is gone (RunFinishedError, a closed loop): nobody waits
            with self._lock:
                self._progress, self._done, self._scheduled = {}, [], False

    def _deliver(self) -> None:  # in the event loop
        with self._lock:
            progress, done = list(self._progress.values()), self._done
            self._progress, self._done, self._scheduled = {}, [], False
        for request, output in progress:
            if request.on_tokens is not None and not request.aborted:
                try:
                    request.on_tokens(output)
                except Exception:  # a callback's own failure must not keep others waiting
                    pass
        for item in done:
            if not item.aborted and item.done is not None:
                item.done.set()


MAILBOXES_KEPT = 16
"""Idle mailboxes of event loops past this many are dropped (tests start a loop per test)."""


class _Identity(dict[int, int]):
    """``where`` for a host copy of every logits row: row ``r`` is at ``r``."""

    def __missing__(self, row: int) -> int:
        return row


class Worker:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: PreTrainedTokenizerBase,
        scheduler: Scheduler,
        *,
        num_threads: int,
        in_flight: str = "finish",
        weight_version: int = 0,
        attention: AttentionKernelChooser | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        """What runs the attention of uncaptured steps (``None``: SDPA)."""
        self.graphs = graphs
        """Captured decode steps (``_graphs``): a step they accept replays one."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.num_threads = num_threads
        self.in_flight = in_flight
        self.weight_version = weight_version
        self.batched_sampling = model.device.type != "cpu"
        """Greedy and sampled rows pick their ids where the logits are, all at once
        (``_read_logits``); on the CPU row-by-row picks are faster (a ``[vocab]`` reduction runs
        in cache) and give the same tokens."""
        self.counters = Counters()
        self.broken: BaseException | None = None
        self._cond = threading.Condition()
        self._inbox: collections.deque[Command] = collections.deque()
        self._holds = 0
        """Open ``hold``s: while any is, the inbox is left for later (running work steps on)."""
        self._closing = False
        self.paused = False
        """Between a ``PauseGeneration`` and its ``continue``: no step runs; requests queue,
        aborts and weight updates are handled."""
        self._updates: collections.deque[WeightUpdate] = collections.deque()
        self._outbox: list[Command] = []
        """Finished items, notified once the bookkeeping is consistent again."""
        self._progressed: list[Request] = []
        """Unfinished requests with an ``on_tokens`` callback that sampled a token this step."""
        self._mailboxes: dict[EventLoopToken, _Mailbox] = {}
        self.thread = threading.Thread(
            target=self._main, name="agentrl-embedded-engine", daemon=True
        )

    # --- called from event-loop threads ---------------------------------------------------------

    def submit(self, item: Command) -> None:
        with self._cond:
            if self._closing:
                raise EngineError("engine is closed")
            self._inbox.append(item)
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def hold(self) -> None:
        """Leave what is submitted in the inbox until the matching ``release``, so that items
        submitted one by one from an event loop (a batch request's samples) reach the scheduler
        together and are admitted in one step, instead of split across steps by when this
        thread got the GIL. Requests already running go on stepping meanwhile."""
        with self._cond:
            self._holds += 1

    def release(self) -> None:
        with self._cond:
            self._holds -= 1
            if not self._holds:
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    def waiting_requests(self) -> list[Request]:
        """Queued and waiting requests, read from another thread: under the lock that moving a
        request from the inbox to the queue holds, so none is seen in both or neither."""
        with self._cond:
            queued = [i for i in self._inbox if isinstance(i, Request)]
            return [*self.scheduler.waiting, *queued]

    # --- the worker thread ----------------------------------------------------------------------

    def _main(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            if self.model.device.type == "cuda":
                torch.cuda.set_device(self.model.device)
            with torch.inference_mode():
                while self._iterate():
                    pass
        except BaseException as exc:  # a bug in the loop: fail everything, refuse new work
            self.broken = exc
            self._fail_all(GenerationError(f"embedded engine worker crashed: {exc!r}"))
            raise

    def _iterate(self) -> bool:
        sessions = self.scheduler.sessions
        with self._cond:
            while not ((self._inbox and not self._holds) or self._closing or self._has_work()):
                if not self._cond.wait(timeout=sessions.expire()):
                    break  # a TTL ran out
            while self._inbox and not self._holds:
                item = self._inbox.popleft()
                match item:
                    case Request():
                        self.scheduler.add(item)
                    case WeightUpdate():
                        self._updates.append(item)
                    case OpenSession():
                        sessions.open(item.session_id)
                    case CloseSession():
                        sessions.close(item.session_id)
                        self._outbox.append(item)
                    case FlushCache():
                        s = self.scheduler
                        item.flushed = not (s.running or s.waiting)
                        if item.flushed:
                            s.flush()
                        self._outbox.append(item)
                    case PauseGeneration():
                        self.paused = item.mode is not None
                        if item.mode == "retract":  # their KV goes; they keep their output
                            self.scheduler.interrupt_in_flight()
                        self._outbox.append(item)
            closing = self._closing
        if closing:
            self._fail_all(None)
            return False
        self._drop_aborted()
        sessions.expire()
        if self._updates:
            self._handle_updates()
        step = None if self.paused else self.scheduler.plan()
        if step is not None:
            self._run(step)
        for request in self.scheduler.closed:
            self._deliver(request)
        self.scheduler.closed.clear()
        self._flush()
        return True

    def _flush(self) -> None:
        """Post this step's progress and finished items to their event loops (no waiting)."""
        progressed, self._progressed = self._progressed, []
        outbox, self._outbox = self._outbox, []
        progress: dict[EventLoopToken, list[Progress]] = {}
        done: dict[EventLoopToken, list[Command]] = {}
        for request in progressed:
            if request.result is None and request.error is None and request.token is not None:
                if not request.aborted:  # snapshots: this thread goes on appending
                    snapshot = (request, request.output_so_far())
                    progress.setdefault(request.token, []).append(snapshot)
        for item in outbox:
            if item.token is not None and item.done is not None and not item.aborted:
                done.setdefault(item.token, []).append(item)
        for token in progress.keys() | done.keys():
            mailbox = self._mailboxes.get(token)
            if mailbox is None:
                if len(self._mailboxes) >= MAILBOXES_KEPT:
                    self._mailboxes = {t: m for t, m in self._mailboxes.items() if not m.idle}
                mailbox = self._mailboxes[token] = _Mailbox(token)
            mailbox.post(progress.get(token, []), done.get(token, []))

    def _has_work(self) -> bool:
        s = self.scheduler
        if self.paused:  # no step runs: only updates and aborted requests to handle
            return bool(self._updates) or any(r.aborted for r in (*s.running, *s.waiting))
        return bool(s.running or s.waiting or self._updates)

    def _drop_aborted(self) -> None:
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            if request.aborted:
                self.scheduler.drop(request)
                self.counters.requests_aborted += 1
        self._updates = collections.deque(u for u in self._updates if not u.aborted)
        if not self._updates:  # a cancelled update holds new requests no more
            self.scheduler.hold_new = False

    def _handle_updates(self) -> None:
        """Apply pending updates now, or hold new requests until in-flight ones finish (while
        paused they cannot finish: ``finish`` acts as ``partial`` then, as in SGLang, where an
        update between a pause and its continue goes ahead and the paused requests continue on
        the new weights)."""
        if self.in_flight == "abort":
            self.scheduler.abort_in_flight()
        elif self.in_flight == "partial" or self.paused:
            self.scheduler.interrupt_in_flight()
        elif self.scheduler.in_flight():
            self.scheduler.hold_new = True
            return
        self.scheduler.flush()
        while self._updates:
            update = self._updates.popleft()
            try:
                self.model.load_state_dict(update.state, check=False)  # checked by the caller
                self.weight_version = update.version
            except Exception as exc:
                update.error = exc if isinstance(exc, EngineError) else EngineError(repr(exc))
            self._outbox.append(update)
        self.scheduler.hold_new = False

    def _run(self, step: Step) -> None:
        started = time.perf_counter()
        try:
            self._run_step(step)
        finally:  # the step's picks were read back, so on a GPU this includes its device time
            seconds = time.perf_counter() - started
            c = self.counters
            c.steps += 1
            if all(count == 1 for _, count in step.rows):
                c.decode_step_seconds += seconds
            else:
                c.prefill_steps += 1
                c.prefill_step_seconds += seconds

    def _run_step(self, step: Step) -> None:
        for request, _ in step.rows:
            if not request.started:
                request.weight_version = self.weight_version
        try:
            graphs = self.graphs
            if graphs is not None and graphs.accepts(step.packed):
                logits = graphs.run(step.packed)
            else:
                pool = self.scheduler.kv.pool
                logits = self.model.forward(step.forward_batch(), pool, self.attention)
            picks, host, where = self._read_logits(step, logits)
        except Exception as exc:
            for request, _ in step.rows:
                self._fail(request, exc)
            return
        self.scheduler.advance(step)
        for request, _ in step.rows:
            if request.closing and request.kv is not None:
                self.scheduler.finish(request)  # its last token's KV is in: pin it
                self._deliver(request)
        decode_rows = sum(count == 1 for _, count in step.rows)
        if decode_rows:
            self.counters.decode_steps += 1
            self.counters.decode_rows += decode_rows
        for request, first, count, row in step.inputs:
            assert request.logprobs is not None
            at = where[row]
            try:
                request.logprobs.add_input(first, host[at : at + count], request.tokens)
            except Exception as exc:
                self._fail(request, exc)
        for request, row in zip(step.sampled, step.sample_rows, strict=True):
            if request.error is not None:
                continue  # failed above
            try:
                pick = picks.get(row)
                finished = self._accept(request, host[where[row]] if pick is None else pick)
            except Exception as exc:
                self._fail(request, exc)
                continue
            if not finished:
                if request.on_tokens is not None:
                    self._progressed.append(request)
                continue
            unfed = request.kv is not None and request.kv.length < len(request.tokens)
            if request.session is not None and request.result is not None and unfed:
                # SGLang keeps a finished turn's KV through its last sampled token: feed that
                # token once more (next step, no sampling) so the next turn reuses all of it
                # (a prefill-only turn sampled none: its KV covers its context already)
                request.closing = True
                continue
            self.scheduler.finish(request)
            self._deliver(request)

    def _read_logits(
        self, step: Step, logits: torch.Tensor
    ) -> tuple[dict[int, tuple[int, float]], torch.Tensor, dict[int, int]]:
        """What the host needs of this step's ``logits`` (on the model's device): ``picks``,
        the batched ``(id, logprob)`` per logits row (``batched_sampling`` only), and the
        float32 CPU copy ``host`` of every other row the step reads, ``where[row]`` being the
        row's index in ``host`` (input-logprob ranges stay contiguous).

        Rows without a ``LogprobQuery`` need only their id and logprob, not their ``[vocab]``
        row: greedy rows (``greedy_picks``) and sampled ones (``sampled_picks``, each with the
        uniform its request's generator draws for this token) are picked where the logits are,
        all at once, and ``2 * rows`` numbers come back in one copy. Rows that feed a
        ``LogprobCollector`` are copied whole (one transfer) and sampled on the CPU.
        """
        picks: dict[int, tuple[int, float]] = {}
        if not self.batched_sampling:
            host = logits.cpu()
            return picks, host, _Identity()
        greedy: list[int] = []
        sampled: list[int] = []
        params: list[SamplingParams] = []
        uniforms: list[float] = []
        for request, row in zip(step.sampled, step.sample_rows, strict=True):
            sampling = request.sampling
            if sampling.max_new_tokens == 0 or request.logprobs is not None:
                continue
            if sampling.temperature == 0:
                greedy.append(row)
            else:
                sampled.append(row)
                params.append(sampling)
                uniforms.append(draw_uniform(request.generator))
        wanted: list[int] = []
        where: dict[int, int] = {}
        for _, _, count, first in step.inputs:
            for row in range(first, first + count):
                where[row] = len(wanted)
                wanted.append(row)
        chosen = {*greedy, *sampled}
        for row in step.sample_rows:
            if row not in chosen and row not in where:
                where[row] = len(wanted)
                wanted.append(row)
        if chosen:
            parts = []
            if greedy:
                parts.append(greedy_picks(take_rows(logits, greedy)))
            if sampled:
                parts.append(sampled_picks(take_rows(logits, sampled), params, uniforms))
            ids, logprobs = read_back(*(torch.cat(values) for values in zip(*parts, strict=True)))
            rows = greedy + sampled
            picks = dict(zip(rows, zip(ids, logprobs, strict=True), strict=True))
        return picks, take_rows(logits, wanted).cpu(), where

    def _accept(self, request: Request, logits: torch.Tensor | tuple[int, float]) -> bool:
        """Sample the next token of ``request`` from its logits row (CPU, ``[vocab]``), or take
        the ``(id, logprob)`` a batched pick made; finish it (and return True) on a stop
        or limit."""
        if request.sampling.max_new_tokens == 0:  # prefill only (input logprobs)
            if request.logprobs is not None:
                request.logprobs.input_done = True
            return self._finish(request, "length", None)
        if isinstance(logits, tuple):
            token, logprob = logits
            check_logprob(token, logprob)
        else:
            token, logprob = sample_token(logits, request.sampling, request.generator)
            if request.logprobs is not None:
                request.logprobs.add_output(logits, request.sampling.temperature)
        request.tokens.append(token)
        request.output_logprobs.append(logprob)
        request.token_versions.append(self.weight_version)
        self.counters.tokens_generated += 1
        sampling = request.sampling
        output = request.output_ids
        if token in request.stop_ids:
            return self._finish(request, "stop", token)
        if sampling.stop and (hit := match_stop_string(self.tokenizer, output, sampling.stop)):
            return self._finish(request, "stop", hit)
        if len(output) >= sampling.max_new_tokens or len(request.tokens) >= request.limit:
            return self._finish(request, "length", None)
        return False

    def _finish(self, request: Request, reason: FinishReason, matched: int | str | None) -> bool:
        request.result = GenerateResult(
            token_ids=request.output_ids,
            logprobs=request.output_logprobs,
            finish_reason=reason,
            matched_stop=matched,
            prompt_tokens=len(request.input_ids),
            cached_tokens=request.cached_tokens,
            weight_version=request.token_versions[0]
            if request.token_versions
            else request.weight_version,
            token_versions=list(request.token_versions),
            details=request.logprobs.details() if request.logprobs is not None else None,
        )
        return True

    def _deliver(self, request: Request) -> None:
        """Hand a finished request's result back to its caller."""
        assert request.result is not None
        if request.result.finish_reason != "abort":
            self.counters.requests_done += 1
        self._outbox.append(request)

    def _fail(self, request: Request, exc: BaseException) -> None:
        """End ``request`` with ``exc`` (the request was checked when it was submitted: what
        fails while it runs is the engine's failure, a ``GenerationError``)."""
        if isinstance(exc, GenerationError):
            request.error = exc
        else:
            why = str(exc) if isinstance(exc, EngineError) else repr(exc)
            request.error = GenerationError(f"generation failed: {why}")
            request.error.__cause__ = exc
        self.scheduler.drop(request)
        self.counters.requests_failed += 1
        self._outbox.append(request)

    def _fail_all(self, error: EngineError | None) -> None:
        """On close (``error`` None): requests end with ``finish_reason="abort"``; else fail."""
        with self._cond:
            self._closing = True
            pending = list(self._inbox)
            self._inbox.clear()
        s = self.scheduler
        requests = [*s.running, *s.waiting]
        s.running, s.waiting = [], []
        others: list[Command] = [*self._updates]
        self._updates.clear()
        for item in pending:
            (requests if isinstance(item, Request) else others).append(item)  # type: ignore[arg-type]
        for request in requests:
            if request.closing:  # finished already, waiting for its last token's KV
                self._deliver(request)
            elif error is None:
                self.counters.requests_aborted += 1
                self._finish(request, "abort", None)
                self._deliver(request)
            else:
                request.error = error
                self.counters.requests_failed += 1
                self._outbox.append(request)
        for item in others:
            if isinstance(item, WeightUpdate):
                item.error = error or EngineError("engine closed before the weight update")
            self._outbox.append(item)
        self._flush()
