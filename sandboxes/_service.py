"""The sandbox service's HTTP application (aiohttp): ``make_app(pool, config=ServiceConfig())``.

``_serve.py`` runs it as ``agentrl sandbox serve`` (one pool per process, behind a
``ConnectionGuard``). ``docs/sandbox-service.md`` is the user's page.

Routes (JSON bodies; the wire types are ``_types.RunRequest`` / ``RunResult``):

- ``POST /v1/run``: one ``RunRequest`` → ``RunResult``.
- ``POST /v1/run_batch``: ``{"requests": [...]}`` → ``{"results": [...]}``, one result per item
  in order; an item that breaks a rule gets ``status="invalid_request"`` (the field named in
  ``error``) and does not run; the others run.
- ``GET /health``: backend, pool and service statistics, limits, the guarantees this host gives.
- ``GET /metrics``: Prometheus text.

**Request errors vs run outcomes.** A request the service will not run is answered with a 4xx
(or 503) and a structured body ``{"error": {"type", "message", "field", "limit"}}``: nothing ran
and no sandbox was touched, whatever the cause — 400 ``malformed_json`` / ``invalid_request``
(naming the field and value: a NUL in ``code``, files larger than half of ``memory_mb``,
``network: true``, …), 401 ``unauthorized``, 404/405, 408 ``request_timeout`` (body too slow),
413 ``request_too_large`` / ``answer_too_large`` (with ``limit``), 429 ``busy`` (pool over
capacity) and 503 ``overloaded`` (service memory or connections over their budget), both with
``Retry-After``. Everything a program does once it runs is a 200 with its ``status``. 500
``internal_error`` is a bug of the service. With a token, every route requires ``Authorization:
Bearer <token>`` (one such header, compared as bytes in constant time).

**The service's own memory.** Each POST reserves its body (``Content-Length``; a chunked body
as it arrives) before reading it, and its answer (2 × ``output_limit_bytes`` per item) before
running it, each ``COPIES`` times, from one ``ByteBudget`` of ``max_inflight_bytes``. Once the
results are known, and the request's values dropped, the whole reservation is settled to what
they take (``held_bytes``: a text at 1, 2 or 4 bytes a character), charged past the budget when
it is more (``_settle``). The answer is streamed by the middleware (within ``send_timeout_s``),
each text escaped a slice at a time (``result_pieces``), and only then is the reservation
released. So the memory the service
holds for requests stays near ``max_inflight_bytes``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from aiohttp import hdrs, http_exceptions, web

from ._budget import Reservation
from ._config import ServiceConfig
from ._connections import ConnectionGuard
from ._errors import PoolBusy
from ._pool import SandboxPool
from ._service_state import STATE, ServiceState
from ._service_status import handle_health, handle_metrics
from ._types import (
    ErrorBody,
    ErrorResponse,
    InvalidRequest,
    RunRequest,
    RunResult,
    encode,
    printable,
)
from ._validate import DuplicateKeys, MalformedJSON, parse_json, request_from_json, show

log = logging.getLogger("agentrl.sandboxes.service")
COPIES = 2
"""Each byte of a body or answer is reserved this many times: that is how many copies the
service holds at once (a body as bytes then text, text then values; an answer's output as it
comes from the sandbox, then as text)."""
_INVALID_ITEM_BYTES = 4096  # what an invalid batch item's result may take in the answer


class _Refusal(Exception):
    """A request error found while handling: answered as is (see ``error_response``)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def error_response(
    status: int,
    kind: str,
    message: str,
    field: str | None = None,
    *,
    limit: int | None = None,
    headers: Any = None,
    close: bool = False,
) -> web.Response:
    """A structured error; ``close`` ends the connection after it (the body was not read)."""
    if field is not None:
        field = printable(field)
    error = ErrorBody(type=kind, message=printable(message), field=field, limit=limit)
    body = encode(ErrorResponse(error))
    response = web.Response(
        status=status, body=body, content_type="application/json", headers=headers
    )
    if close:
        response.force_close()
    return response


def _overloaded(state: ServiceState, what: str, need: int) -> _Refusal:
    return _Refusal(
        error_response(
            503,
            "overloaded",
            f"the service holds {state.budget.held} of max_inflight_bytes="
            f"{state.budget.capacity} for other requests; {what} needs {need} more: nothing "
            "ran, retry later",
            limit=state.budget.capacity,
            headers={"Retry-After": "1"},
            close=True,
        )
    )


def _json(obj: Any) -> web.Response:
    body = encode(obj) if isinstance(obj, msgspec.Struct) else msgspec.json.encode(obj)
    return web.Response(body=body, content_type="application/json")


_SLICE_CHARS = 64 * 1024
"""Characters of stdout or stderr escaped at once while an answer is sent."""
_SENDING_BYTES_PER_CHAR = 10
"""What sending an answer holds beyond its results, per character of one slice: the slice's
text (up to 4 bytes a character) and its JSON (up to 6: a control character is ``\\u00XX``)."""


def held_bytes(result: RunResult) -> int:
    """The memory ``result`` takes, its texts at their real size (1, 2 or 4 bytes a character:
    one character beyond Latin-1 widens its whole string)."""
    return sys.getsizeof(result) + sum(map(sys.getsizeof, msgspec.structs.astuple(result)))


def result_pieces(
    result: RunResult, slice_chars: int = _SLICE_CHARS
) -> Iterator[bytes | memoryview]:
    """``encode(result)`` in pieces: stdout and stderr are escaped ``slice_chars`` characters
    at a time, so that no more than one slice's JSON (up to 6 bytes a character) exists at once
    besides the result itself."""
    rest = encode(msgspec.structs.replace(result, stdout="", stderr=""))
    for key, text in ((b'"stdout":"', result.stdout), (b'"stderr":"', result.stderr)):
        # the field's key is its first occurrence: no value encoded before it can hold an
        # unescaped quote
        head, found, rest = rest.partition(key + b'"')
        assert found, key
        yield head + key
        for start in range(0, len(text), slice_chars):
            yield memoryview(msgspec.json.encode(text[start : start + slice_chars]))[1:-1]
        rest = b'"' + rest
    yield rest


class _StreamedAnswer(web.StreamResponse):
    """A JSON answer written piece by piece (``_send``; chunked): one result, or a batch's
    ``{"results": [...]}``. Each result is encoded only when its turn comes, its texts a slice
    at a time (``result_pieces``), and dropped once written, so an answer is held once (as
    results) plus a slice, whatever its texts hold."""

    def __init__(self, results: list[RunResult | None], *, batch: bool) -> None:
        super().__init__(headers={"Content-Type": "application/json"})
        self.results = results
        self.batch = batch

    def pieces(self) -> Iterator[bytes | memoryview]:
        if self.batch:
            yield b'{"results":['
        for i, result in enumerate(self.results):
            assert result is not None
            self.results[i] = None
            if i:
                yield b","
            yield from result_pieces(result)
        if self.batch:
            yield b"]}"


def _route_name(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Connection phase, bearer auth, admission to the byte budget, structured errors, sending
    the answer within ``send_timeout_s``, per-route counters and latency."""
    state = request.app[STATE]
    conn = state.guard.connection_of(request.transport) if state.guard is not None else None
    if conn is not None:
        conn.begin()
    task = asyncio.current_task()
    assert task is not None
    state.handlers.add(task)
    started = time.perf_counter()
    route = _route_name(request)
    reservation = state.reservations[id(request)] = Reservation(state.budget)
    response: web.StreamResponse | None = None
    try:
        response = await _answer(request, handler, state, reservation)
        state.http_requests[(route, response.status)] += 1
        if state.guard is not None and state.guard.stopping:
            response.force_close()  # "Connection: close": the service takes no next request
        await _send(request, response, state)
    finally:
        state.handlers.discard(task)
        reservation.close()
        del state.reservations[id(request)]
        if conn is not None:
            conn.end(closing=response is None or not response.keep_alive)
        state.request_seconds.observe(time.perf_counter() - started, route=route)
    return response


async def _answer(
    request: web.Request, handler: Any, state: ServiceState, reservation: Reservation
) -> web.StreamResponse:
    try:
        if state.token is not None and not _authorized(request, state.token):
            return error_response(
                401,
                "unauthorized",
                "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                headers={"WWW-Authenticate": "Bearer"},
                close=request.body_exists,
            )
        if request.method == "POST":
            _admit(request, state, reservation)
        return await handler(request)
    except _Refusal as refusal:
        return refusal.response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return error_response(exc.status, kind, exc.text or exc.reason, close=request.body_exists)
    except Exception as exc:  # a bug of ours: answer, log, keep serving
        log.exception("internal error on %s", request.path)
        return error_response(500, "internal_error", f"{type(exc).__name__}: {exc}", close=True)


def _admit(request: web.Request, state: ServiceState, reservation: Reservation) -> None:
    """Before reading a byte of the body: 415 for a compressed body (its size on the wire says
    nothing of what it holds), 413 for a declared length that can never fit, 503 for one that
    does not fit the budget now; otherwise the declared length is reserved, all of it (so that
    concurrent bodies are each read whole or not at all). A chunked body declares nothing: its
    bytes are reserved as they arrive (``_read_body``)."""
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _Refusal(
            error_response(
                415,
                "unsupported_media_type",
                f"Content-Encoding {show(encoding)} is not accepted: send the body uncompressed "
                "(nothing ran)",
                close=True,
            )
        )
    limit = state.config.max_request_bytes
    try:
        length = request.content_length
    except ValueError:  # aiohttp's parser refuses these first; never a 500 here
        raise _Refusal(
            error_response(400, "invalid_request", "Content-Length is not a number", close=True)
        ) from None
    if length is not None and length > limit:
        raise _Refusal(
            error_response(
                413,
                "request_too_large",
                f"the body is {length} bytes; max_request_bytes is {limit}",
                limit=limit,
                close=True,
            )
        )
    need = COPIES * (length or 0)
    if not reservation.grow(need):
        raise _overloaded(state, "this body", need)


async def _send(request: web.Request, response: web.StreamResponse, state: ServiceState) -> None:
    """Write the whole answer now (its bytes stay reserved until then); a client that does not
    take it within ``send_timeout_s`` loses the connection."""
    try:
        async with asyncio.timeout(state.config.send_timeout_s):
            await response.prepare(request)
            if isinstance(response, _StreamedAnswer):
                for piece in response.pieces():
                    await response.write(piece)
            await response.write_eof()
    except TimeoutError:
        state.send_timeouts += 1
        if request.transport is not None:
            request.transport.abort()
    except ConnectionError:
        pass  # the client went away; aiohttp notices the closed transport


def _authorized(request: web.Request, token: bytes) -> bool:
    """Exactly one ``Authorization: Bearer <token>`` header, compared as raw bytes (a header
    that is not UTF-8 is simply wrong, never an error)."""
    values = [v for k, v in request.raw_headers if k.lower() == b"authorization"]
    if len(values) != 1:
        return False
    scheme, _, credentials = values[0].strip(b" \t").partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(credentials.strip(b" \t"), token)


async def _read_body(request: web.Request, state: ServiceState) -> bytearray:
    """The body (at most ``max_request_bytes``; 408 past ``body_timeout_s``, 413 past the size,
    503 when a chunked body's next bytes no longer fit the budget). While it arrives
    the connection may be evicted at the connection cap, after the ones waiting for a request
    (a client that sends its body at once is never there long)."""
    limit = state.config.max_request_bytes
    reservation = state.reservation(request)
    conn = state.guard.connection_of(request.transport) if state.guard is not None else None
    if conn is not None:
        conn.receiving()
    body = bytearray()
    try:
        async with asyncio.timeout(state.config.body_timeout_s):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise _Refusal(
                        error_response(
                            413,
                            "request_too_large",
                            f"the body exceeds max_request_bytes={limit}",
                            limit=limit,
                            close=True,
                        )
                    )
                more = COPIES * len(body) - reservation.bytes  # > 0 only for a chunked body
                if more > 0 and not reservation.grow(more):
                    raise _overloaded(state, "the rest of this body", more)
    except TimeoutError:
        state.body_timeouts += 1
        raise _Refusal(
            error_response(
                408,
                "request_timeout",
                f"the body did not arrive within body_timeout_s={state.config.body_timeout_s:g}",
                close=True,
            )
        ) from None
    except (ConnectionError, web.RequestPayloadError, http_exceptions.HttpProcessingError) as exc:
        # the client went away mid-body, or sent a body its framing does not describe: nothing
        # ran; the answer goes nowhere when the connection is gone
        raise _Refusal(
            error_response(
                400,
                "invalid_request",
                f"the body could not be read: {type(exc).__name__}: {exc}",
                close=True,
            )
        ) from None
    finally:
        if conn is not None:
            conn.received()
    return body


def _invalid(exc: InvalidRequest | MalformedJSON, state: ServiceState) -> _Refusal:
    state.results["invalid_request"] += 1
    if isinstance(exc, MalformedJSON):
        return _Refusal(error_response(400, "malformed_json", str(exc)))
    return _Refusal(error_response(400, "invalid_request", exc.message, exc.field))


def _reserve_answer(request: web.Request, state: ServiceState, answer: int, what: str) -> None:
    """Refuse up front an answer that could exceed ``max_answer_bytes`` (413) or that does not
    fit the budget now (503); otherwise hold its bytes (``COPIES`` × ``answer``) until the
    results are known (``_settle``)."""
    limit = state.config.max_answer_bytes
    if answer > limit:
        raise _Refusal(
            error_response(
                413,
                "answer_too_large",
                f"{what} may answer {answer} bytes (2 × output_limit_bytes per item); "
                f"max_answer_bytes is {limit}: lower output_limit_bytes or split the batch",
                "requests" if what.startswith("the batch") else "output_limit_bytes",
                limit=limit,
            )
        )
    if not state.reservation(request).grow(COPIES * answer):
        raise _overloaded(state, "its answer", COPIES * answer)


def _settle(request: web.Request, state: ServiceState, results: list[RunResult]) -> None:
    """Once the request's values are dropped, hold what its results take (and one slice of
    them being sent) instead of everything reserved for its body and answer, until they are
    sent: usually much less; more when their text is wider than a byte a character, which is
    then charged even past ``max_inflight_bytes`` (it is in memory already), and no new request
    is admitted until the budget is back under."""
    longest = max((len(text) for r in results for text in (r.stdout, r.stderr)), default=0)
    actual = sum(map(held_bytes, results)) + _SENDING_BYTES_PER_CHAR * min(longest, _SLICE_CHARS)
    reservation = state.reservation(request)
    reservation.settle(reservation.bytes, actual)


def _busy(state: ServiceState, exc: PoolBusy) -> web.Response:
    state.busy_rejections += 1
    retry_after = max(1, math.ceil(exc.retry_after_s))
    return error_response(
        429,
        "busy",
        f"over capacity, nothing ran; retry after {exc.retry_after_s:g} s ({exc})",
        headers={"Retry-After": str(retry_after)},
    )


def _record(state: ServiceState, result: RunResult) -> None:
    state.results[result.status] += 1
    if result.status != "invalid_request":
        state.exec_seconds.observe(result.wall_s)


async def handle_run(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _read_body(request, state)
    try:
        req = request_from_json(parse_json(body), state.pool.request_limits)  # (empties body)
    except (InvalidRequest, MalformedJSON) as exc:
        raise _invalid(exc, state) from None
    _reserve_answer(request, state, 2 * req.output_limit_bytes, "this request")
    try:
        result = await state.pool.run(req)
    except PoolBusy as exc:
        return _busy(state, exc)
    except InvalidRequest as exc:  # validated above with the same function and limits
        raise _invalid(exc, state) from None
    del req, body  # the body's values: from here on only the result is held
    _record(state, result)
    _settle(request, state, [result])
    return _StreamedAnswer([result], batch=False)


def _batch_items(obj: Any, state: ServiceState) -> list[Any]:
    if isinstance(obj, DuplicateKeys):
        message = f"{show(obj.duplicates[0])} is given more than once"
        raise _Refusal(error_response(400, "invalid_request", message, obj.duplicates[0]))
    if not isinstance(obj, dict) or set(obj) != {"requests"}:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        message = f"must be an object with one field, 'requests'; got {show(got)}"
        raise _Refusal(error_response(400, "invalid_request", message, "requests"))
    items = obj["requests"]
    if not isinstance(items, list):
        message = f"must be a list of requests, got {show(items)}"
        raise _Refusal(error_response(400, "invalid_request", message, "requests"))
    if len(items) > state.config.max_batch:
        message = f"{len(items)} requests; the limit is {state.config.max_batch} per batch"
        raise _Refusal(
            error_response(
                400, "invalid_request", message, "requests", limit=state.config.max_batch
            )
        )
    return items


async def handle_run_batch(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _read_body(request, state)
    try:
        items = _batch_items(parse_json(body), state)  # (empties body)
    except MalformedJSON as exc:
        raise _invalid(exc, state) from None
    limits = state.pool.request_limits
    results: list[RunResult | None] = [None] * len(items)
    valid: list[tuple[int, RunRequest]] = []
    answer = 0
    for i, item in enumerate(items):
        try:
            req = request_from_json(item, limits)
        except InvalidRequest as exc:
            results[i] = RunResult(
                status="invalid_request",
                error=f"requests[{i}].{exc.field}: {exc.message}",
                backend=state.pool.backend_name,
            )
            answer += _INVALID_ITEM_BYTES
        else:
            valid.append((i, req))
            answer += 2 * req.output_limit_bytes
    del items
    _reserve_answer(request, state, answer, f"the batch of {len(results)}")
    if valid:
        try:
            ran = await state.pool.run_batch([req for _, req in valid])
        except PoolBusy as exc:
            return _busy(state, exc)
        for (i, _), result in zip(valid, ran, strict=True):
            results[i] = result
        del ran
    del valid, body  # the body's values: from here on only the results are held
    done = [result for result in results if result is not None]
    assert len(done) == len(results)
    for result in done:
        _record(state, result)
    _settle(request, state, done)
    del done
    return _StreamedAnswer(results, batch=True)


def make_app(
    pool: SandboxPool,
    *,
    token: str | None = None,
    config: ServiceConfig | None = None,
    guard: ConnectionGuard | None = None,
) -> web.Application:
    """The aiohttp application serving ``pool`` (which the caller opens and closes).

    ``guard`` is the ``ConnectionGuard`` in front of the listening socket (``_serve.py``); the
    application tells it when a connection starts and ends a request."""
    config = config or ServiceConfig()
    # the body is read by _read_body against max_request_bytes; aiohttp's own cap is a backstop
    app = web.Application(client_max_size=config.max_request_bytes, middlewares=[_middleware])
    app[STATE] = ServiceState(pool, token or None, config, guard)
    app.router.add_post("/v1/run", handle_run)
    app.router.add_post("/v1/run_batch", handle_run_batch)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    return app
