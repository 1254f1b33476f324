"""``agentrl serve``: an engine behind the SGLang 0.5.17 HTTP subset (aiohttp, asyncio).

Endpoints: ``POST /generate`` (one prompt or a batch of ``input_ids`` or ``text``, ``n``
samples, ``return_logprob``, ``session_params``), ``/open_session``, ``/close_session``,
``/update_weights_from_disk``, ``/flush_cache``, ``/get_model_info`` (and ``/model_info``),
``/get_weight_version``, ``/v1/models``, ``/health``, ``/health_generate``, ``/metrics``
(Prometheus text), ``/abort_request``, ``/server_info`` (and ``/get_server_info``),
``/get_load`` (what ``sglang-router``'s ``power_of_two`` policy reads); ``stream:
true`` answers server-sent events (see ``_server_stream``). Session semantics are SGLang's
(see ``_server_sessions``).

Choices where SGLang leaves room, or where agentrl serve differs:

- ``output_ids`` are exactly the sampled ids (a matched stop token, or the tokens covering a
  matched stop string, included), as SGLang returns them. ``text`` follows SGLang's detokenizer:
  with ``no_stop_trim=false`` (the default) a matched stop token is left out of the text and a
  matched stop string cuts the text where it starts; with ``no_stop_trim=true`` the text keeps the
  stop token, and is cut right after a matched stop string.
- Like SGLang, generation also stops at the model's EOS ids unless ``ignore_eos`` (which, as in
  SGLang, turns off ``stop_token_ids`` too). When the last allowed token is a stop token, the
  embedded engine reports ``stop`` (SGLang reports ``length``; ``SGLangEngine`` normalizes).
- ``return_logprob`` returns ``output_token_logprobs``, ``input_token_logprobs`` from
  ``logprob_start_len`` (``[]`` for -1), and with ``top_logprobs_num`` / ``token_ids_logprob``
  the top-k and chosen-id lists, in SGLang's shapes (``_server_generate``, ``_logprobs``).
  Every SGLang 0.5.17 request field is accepted; the ones not implemented only at their
  neutral values (``_server_schema``). ``docs/serve-requests.md`` has the details.
- ``weight_version`` is an integer sent as a string (SGLang's type): the version of the first
  output token. ``--in-flight`` chooses what a weight update does to running requests (the
  engine's ``in_flight`` rule, reported as ``agentrl.in_flight`` by ``/get_model_info``); when a
  reply's tokens span versions (``partial``), ``meta_info.token_versions`` lists each token's
  version, a key SGLang clients ignore and that is absent otherwise.
- ``/close_session`` of an unknown id answers 200 as SGLang does (body says it was not open).

Errors: invalid input is a 400 ``{"error": {"message": ..., "field": ...}}`` naming the field;
an unexpected failure is a 500 with the same shape. No request can stop the server: a body that
is not UTF-8 or nests too deeply is refused before any handler runs (``_server_guard``), one
request asks for at most ``--max-samples-per-request`` samples and ``--max-logprob-entries``
top-k and chosen-id logprobs, at most ``--max-sessions`` sessions are open (``_server_limits``),
request bodies are decoded and large replies built off the event loop, and ``/health``
answers 200 only while the model can generate (``_server_health``). Limits and failure
answers for users: ``docs/serve-limits.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import inspect
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pydantic
from aiohttp import web

from agentrl._config import describe_errors, short_repr
from agentrl._errors import AgentRLError, GenerationError
from agentrl._types import GenerateResult

from . import _wire as w
from ._protocol import Engine
from ._server_generate import (
    BadRequest,
    Item,
    ModelFacts,
    RenderMemo,
    plan_generate,
    prepare_run,
    render_result,
)
from ._server_guard import install_request_guard, utf8_error
from ._server_health import ModelHealth
from ._server_info import load, server_info
from ._server_limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_LOGPROB_ENTRIES,
    DEFAULT_MAX_SAMPLES_PER_REQUEST,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_STOP_STRING_LENGTH,
    DEFAULT_MAX_STOP_STRINGS,
    RequestTooLarge,
    ServeLimits,
    check_logprob_entries,
    check_request_size,
    check_stop_strings,
)
from ._server_metrics import (
    Counters,
    kv_facts,
    prometheus_text,
    served_in_flight,
)
from ._server_router import decode_generate
from ._server_sessions import SessionError, SessionTable, Turn
from ._server_stream import (
    DONE,
    Cursor,
    DuplicateRid,
    Live,
    LiveTable,
    ends_in_a_stop_prefix,
    incremental,
    so_far,
    sse,
    stable_text,
    takes,
)
from ._server_tokenize import detokenize, detokenize_decoder, tokenize, tokenize_decoder

_JSON = "application/json"


def _json(payload: msgspec.Struct | list | dict | str, status: int = 200) -> web.Response:
    return web.Response(body=w.encoder.encode(payload), status=status, content_type=_JSON)


def _heavy(item: Item) -> bool:
    """The sample's response holds top-k, chosen-id or input-token logprob lists."""
    return item.return_logprob and bool(
        item.top_logprobs_num or item.token_ids_logprob or item.logprob_start_len >= 0
    )


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    body = w.WireError(w.WireErrorBody(message, field), code=status)
    return _json(body, status)


def _refused_body(endpoint: str, body: bytes, exc: msgspec.MsgspecError) -> web.Response:
    """The 400 for a body msgspec refused: one that is not UTF-8 (JSON text must be, RFC 8259;
    msgspec reports it as a decode error) names its first bad byte, as the request guard does
    for a ``UnicodeDecodeError``; otherwise the field msgspec names, or the JSON error."""
    if isinstance(exc, msgspec.DecodeError) and (bad := utf8_error(body)) is not None:
        return _error(400, f"{endpoint}: the request body is not valid UTF-8 at {bad}")
    if isinstance(exc, msgspec.ValidationError):
        return _error(400, f"invalid {endpoint} request: {exc}", w.error_field(exc))
    return _error(400, f"{endpoint} body is not valid JSON: {exc}")


async def _answer_body(
    request: web.Request,
    decoder: msgspec.json.Decoder,
    endpoint: str,
    run: Callable[[Any], dict[str, Any]],
) -> web.Response:
    """Decode ``request``'s body and answer ``run(body)`` (in a thread: tokenizers are slow);
    a body that does not decode, or that ``run`` refuses, is a 400 naming the field."""
    body = await request.read()
    try:

        def answer() -> dict[str, Any]:
            with w.gc_paused():
                req = decoder.decode(body)
            return run(req)

        return _json(await asyncio.to_thread(answer))
    except msgspec.MsgspecError as exc:
        return _refused_body(endpoint, body, exc)
    except BadRequest as exc:
        return _error(400, str(exc), exc.field)


class _Server:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_path: str,
        served_name: str,
        limits: ServeLimits,
        incremental_streaming_output: bool = False,
        stream_interval: int = 1,
    ) -> None:
        self.engine = engine
        self.incremental_streaming_output = incremental_streaming_output
        self.stream_interval = stream_interval
        """Tokens per streamed chunk when a request names none (SGLang's ``--stream-interval``)."""
        self.live = LiveTable()
        self._progress = takes(engine.generate, "on_tokens")
        self._partial = takes(engine.generate, "partial")
        self.last_gen_throughput = 0.0
        self.model_path = model_path
        """The weights served: the launch folder, then the last ``/update_weights_from_disk``
        that succeeded (SGLang reports ``model_path`` and ``served_model_name`` so)."""
        self.served_name = served_name
        self.tokenizer_path = model_path
        self.metrics_name = served_name
        """The ``model_name`` label of ``/metrics``: fixed at launch, as SGLang's."""
        self.limits = limits
        self.facts = ModelFacts.read(Path(model_path), tokenizer, engine.max_context)
        self.sessions = SessionTable(engine, self.facts.bos_token_id, limits.max_sessions)
        self.counters = Counters()
        self.model_health = ModelHealth(engine)
        self.logprob_queries = "logprobs" in inspect.signature(engine.generate).parameters
        self.created = int(time.time())
        self._update_lock = asyncio.Lock()
        self._updates: set[asyncio.Future[web.Response]] = set()
        """The engine computes input-token, top-k and chosen-id logprobs (``LogprobQuery``)."""

    # --- /generate ----------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        body = await request.read()
        try:  # decoding, tokenizing and checking a large body takes seconds: off the event loop
            req, items, single = await anyio.to_thread.run_sync(self._plan, body)
        except msgspec.MsgspecError as exc:
            return _refused_body("/generate", body, exc)
        except (BadRequest, RequestTooLarge) as exc:
            return _error(400, str(exc), exc.field)
        await self.sessions.reap()
        try:
            lives = self.live.claim([item.rid for item in items])
        except DuplicateRid as exc:
            return _error(400, str(exc), "rid")
        try:
            if req.stream:
                return await self._stream(request, items, lives, single, started)
            results: list[w.WireGenerateResp | None] = [None] * len(items)
            try:
                async with anyio.create_task_group() as tg, self._admitted_together(turns=1):
                    for index, item in enumerate(items):
                        tg.start_soon(self._run_item, item, index, results, started, lives[index])
            except BaseExceptionGroup as group:
                return self._failure(group)
        finally:  # samples that never started (a failed sibling, a cancelled stream)
            for live in lives:
                self.live.remove(live)
        body = [r for r in results if r is not None]
        payload = body[0] if single else body
        if any(_heavy(item) for item in items):
            encoded = await anyio.to_thread.run_sync(w.encoder.encode, payload)
            return web.Response(body=encoded, content_type=_JSON)
        return _json(payload)

    @contextlib.asynccontextmanager
    async def _admitted_together(self, turns: int) -> AsyncIterator[None]:
        """The samples whose tasks start inside are admitted by the engine in one step (its
        ``admitted_together``, where it has one): the block's end lets this event loop run
        each task up to its submission, ``turns`` passes of the loop (``_run_item`` awaits
        nothing before ``generate``, and ``generate`` nothing before it submits)."""
        together = getattr(self.engine, "admitted_together", None)
        with together() if together is not None else contextlib.nullcontext():
            yield
            for _ in range(turns):
                await anyio.lowlevel.checkpoint()

    def _plan(self, body: bytes) -> tuple[w.WireGenerateReq, list[Item], bool]:
        with w.gc_paused():
            req = decode_generate(body)
        check_request_size(req, self.limits)
        check_stop_strings(req, self.limits)
        items, single = plan_generate(req, self.facts)
        check_logprob_entries(items, self.limits, self.facts.max_context)
        return req, items, single

    def _failure(self, group: BaseExceptionGroup) -> web.Response:
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        if isinstance(exc, Exception):
            self.counters.failed += 1
        if isinstance(exc, SessionError):
            return _error(400, str(exc), exc.field)
        if isinstance(exc, BadRequest):
            return _error(400, str(exc), exc.field)
        self.model_health.forget()  # the model may be what failed: the next /health probes it
        if isinstance(exc, GenerationError):  # the server's failure, not the request's
            return _error(500, str(exc))
        if isinstance(exc, AgentRLError):
            return _error(400, str(exc))
        if isinstance(exc, Exception):
            return _error(500, f"internal error: {exc!r}")
        raise group  # cancellation and KeyboardInterrupt are not ours to turn into a response

    async def _run_item(
        self,
        item: Item,
        index: int,
        out: list[w.WireGenerateResp | None],
        started: float,
        live: Live,
        streamed: bool = False,
    ) -> None:
        """Run one sample (``live``: its entry in the live table); a ``streamed`` one takes the
        engine's per-step progress (``on_tokens``), others only read their output if aborted."""
        turn: Turn | None = None
        context, session = item.input_ids, None
        result: GenerateResult | None = None
        try:
            if item.session is not None:
                turn = self.sessions.begin(
                    item.session, item.input_ids, item.rid, item.sampling.max_new_tokens
                )
                context, session = turn.context, turn.engine_session
            live.context = context
            streaming = turn is not None and turn.session.streaming
            sampling, query = prepare_run(
                item, len(context), self.facts, streaming_session=streaming
            )
            extra: dict[str, Any] = {}
            if query is not None:
                if not self.logprob_queries:
                    raise BadRequest(
                        f"{type(self.engine).__name__} does not compute input-token, top-k or "
                        "chosen-id logprobs",
                        "return_logprob",
                    )
                extra["logprobs"] = query
            if streamed and self._progress:
                extra["on_tokens"] = live.update
            elif self._partial:
                extra["partial"] = live.partial
            elif self._progress:
                extra["on_tokens"] = live.update
            with anyio.CancelScope() as scope:
                live.scope = scope
                if live.aborted:
                    scope.cancel()
                if turn is not None:
                    turn.node.cancel = scope.cancel
                result = await self.engine.generate(context, sampling, session=session, **extra)
            if result is None:  # aborted: /abort_request, a disconnect, or a session replace
                result = so_far(live.output(), len(context), self.engine.weight_version)
        finally:
            live.scope = None
            self.live.remove(live)
            if turn is not None:
                ok = result is not None and result.finish_reason != "abort"
                await self.sessions.finish(turn, result.token_ids if ok and result else None)
        self.counters.requests += 1
        self.counters.prompt_tokens += len(context)
        self.counters.generation_tokens += len(result.token_ids)
        self.counters.cached_tokens += result.cached_tokens
        elapsed = time.perf_counter() - started
        if result.token_ids and elapsed > 0:
            self.last_gen_throughput = len(result.token_ids) / elapsed
        out[index] = await self._render(item, context, result, started)

    async def _render(
        self,
        item: Item,
        context: list[int],
        result: GenerateResult,
        started: float,
        memo: RenderMemo | None = None,
    ) -> w.WireGenerateResp:
        """``render_result``; in a thread when the sample asked for per-position lists beyond
        its own tokens' logprobs (up to ``max_logprob_entries`` of them: seconds of work)."""
        if _heavy(item):
            return await anyio.to_thread.run_sync(
                render_result, item, context, result, self.facts, started, memo
            )
        return render_result(item, context, result, self.facts, started, memo)

    # --- streaming /generate and /abort_request ------------------------------------------------

    async def _stream(
        self,
        request: web.Request,
        items: list[Item],
        lives: list[Live],
        single: bool,
        started: float,
    ) -> web.StreamResponse:
        """SGLang's server-sent events (see ``_server_stream``)."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        lock = anyio.Lock()

        async def write(chunk: bytes) -> None:
            async with lock:
                await response.write(chunk)

        results: list[w.WireGenerateResp | None] = [None] * len(items)
        try:
            # a stream's sample submits from a task of its own: two passes of the loop
            async with anyio.create_task_group() as tg, self._admitted_together(turns=2):
                for index, item in enumerate(items):
                    at = None if single else index
                    args = (item, lives[index], index, at, results, started, write)
                    tg.start_soon(self._stream_item, *args)
        except BaseExceptionGroup as group:
            if request.transport is None or request.transport.is_closing():
                return response  # the client left: its requests were cancelled (KV freed)
            failure = self._failure(group)  # re-raises cancellation
            assert isinstance(failure.body, bytes)
            await write(b"data: " + failure.body + b"\n\n")
        await write(DONE)
        await response.write_eof()
        return response

    async def _stream_item(
        self,
        item: Item,
        live: Live,
        index: int,
        at: int | None,
        results: list[w.WireGenerateResp | None],
        started: float,
        write: Any,
    ) -> None:
        cursor, memo = Cursor(), RenderMemo()
        finished = anyio.Event()

        def shaped(resp: w.WireGenerateResp) -> bytes:
            resp.index = at
            if self.incremental_streaming_output:
                resp = incremental(resp, cursor)
            return sse(resp)

        async def run() -> None:
            try:
                await self._run_item(item, index, results, started, live, streamed=True)
            finally:
                finished.set()
                live.changed.set()

        interval = item.stream_interval or self.stream_interval
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            sent = 0
            while True:
                await live.changed.wait()
                live.changed = anyio.Event()
                if finished.is_set():
                    break
                count = len(live.progress.ids)
                # as SGLang: the first token at once, then a chunk per stream_interval tokens
                due = count > sent and (not sent or count - sent >= interval)
                if due and live.context is not None:
                    partial = so_far(live.progress, len(live.context), self.engine.weight_version)
                    resp = await self._render(item, live.context, partial, started, memo)
                    resp.text = stable_text(resp.text)
                    if ends_in_a_stop_prefix(resp.text, item.sampling.stop):
                        continue  # as SGLang: it may become a stop string, cut from the answer
                    resp.meta_info.finish_reason = None
                    resp.meta_info.e2e_latency = 0.0
                    sent = count
                    await write(shaped(resp))
        final = results[index]
        assert final is not None
        await write(shaped(final))

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's ``/abort_request``: 200 whether or not anything was running."""
        body = await request.read()
        try:
            req = w.abort_req_decoder.decode(body or b"{}")
        except msgspec.MsgspecError as exc:
            return _refused_body("/abort_request", body, exc)
        self.live.abort(req.rid or "", bool(req.abort_all))
        return web.Response(status=200)

    async def get_load(self, request: web.Request) -> web.Response:
        return _json(load(self))

    async def server_info(self, request: web.Request) -> web.Response:
        return _json(server_info(self))

    async def tokenize(self, request: web.Request) -> web.Response:
        def run(req: Any) -> dict[str, Any]:
            return tokenize(req, self.facts)

        return await _answer_body(request, tokenize_decoder, "/tokenize", run)

    async def detokenize(self, request: web.Request) -> web.Response:
        def run(req: Any) -> dict[str, Any]:
            return detokenize(req, self.facts.tokenizer, self.facts.vocab_size)

        return await _answer_body(request, detokenize_decoder, "/detokenize", run)

    # --- sessions -----------------------------------------------------------------------------

    async def open_session(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            req = w.open_session_decoder.decode(body or b"{}")
            session_id = await self.sessions.open(
                req.session_id, req.capacity_of_str_len, bool(req.streaming), req.timeout
            )
        except msgspec.MsgspecError as exc:
            return _refused_body("/open_session", body, exc)
        except SessionError as exc:
            return _error(400, str(exc), exc.field)
        except AgentRLError as exc:
            return _error(400, str(exc))
        return _json(session_id)

    async def close_session(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            req = w.close_session_decoder.decode(body)
        except msgspec.MsgspecError as exc:
            return _refused_body("/close_session", body, exc)
        closed = await self.sessions.close(req.session_id)
        return _json({"success": closed, "message": "closed" if closed else "not open"})

    # --- weights, cache, info ---------------------------------------------------------------

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            req = w.update_weights_req_decoder.decode(body)
        except msgspec.MsgspecError as exc:
            return _refused_body("/update_weights_from_disk", body, exc)
        if req.load_format not in (None, "auto", "safetensors"):
            msg = f"load_format {req.load_format!r} is not served: safetensors only (or auto)"
            return _error(400, msg, "load_format")
        version = self.engine.weight_version
        if req.weight_version is not None:
            # ASCII digits that fit 64 bits: int() also takes " 7 ", "1_000", Arabic-Indic
            # digits and 4,300-digit numbers (which /metrics would then print)
            if not _VERSION.fullmatch(req.weight_version):
                msg = (
                    "weight_version must be an integer string of at most 18 digits, got "
                    f"{short_repr(req.weight_version)}"
                )
                return _json(w.WireUpdateWeightsResp(False, msg), 400)
            version = int(req.weight_version)
        # a received update runs to its end even if its client leaves (as SGLang's does), and
        # updates run one at a time (each holds a whole copy of the weights while it is checked)
        task = asyncio.ensure_future(self._update_weights(req, version))
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)
        return await asyncio.shield(task)

    async def _update_weights(
        self, req: w.WireUpdateWeightsFromDiskReq, version: int
    ) -> web.Response:
        async with self._update_lock:
            if req.abort_all_requests:  # SGLang: running and waiting requests end with "abort"
                self.live.abort("", True)
            self.model_health.forget()
            try:
                await self.engine.update_weights(version, req.model_path)
            except Exception as exc:  # as SGLang: any load failure is a JSON 400, old weights kept
                reason = str(exc) if isinstance(exc, AgentRLError) else repr(exc)
                message = (
                    f"failed to update weights: {reason}; the previous weights are still served"
                )
                return _json(w.WireUpdateWeightsResp(False, message), 400)
        self.model_path = self.served_name = req.model_path  # as SGLang's tokenizer manager
        message = f"Succeeded to update model weights. Weight version updated to {version}."
        return _json(w.WireUpdateWeightsResp(True, message))

    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's ``/pause_generation``: no step runs until ``/continue_generation``; new
        requests queue meanwhile. ``abort`` first ends every running request (``abort``, with
        its output so far), ``in_place`` keeps their KV, ``retract`` drops it (they recompute
        it when they go on). A weight update while paused applies at once; the paused requests
        then go on as ``in_flight`` says, ``finish`` acting as ``partial``."""
        body = await request.read()
        try:
            req = w.pause_req_decoder.decode(body or b"{}")
        except msgspec.MsgspecError as exc:
            return _refused_body("/pause_generation", body, exc)
        pause = getattr(self.engine, "pause_generation", None)
        if pause is None:
            engine = type(self.engine).__name__
            return _error(400, f"{engine} cannot pause generation", "mode")
        if req.mode == "abort":
            self.live.abort("", True)
        await pause("retract" if req.mode == "retract" else "in_place")
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            w.continue_req_decoder.decode(body or b"{}")
        except msgspec.MsgspecError as exc:
            return _refused_body("/continue_generation", body, exc)
        resume = getattr(self.engine, "continue_generation", None)
        if resume is not None:
            await resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        flush = getattr(self.engine, "flush_cache", None)
        if flush is not None:
            try:
                outcome = flush()
                if hasattr(outcome, "__await__"):
                    outcome = await outcome
            except AgentRLError as exc:
                return web.Response(text=f"Cache not flushed: {exc}\n", status=400)
            if outcome is False:
                return web.Response(text="Cache not flushed (requests running).\n", status=400)
        return web.Response(text="Cache flushed.\n")

    async def model_info(self, request: web.Request) -> web.Response:
        facts = self.facts
        info = w.WireModelInfo(
            model_path=self.model_path,
            tokenizer_path=self.tokenizer_path,
            weight_version=str(self.engine.weight_version),
            agentrl={
                "engine": type(self.engine).__name__,
                "max_context_length": self.engine.max_context,
                "vocab_size": facts.vocab_size,
                "in_flight": served_in_flight(self.engine),
                **kv_facts(self.engine),
            },
        )
        return _json(info)

    async def weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": str(self.engine.weight_version)})

    async def models(self, request: web.Request) -> web.Response:
        card = w.WireModelCard(
            self.served_name,
            created=self.created,
            root=self.model_path,
            max_model_len=self.engine.max_context,
        )
        return _json(w.WireModelList([card]))

    async def health(self, request: web.Request) -> web.Response:
        """200 while the model can generate (a probe passed lately: see ``_server_health``)."""
        return web.Response(status=200 if await self.model_health.healthy() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 when a one-token probe through the model passes now."""
        return web.Response(status=200 if await self.model_health.healthy(probe=True) else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = prometheus_text(self.counters, self.engine, len(self.sessions), self.metrics_name)
        return web.Response(text=text, content_type="text/plain")


_VERSION = re.compile(r"-?[0-9]{1,18}")
"""A ``weight_version`` this server takes (it fits a signed 64-bit integer)."""

SERVER_KEY: web.AppKey[_Server] = web.AppKey("agentrl_server", _Server)


def create_app(
    engine: Engine,
    tokenizer: Any,
    model_path: str | Path,
    *,
    served_model_name: str | None = None,
    limits: ServeLimits | None = None,
    incremental_streaming_output: bool = False,
    stream_interval: int = 1,
) -> web.Application:
    """The aiohttp application serving ``engine`` (which the caller owns and closes)."""
    server = _Server(
        engine,
        tokenizer,
        str(model_path),
        served_model_name or str(model_path),
        limits or ServeLimits(),
        incremental_streaming_output,
        stream_interval,
    )
    app = web.Application(client_max_size=256 * 1024 * 1024)
    install_request_guard(app, body_timeout_s=server.limits.body_timeout_s)
    routes = [
        ("POST", "/generate", server.generate),
        ("PUT", "/generate", server.generate),
        ("*", "/open_session", server.open_session),
        ("*", "/close_session", server.close_session),
        ("POST", "/update_weights_from_disk", server.update_weights_from_disk),
        ("*", "/flush_cache", server.flush_cache),
        ("POST", "/pause_generation", server.pause_generation),
        ("POST", "/continue_generation", server.continue_generation),
        ("GET", "/get_model_info", server.model_info),
        ("GET", "/model_info", server.model_info),
        ("GET", "/get_weight_version", server.weight_version),
        ("GET", "/v1/models", server.models),
        ("GET", "/health", server.health),
        ("GET", "/health_generate", server.health_generate),
        ("GET", "/metrics", server.metrics),
        ("POST", "/abort_request", server.abort_request),
        ("GET", "/server_info", server.server_info),
        ("GET", "/get_load", server.get_load),
        ("GET", "/get_server_info", server.server_info),
        ("POST", "/tokenize", server.tokenize),
        ("POST", "/v1/tokenize", server.tokenize),
        ("POST", "/detokenize", server.detokenize),
        ("POST", "/v1/detokenize", server.detokenize),
    ]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)

    async def session_reaper(app: web.Application) -> AsyncIterator[None]:
        """Close timed-out sessions every second (SGLang's scheduler does the same)."""

        async def reap_forever() -> None:
            while True:
                await asyncio.sleep(1.0)
                await server.sessions.reap()

        task = asyncio.create_task(reap_forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.sessions.close_all()

    app.cleanup_ctx.append(session_reaper)
    app[SERVER_KEY] = server
    return app


async def run_server(
    engine: Engine,
    host: str,
    port: int,
    model_path: str | Path,
    *,
    tokenizer: Any = None,
    served_model_name: str | None = None,
    limits: ServeLimits | None = None,
    incremental_streaming_output: bool = False,
    stream_interval: int = 1,
) -> None:
    """Serve ``engine`` on ``host:port`` until cancelled (the caller owns the engine)."""
    if tokenizer is None:
        from agentrl._models import load_tokenizer

        tokenizer = await asyncio.to_thread(load_tokenizer, str(model_path))
    app = create_app(
        engine,
        tokenizer,
        model_path,
        served_model_name=served_model_name,
        limits=limits,
        incremental_streaming_output=incremental_streaming_output,
        stream_interval=stream_interval,
    )
    # a compressed body is refused (415, request_guard), never inflated
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, auto_decompress=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        print(f"agentrl serve: listening on http://{host}:{bound}", file=sys.stderr, flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``agentrl serve`` options (SGLang's names where they exist)."""
    parser.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default="smollm2-135m",
        help="registered model name or local HF folder (default %(default)s)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="bind address (default %(default)s: loopback only)"
    )
    parser.add_argument(
        "--port", type=int, default=30000, help="default %(default)s (SGLang's); 0 picks a free one"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in /v1/models, /server_info and /metrics (default: its path)",
    )
    parser.add_argument(
        "--max-batch-size",
        "--max-running-requests",
        dest="max_batch_size",
        type=int,
        default=None,
        help="most requests running at once (default 32)",
    )
    parser.add_argument(
        "--max-step-tokens",
        "--chunked-prefill-size",
        dest="max_step_tokens",
        type=int,
        default=None,
        help="most tokens one step computes (decode rows count one each; prefill is chunked "
        "to fit); default 512 on the CPU, 8192 on a GPU",
    )
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no KV reuse across requests (sessions still reuse theirs)",
    )
    parser.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="on a GPU, run decode steps without captured CUDA graphs",
    )
    parser.add_argument(
        "--cuda-graph-max-bs-decode",
        "--cuda-graph-max-bs",
        dest="cuda_graph_max_bs",
        type=int,
        default=None,
        help="largest decode batch captured as a CUDA graph (default: --max-running-requests)",
    )
    for phase in ("decode", "prefill"):
        parser.add_argument(
            f"--{phase}-attention-backend",
            f"--{phase}-attention",
            dest=f"{phase}_attention",
            choices=("auto", "sdpa", "triton"),
            default=None,
            help=f"what runs the {phase} attention: torch SDPA, the Triton paged kernel, or "
            "auto (default: on a GPU the faster of the two, measured per shape bucket)",
        )
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--page-size",
        dest="block_size",
        type=int,
        default=None,
        help="KV block size in tokens (the embedded engine's block_size; default 16)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens (default: 1 GiB of KV, at most batch size x context)",
    )
    parser.add_argument(
        "--context-length",
        dest="context_length",
        type=int,
        default=None,
        help="most tokens (prompt + generated) of one request; default: the model's "
        "max_position_embeddings (at most what the KV pool holds)",
    )
    parser.add_argument(
        "--device", default=None, help="cpu (default), cuda or cuda:N: where the model and KV live"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="model and KV dtype: float32 (default), bfloat16, float16 or float64",
    )
    parser.add_argument(
        "--in-flight",
        dest="in_flight",
        choices=("finish", "abort", "partial"),
        default=None,
        help="what a weight update does to running requests: finish them on the old weights "
        "(default), abort (restart on the new ones) or partial (continue on the new ones)",
    )
    parser.add_argument(
        "--max-samples-per-request",
        type=int,
        default=DEFAULT_MAX_SAMPLES_PER_REQUEST,
        help="most samples (prompts x n) one /generate request may ask for; more is a 400 "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=DEFAULT_MAX_SESSIONS,
        help="most sessions open at once; /open_session beyond it is a 400 (default %(default)s)",
    )
    parser.add_argument(
        "--max-logprob-entries",
        type=int,
        default=DEFAULT_MAX_LOGPROB_ENTRIES,
        help="most top-k and chosen-id logprob entries (positions x (top_logprobs_num + "
        "token_ids_logprob ids)) one /generate request may ask for; more is a 400 "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-stop-strings",
        type=int,
        default=DEFAULT_MAX_STOP_STRINGS,
        help="most strings one sampling_params.stop may hold; more is a 400 (default %(default)s)",
    )
    parser.add_argument(
        "--max-stop-string-length",
        type=int,
        default=DEFAULT_MAX_STOP_STRING_LENGTH,
        help="most characters of one stop string; a longer one is a 400 (default %(default)s)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request body may take to arrive after its headers; past them a 408 "
        "that closes the connection (default %(default)s)",
    )
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream: true sends only the new text/output_ids in each chunk (default: cumulative)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk when a request's sampling_params.stream_interval is unset "
        "(default %(default)s; the first token is always sent at once)",
    )


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineOptions`` fields the serve flags set (unset flags keep the defaults)."""
    names = (
        "max_batch_size",
        "max_step_tokens",
        "num_threads",
        "block_size",
        "kv_cache_tokens",
        "context_length",
        "device",
        "dtype",
        "in_flight",
        "cuda_graph_max_bs",
        "decode_attention",
        "prefill_attention",
    )
    options = {k: getattr(args, k, None) for k in names}
    options = {k: v for k, v in options.items() if v is not None}
    if getattr(args, "disable_radix_cache", False):
        options["radix_cache"] = False
    if getattr(args, "disable_cuda_graph", False):
        options["cuda_graph"] = False
    return options


def serve_from_args(args: argparse.Namespace) -> int:
    """Load the embedded engine for ``args.model`` and serve it until SIGINT/SIGTERM."""
    from agentrl._models import resolve_model

    from ._embedded import open_embedded_engine

    try:
        limits = ServeLimits(
            max_samples_per_request=args.max_samples_per_request,
            max_sessions=args.max_sessions,
            max_logprob_entries=args.max_logprob_entries,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_length=args.max_stop_string_length,
            body_timeout_s=args.body_timeout_s,
        )
    except pydantic.ValidationError as exc:
        print(f"agentrl serve: {describe_errors(exc)}", file=sys.stderr)
        return 2
    if args.stream_interval < 1:
        print(
            f"agentrl serve: --stream-interval must be >= 1, got {args.stream_interval}",
            file=sys.stderr,
        )
        return 2
    try:
        folder = resolve_model(args.model)
    except AgentRLError as exc:
        print(f"agentrl serve: {exc}", file=sys.stderr)
        return 2
    options = engine_options_from_args(args)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        async with open_embedded_engine(folder, **options) as engine:
            await run_server(
                engine,
                args.host,
                args.port,
                folder,
                served_model_name=args.served_model_name,
                limits=limits,
                incremental_streaming_output=bool(args.incremental_streaming_output),
                stream_interval=args.stream_interval,
            )

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        pass
    except (AgentRLError, OSError) as exc:
        hint = ""
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            hint = f" (another process serves on port {args.port}: pass another --port, or 0)"
        print(f"agentrl serve: {exc}{hint}", file=sys.stderr)
        return 1
    return 0


def serve_main(argv: Sequence[str] | None = None) -> int:
    """``python -m agentrl.engine._server --model tiny-random --port 30000``."""
    parser = argparse.ArgumentParser(
        prog="agentrl serve", description="Serve a model over the SGLang HTTP API subset."
    )
    add_serve_arguments(parser)
    return serve_from_args(parser.parse_args(argv))


__all__ = [
    "add_serve_arguments",
    "create_app",
    "engine_options_from_args",
    "run_server",
    "serve_from_args",
    "serve_main",
]

if __name__ == "__main__":
    sys.exit(serve_main())
