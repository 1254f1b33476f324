"""The sandbox service's HTTP application (aiohttp): ``make_app(pool)``.

``_serve.py`` runs it as ``python -m agentrl.sandboxes serve`` (one pool per process).

Routes (JSON bodies; the wire types are ``_types.RunRequest`` / ``RunResult``):

- ``POST /v1/run``: one ``RunRequest`` → ``RunResult``.
- ``POST /v1/run_batch``: ``{"requests": [...]}`` → ``{"results": [...]}``, one result per item
  in order; an invalid item gets ``status="invalid_request"`` (the field named in ``error``)
  and the others still run.
- ``GET /health``: backend, pool statistics, limits and the guarantees this host gives.
- ``GET /metrics``: Prometheus text.

Errors are structured, ``{"error": {"type", "message", "field"}}``: 400 ``malformed_json`` /
``invalid_request`` (naming the field), 401 ``unauthorized``, 404/405, 413
``request_too_large``, 429 ``busy`` with ``Retry-After`` (the pool is over capacity: nothing
ran, retrying is safe), 500 ``internal_error``. With a token, every route requires
``Authorization: Bearer <token>`` (compared in constant time).
"""

from __future__ import annotations

import hmac
import logging
import math
import re
import time
from collections import Counter
from typing import Any

import msgspec
from aiohttp import web

from ._errors import PoolBusy
from ._metrics import Exposition, Histogram
from ._pool import SandboxPool
from ._types import (
    BatchResult,
    ErrorBody,
    ErrorResponse,
    InvalidRequest,
    RunRequest,
    RunResult,
    decode_request,
    encode,
    validate_request,
)

log = logging.getLogger("agentrl.sandboxes.service")

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_BATCH = 256


class _RawBatch(msgspec.Struct, forbid_unknown_fields=True):
    requests: list[msgspec.Raw]


_raw_batch_decoder = msgspec.json.Decoder(_RawBatch)


class _State:
    """What the handlers share: the pool, the limits and the service's own metrics."""

    def __init__(
        self, pool: SandboxPool, token: str | None, max_batch: int, max_request_bytes: int
    ) -> None:
        self.pool = pool
        self.token = token
        self.max_batch = max_batch
        self.max_request_bytes = max_request_bytes
        self.http_requests: Counter[tuple[str, int]] = Counter()
        self.results: Counter[str] = Counter()
        self.busy_rejections = 0
        self.exec_seconds = Histogram()
        self.request_seconds = Histogram()
        self.started = time.time()


STATE = web.AppKey("agentrl_sandbox_state", _State)


def error_response(
    status: int, kind: str, message: str, field: str | None = None, headers: Any = None
) -> web.Response:
    body = encode(ErrorResponse(ErrorBody(type=kind, message=message, field=field)))
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _json(obj: Any) -> web.Response:
    body = encode(obj) if isinstance(obj, msgspec.Struct) else msgspec.json.encode(obj)
    return web.Response(body=body, content_type="application/json")


_FIELD_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_FIELD_NAME_RE = re.compile(r"(?:unknown|required) field `([^`]+)`")


def validation_field(exc: msgspec.ValidationError, prefix: str = "") -> str | None:
    """The field a msgspec validation error is about (``code``, ``files[...]``, ``foo``)."""
    message = str(exc)
    path = _FIELD_PATH_RE.search(message)
    name = _FIELD_NAME_RE.search(message)
    parts = [p for p in (prefix, path.group(1) if path else "", name.group(1) if name else "") if p]
    return ".".join(parts) if parts else (prefix or None)


def _route_name(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Bearer auth, structured errors for everything, per-route counters and latency."""
    state = request.app[STATE]
    started = time.perf_counter()
    route = _route_name(request)
    response: web.StreamResponse
    try:
        if state.token is not None and not _authorized(request, state.token):
            response = error_response(
                401,
                "unauthorized",
                "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = {
            404: "not_found",
            405: "method_not_allowed",
            413: "request_too_large",
        }.get(exc.status, "http_error")
        message = exc.text or exc.reason
        if exc.status == 413:
            message = f"request body exceeds the limit of {state.max_request_bytes} bytes"
        response = error_response(exc.status, kind, message)
    except Exception as exc:  # a bug of ours: answer, log, keep serving
        log.exception("internal error on %s", request.path)
        response = error_response(500, "internal_error", f"{type(exc).__name__}: {exc}")
    state.http_requests[(route, response.status)] += 1
    state.request_seconds.observe(time.perf_counter() - started, route=route)
    return response


def _authorized(request: web.Request, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def _busy(state: _State, exc: PoolBusy) -> web.Response:
    state.busy_rejections += 1
    retry_after = max(1, math.ceil(exc.retry_after_s))
    return error_response(
        429,
        "busy",
        f"over capacity, nothing ran; retry after {exc.retry_after_s:g} s ({exc})",
        headers={"Retry-After": str(retry_after)},
    )


def _record(state: _State, result: RunResult) -> None:
    state.results[result.status] += 1
    if result.status != "invalid_request":
        state.exec_seconds.observe(result.wall_s)


class _Invalid(msgspec.Struct):
    kind: str
    """malformed_json or invalid_request."""
    field: str | None
    message: str


def _decode_one(raw: bytes, prefix: str = "") -> RunRequest | _Invalid:
    """A validated request, or what is wrong with it, naming the field (never raises)."""
    try:
        req = decode_request(raw)
    except msgspec.ValidationError as exc:  # (a subclass of DecodeError: caught first)
        return _Invalid("invalid_request", validation_field(exc, prefix) or "request", str(exc))
    except msgspec.DecodeError as exc:
        return _Invalid("malformed_json", prefix or None, str(exc))
    try:
        validate_request(req)
    except InvalidRequest as exc:
        field = f"{prefix}.{exc.field}" if prefix else exc.field
        return _Invalid("invalid_request", field, str(exc).split(": ", 1)[-1])
    return req


async def handle_run(request: web.Request) -> web.Response:
    state = request.app[STATE]
    decoded = _decode_one(await request.read())  # past client_max_size: 413
    if isinstance(decoded, _Invalid):
        state.results["invalid_request"] += 1
        return error_response(400, decoded.kind, decoded.message, decoded.field)
    try:
        result = await state.pool.run(decoded)
    except PoolBusy as exc:
        return _busy(state, exc)
    _record(state, result)
    return _json(result)


async def handle_run_batch(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        batch = _raw_batch_decoder.decode(await request.read())
    except msgspec.ValidationError as exc:
        return error_response(400, "invalid_request", str(exc), validation_field(exc))
    except msgspec.DecodeError as exc:
        return error_response(400, "malformed_json", str(exc))
    if len(batch.requests) > state.max_batch:
        return error_response(
            400,
            "invalid_request",
            f"{len(batch.requests)} requests; the limit is {state.max_batch} per batch",
            "requests",
        )
    results: list[RunResult | None] = [None] * len(batch.requests)
    valid: list[tuple[int, RunRequest]] = []
    for i, raw in enumerate(batch.requests):
        decoded = _decode_one(bytes(raw), f"requests[{i}]")
        if isinstance(decoded, _Invalid):
            results[i] = RunResult(
                status="invalid_request",
                error=f"{decoded.field}: {decoded.message}",
                backend=state.pool.backend_name,
            )
        else:
            valid.append((i, decoded))
    if valid:
        try:
            ran = await state.pool.run_batch([req for _, req in valid])
        except PoolBusy as exc:
            return _busy(state, exc)
        for (i, _), result in zip(valid, ran, strict=True):
            results[i] = result
    final = [r for r in results if r is not None]
    for result in final:
        _record(state, result)
    return _json(BatchResult(results=final))


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pool = state.pool
    config = pool.config
    return _json(
        {
            "status": "ok",
            "backend": pool.backend_name,
            "statistics": msgspec.to_builtins(pool.statistics()),
            "guarantees": msgspec.to_builtins(pool.guarantees()),
            "limits": {
                "size": config.size,
                "max_queue": config.max_queue,
                "queue_timeout_s": config.queue_timeout_s,
                "recycle_after": config.recycle_after,
                "max_batch": state.max_batch,
                "max_request_bytes": state.max_request_bytes,
            },
            "uptime_s": round(time.time() - state.started, 3),
        }
    )


async def handle_metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = state.pool.statistics()
    backend = {"backend": stats.backend}
    m = Exposition()
    m.add("agentrl_sandbox_execs_total", "counter", "Requests that ran.", [(backend, stats.execs)])
    m.add(
        "agentrl_sandbox_failures_total",
        "counter",
        "Pool results by non-ok status.",
        [({**backend, "status": s}, n) for s, n in sorted(stats.failures.items())],
    )
    m.add(
        "agentrl_sandbox_results_total",
        "counter",
        "Results the service returned, by status.",
        [({**backend, "status": s}, n) for s, n in sorted(state.results.items())],
    )
    for name, value, help_text in (
        ("in_use", stats.in_use, "Sandboxes running a request."),
        ("idle", stats.idle, "Warm sandboxes ready."),
        ("queued", stats.queued, "Requests waiting for a sandbox."),
        ("creating", stats.creating, "Sandboxes being created."),
    ):
        m.add(f"agentrl_sandbox_{name}", "gauge", help_text, [(backend, value)])
    for name, value, help_text in (
        ("recycles", stats.recycles, "Sandboxes replaced."),
        ("created", stats.created, "Sandboxes created."),
        ("destroyed", stats.destroyed, "Sandboxes destroyed."),
        ("create_failures", stats.create_failures, "Sandbox creates that failed."),
    ):
        m.add(f"agentrl_sandbox_{name}_total", "counter", help_text, [(backend, value)])
    m.add(
        "agentrl_sandbox_busy_rejections_total",
        "counter",
        "Requests answered 429 (over capacity).",
        [(backend, state.busy_rejections)],
    )
    m.add(
        "agentrl_sandbox_http_requests_total",
        "counter",
        "HTTP requests by route and status code.",
        [({"route": r, "code": str(c)}, n) for (r, c), n in sorted(state.http_requests.items())],
    )
    m.add_histogram(
        "agentrl_sandbox_exec_seconds", "Wall time of each program run.", state.exec_seconds
    )
    m.add_histogram(
        "agentrl_sandbox_http_request_seconds",
        "Time to answer an HTTP request, by route.",
        state.request_seconds,
    )
    return web.Response(text=m.text(), content_type="text/plain", charset="utf-8")


def make_app(
    pool: SandboxPool,
    *,
    token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> web.Application:
    """The aiohttp application serving ``pool`` (which the caller opens and closes)."""
    app = web.Application(client_max_size=max_request_bytes, middlewares=[_middleware])
    app[STATE] = _State(pool, token or None, max_batch, max_request_bytes)
    app.router.add_post("/v1/run", handle_run)
    app.router.add_post("/v1/run_batch", handle_run_batch)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    return app
