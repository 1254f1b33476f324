"""The embedded engine's worker thread: it alone touches the model.

Loop: take new commands; drop aborted requests; apply a weight update once no request is running
(new requests wait meanwhile, so in-flight requests finish on the weights they started with);
admit waiting requests up to ``max_batch_size`` (each prefilled alone); run one batched decode
step; hand finished requests back to their event loops.

Failures: an exception while prefilling or sampling for one request fails that request only
(``EngineError``); an exception in a batched decode step cannot be pinned on one row and fails
every running request. An unexpected error in the loop itself fails everything and marks the
engine broken.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import torch
from anyio.lowlevel import EventLoopToken
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agentrl._errors import EngineError
from agentrl._types import FinishReason, GenerateResult, SamplingParams

from ._batch import BatchedKV, prefill
from ._sampling import sample_token


@dataclass(eq=False)
class Request:
    """One generate call as the worker sees it; ``done`` is set in the caller's event loop."""

    input_ids: list[int]
    sampling: SamplingParams
    limit: int
    """Most tokens (prompt + generated) the request may reach."""
    generator: torch.Generator
    token: EventLoopToken
    done: anyio.Event
    aborted: bool = False
    """Set by the caller when its task is cancelled; the worker then drops the request."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    weight_version: int = 0
    result: GenerateResult | None = None
    error: EngineError | None = None


@dataclass(eq=False)
class WeightUpdate:
    version: int
    state: dict[str, torch.Tensor]
    token: EventLoopToken
    done: anyio.Event
    aborted: bool = False
    error: EngineError | None = None


@dataclass
class Counters:
    requests_done: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0


def _notify(item: Request | WeightUpdate) -> None:
    """Wake the awaiting task (blocks briefly until its event loop runs ``event.set``)."""
    if item.aborted:
        return  # the awaiting task is gone; its loop may be gone too
    try:
        anyio.from_thread.run_sync(item.done.set, token=item.token)
    except Exception:  # RunFinishedError and friends: nobody is waiting any more
        pass


class Worker:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int,
        num_threads: int,
        weight_version: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
        self.weight_version = weight_version
        self.counters = Counters()
        self.broken: BaseException | None = None
        self._cond = threading.Condition()
        self._inbox: collections.deque[Request | WeightUpdate] = collections.deque()
        self._closing = False
        self._waiting: collections.deque[Request] = collections.deque()
        self._updates: collections.deque[WeightUpdate] = collections.deque()
        self._running: list[Request] = []
        self._kv = BatchedKV()
        self._outbox: list[Request | WeightUpdate] = []
        """Finished items, notified once the batch bookkeeping is consistent again."""
        self.thread = threading.Thread(
            target=self._main, name="agentrl-embedded-engine", daemon=True
        )

    # --- called from event-loop threads ---------------------------------------------------------

    def submit(self, item: Request | WeightUpdate) -> None:
        with self._cond:
            if self._closing:
                raise EngineError("engine is closed")
            self._inbox.append(item)
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting) + len(self._inbox)

    # --- the worker thread ----------------------------------------------------------------------

    def _main(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            with torch.inference_mode():
                while self._iterate():
                    pass
        except BaseException as exc:  # a bug in the loop: fail everything, refuse new work
            self.broken = exc
            self._fail_all(EngineError(f"embedded engine worker crashed: {exc!r}"))
            raise

    def _iterate(self) -> bool:
        with self._cond:
            while not (self._inbox or self._closing or self._has_work()):
                self._cond.wait()
            while self._inbox:
                item = self._inbox.popleft()
                (self._updates if isinstance(item, WeightUpdate) else self._waiting).append(item)
            closing = self._closing
        if closing:
            self._fail_all(None)
            return False
        self._drop_aborted()
        if self._updates:
            if not self._running:
                self._apply_updates()
        else:
            self._admit()
            self._flush()
        if self._running:
            self._decode_step()
            self._flush()
        return True

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for item in outbox:
            _notify(item)

    def _has_work(self) -> bool:
        return bool(self._running or self._updates or self._waiting)

    def _drop_aborted(self) -> None:
        if any(r.aborted for r in self._running):
            keep = [i for i, r in enumerate(self._running) if not r.aborted]
            self.counters.requests_aborted += len(self._running) - len(keep)
            self._running = [self._running[i] for i in keep]
            self._kv.keep(keep)
        for request in [r for r in self._waiting if r.aborted]:
            self._waiting.remove(request)
            self.counters.requests_aborted += 1
        self._updates = collections.deque(u for u in self._updates if not u.aborted)

    def _apply_updates(self) -> None:
        while self._updates:
            update = self._updates.popleft()
            try:
                load_into(self.model, update.state)
                self.weight_version = update.version
            except Exception as exc:
                update.error = exc if isinstance(exc, EngineError) else EngineError(repr(exc))
            _notify(update)  # no request is running: nothing to keep consistent

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch_size:
            request = self._waiting.popleft()
            request.weight_version = self.weight_version
            try:
                cache, logits = prefill(self.model, request.input_ids)
                self.counters.prefill_tokens += len(request.input_ids)
                finished = self._accept(request, logits)
            except Exception as exc:
                self._fail(request, exc)
                continue
            if not finished:
                self._kv.append(cache, len(request.input_ids))
                self._running.append(request)

    def _decode_step(self) -> None:
        rows = self._running
        tokens = [r.output_ids[-1] for r in rows]
        positions = [len(r.input_ids) + len(r.output_ids) - 1 for r in rows]
        try:
            logits = self._kv.decode(self.model, tokens, positions)
        except Exception as exc:
            for request in rows:
                self._fail(request, exc)
            self._running = []
            self._kv.clear()
            return
        self.counters.decode_steps += 1
        self.counters.decode_rows += len(rows)
        keep = []
        for i, request in enumerate(rows):
            try:
                finished = self._accept(request, logits[i])
            except Exception as exc:
                self._fail(request, exc)
                continue
            if not finished:
                keep.append(i)
        self._running = [rows[i] for i in keep]
        self._kv.keep(keep)

    def _accept(self, request: Request, logits: torch.Tensor) -> bool:
        """Sample the next token of ``request``; finish it (and return True) on a stop or limit."""
        token, logprob = sample_token(logits, request.sampling, request.generator)
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        self.counters.tokens_generated += 1
        sampling = request.sampling
        if token in sampling.stop_token_ids:
            return self._finish(request, "stop", token)
        if sampling.stop:
            text = self.tokenizer.decode(request.output_ids, skip_special_tokens=False)
            found = [(text.find(s), i) for i, s in enumerate(sampling.stop) if s in text]
            if found:
                return self._finish(request, "stop", sampling.stop[min(found)[1]])
        if len(request.output_ids) >= sampling.max_new_tokens:
            return self._finish(request, "length", None)
        if len(request.input_ids) + len(request.output_ids) >= request.limit:
            return self._finish(request, "length", None)
        return False

    def _finish(self, request: Request, reason: FinishReason, matched: int | str | None) -> bool:
        request.result = GenerateResult(
            token_ids=request.output_ids,
            logprobs=request.output_logprobs,
            finish_reason=reason,
            matched_stop=matched,
            prompt_tokens=len(request.input_ids),
            cached_tokens=0,
            weight_version=request.weight_version,
        )
        if reason != "abort":
            self.counters.requests_done += 1
        self._outbox.append(request)
        return True

    def _fail(self, request: Request, exc: BaseException) -> None:
        if isinstance(exc, EngineError):
            request.error = exc
        else:
            request.error = EngineError(f"generation failed: {exc!r}")
            request.error.__cause__ = exc
        self.counters.requests_failed += 1
        self._outbox.append(request)

    def _fail_all(self, error: EngineError | None) -> None:
        """On close (``error`` None): requests end with ``finish_reason="abort"``; else fail."""
        with self._cond:
            self._closing = True
            pending = list(self._inbox)
            self._inbox.clear()
        requests = [*self._running, *self._waiting]
        updates = [*self._updates]
        for item in pending:
            (updates if isinstance(item, WeightUpdate) else requests).append(item)
        self._running, self._waiting, self._updates = [], collections.deque(), collections.deque()
        self._kv.clear()
        for request in requests:
            if error is None:
                self.counters.requests_aborted += 1
                self._finish(request, "abort", None)
            else:
                self._fail(request, error)
        for update in updates:
            update.error = error or EngineError("engine closed before the weight update")
            self._outbox.append(update)
        self._flush()


def load_into(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``'s parameters and buffers, checking names and shapes.

    A tied parameter (e.g. ``lm_head.weight`` sharing ``embed_tokens.weight``) may be omitted.
    Raises ``EngineError`` before copying anything when names or shapes do not match.
    """
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise EngineError(f"weight update has unknown tensors: {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise EngineError(
                f"weight update: {name} has shape {tuple(tensor.shape)}, "
                f"model expects {tuple(own[name].shape)}"
            )
    by_storage: dict[int, set[str]] = collections.defaultdict(set)
    for name, tensor in own.items():
        by_storage[tensor.untyped_storage().data_ptr()].add(name)
    missing = sorted(
        name
        for name, tensor in own.items()
        if not by_storage[tensor.untyped_storage().data_ptr()] & state.keys()
    )
    if missing:
        raise EngineError(f"weight update lacks tensors: {missing[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)
