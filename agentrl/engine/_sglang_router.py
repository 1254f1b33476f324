"""``SGLangEngine`` in front of ``sglang-router``: which URLs are routers, and their workers.

A URL is a router when ``GET /workers`` answers the router's worker list (an SGLang server or
``agentrl serve`` answers 404). The router balances plain ``/generate`` requests (its policy,
e.g. cache-aware) and broadcasts ``/flush_cache``, but it does not forward ``/open_session``,
``/close_session`` or ``/update_weights_from_disk``; so the engine talks to the workers it lists
for those: a session is opened on one worker and every turn goes straight to it (the worker that
holds the session's KV, whatever the router's policy), and weights are loaded on every healthy
worker, each one's ``weight_version`` read back afterwards. The worker URLs are the ones the
router was given: the client must reach them too.
"""

from __future__ import annotations

import httpx
import msgspec

from agentrl._errors import EngineError

from ._sglang_http import SGLangHTTPError, Transport, Upstream


class WireWorker(msgspec.Struct):
    """One entry of the router's ``GET /workers``."""

    url: str
    is_healthy: bool = True
    worker_type: str = "regular"


class WireWorkerList(msgspec.Struct):
    workers: list[WireWorker]


_workers_decoder = msgspec.json.Decoder(WireWorkerList)


def _healthy(body: bytes, url: str) -> list[str]:
    try:
        listing = _workers_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise EngineError(f"{url}/workers: unexpected reply: {exc}") from exc
    return [
        worker.url.rstrip("/")
        for worker in listing.workers
        if worker.is_healthy and worker.worker_type == "regular"
    ]


async def router_workers(http: Transport, server: Upstream) -> list[str] | None:
    """The healthy workers behind ``server`` when it is a router; ``None`` when it is not."""
    try:
        body = await http.call(server, "GET", "/workers", timeout=30)
    except SGLangHTTPError as exc:
        if exc.status in (404, 405):
            return None
        raise
    return _healthy(body, server.url)


def router_workers_blocking(http: Transport, server: Upstream) -> list[str] | None:
    """``router_workers`` without an event loop."""
    with httpx.Client(timeout=30, verify=http._verify, trust_env=False) as client:
        try:
            response = client.get(server.url + "/workers")
        except httpx.HTTPError as exc:
            raise EngineError(f"cannot list workers at {server.url}: {exc}") from exc
    if response.status_code in (404, 405):
        return None
    if response.status_code != 200:
        raise SGLangHTTPError("GET", server.url + "/workers", response.status_code, response.text)
    return _healthy(response.content, server.url)
