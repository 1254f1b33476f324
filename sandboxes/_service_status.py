"""The sandbox service's status routes: ``GET /health`` (JSON) and ``GET /metrics``
(Prometheus text) — the pool's statistics and the service's own (bytes in flight, connections,
timeouts, answers by status)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from ._metrics import Exposition
from ._service_state import STATE, ServiceState


def _json(obj: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")


def _limits(state: ServiceState) -> dict[str, Any]:
    config = state.pool.config
    return {
        "size": config.size,
        "max_queue": config.max_queue,
        "queue_timeout_s": config.queue_timeout_s,
        "recycle_after": config.recycle_after,
        **state.config.model_dump(),
    }


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pool = state.pool
    service: dict[str, Any] = {
        "inflight_bytes": state.budget.held,
        "inflight_peak_bytes": state.budget.peak,
        "overloaded_refusals": state.budget.refusals,
        "inflight_overdrafts": state.budget.overdrafts,
    }
    if state.guard is not None:
        service["connections"] = msgspec.to_builtins(state.guard.statistics())
    return _json(
        {
            "status": "ok",
            "backend": pool.backend_name,
            "statistics": msgspec.to_builtins(pool.statistics()),
            "service": service,
            "guarantees": msgspec.to_builtins(pool.guarantees()),
            "limits": _limits(state),
            "uptime_s": round(time.time() - state.started, 3),
        }
    )


def _service_metrics(m: Exposition, state: ServiceState) -> None:
    budget = state.budget
    m.add("agentrl_sandbox_inflight_bytes", "gauge", "Bytes reserved now.", [({}, budget.held)])
    m.add(
        "agentrl_sandbox_inflight_capacity_bytes",
        "gauge",
        "max_inflight_bytes.",
        [({}, budget.capacity)],
    )
    m.add(
        "agentrl_sandbox_overloaded_total",
        "counter",
        "Requests answered 503 because the byte budget was full.",
        [({}, budget.refusals)],
    )
    m.add(
        "agentrl_sandbox_inflight_overdrafts_total",
        "counter",
        "Answers whose text took the reserved bytes past max_inflight_bytes.",
        [({}, budget.overdrafts)],
    )
    m.add(
        "agentrl_sandbox_http_timeouts_total",
        "counter",
        "Requests whose body came too slowly (408) or whose answer was not taken in time.",
        [({"phase": "body"}, state.body_timeouts), ({"phase": "send"}, state.send_timeouts)],
    )
    if state.guard is None:
        return
    stats = state.guard.statistics()
    m.add("agentrl_sandbox_connections", "gauge", "Open connections.", [({}, stats.open)])
    m.add(
        "agentrl_sandbox_connections_closed_total",
        "counter",
        "Connections the service closed or turned away, by reason.",
        [
            ({"reason": "evicted"}, stats.evicted),
            ({"reason": "refused"}, stats.refused),
            ({"reason": "idle_timeout"}, stats.idle_timeouts),
            ({"reason": "header_timeout"}, stats.header_timeouts),
            ({"reason": "head_too_large"}, stats.head_too_large),
        ],
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
    _service_metrics(m, state)
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
