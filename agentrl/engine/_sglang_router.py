"""``SGLangEngine`` in front of ``sglang-router``: which URLs are routers, and their workers.

A URL is a router when ``GET /workers`` answers the router's worker list (an SGLang server or
``agentrl serve`` answers 404). The router balances plain ``/generate`` requests (its policy,
e.g. cache-aware) and broadcasts ``/flush_cache``, but it does not forward ``/open_session``,
``/close_session`` or ``/update_weights_from_disk``; so the engine talks to the workers it lists
for those: a session is opened on one worker and every turn goes straight to it (the worker that
holds the session's KV, whatever the router's policy), and weights are loaded on every healthy
worker, each one's ``weight_version`` read back afterwards. The worker URLs are the ones the
router was given: the client must reach them too.

Only the policy's workers are used: those whose ``model_id`` is the engine's ``model`` (when not
given, the one model the router lists at the first listing; a router that lists several is
refused until one is named) or a version the run published weights from (a folder of the
engine's ``snapshot_dir``, or a path given to its ``update_weights``). A worker listed under
another id later (another model registered) is left out. When a router lists workers the
engine leaves out, plain requests go straight to the policy's workers instead of through it
(the router's routing ignores the request's model).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import msgspec

from agentrl._errors import EngineError

from ._sglang_http import SGLangHTTPError, Transport, Upstream


class WireWorker(msgspec.Struct):
    """One entry of the router's ``GET /workers``."""

    url: str
    is_healthy: bool = True
    worker_type: str = "regular"
    model_id: str | None = None
    """The model the worker serves, as the router registered it (the worker's
    ``served_model_name`` then; SGLang's default is its model path)."""


Worker = tuple[str, str | None, bool]
"""A worker a router lists: its URL, model id and whether the router finds it healthy."""


class WireWorkerList(msgspec.Struct):
    workers: list[WireWorker]


_workers_decoder = msgspec.json.Decoder(WireWorkerList)


def _regular(body: bytes, url: str) -> list[Worker]:
    try:
        listing = _workers_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise EngineError(f"{url}/workers: unexpected reply: {exc}") from exc
    regular = [
        (worker.url.rstrip("/"), worker.model_id, worker.is_healthy)
        for worker in listing.workers
        if worker.worker_type == "regular"
    ]
    if listing.workers and not regular:
        kinds = ", ".join(sorted({worker.worker_type for worker in listing.workers}))
        raise EngineError(
            f"the router at {url} lists only {kinds} workers (prefill/decode disaggregation), "
            "which agentrl does not drive: give the run a router of regular workers"
        )
    return regular


def the_model(
    listed: list[Worker],
    policy: set[str | None] | None,
    published: Callable[[str], bool],
    router: str,
) -> tuple[list[str], set[str | None], bool]:
    """The policy's healthy workers among those a router lists, the policy's model ids, and
    whether the router lists any other worker. A policy worker is listed under one of
    ``policy`` (``None`` in it: a worker listed without a model id) or, once it loaded a
    version the run published, under that version's path (``published``; a worker registered
    after loading one is listed so). ``policy`` None (not known yet, the first listing): the
    router's workers, healthy or not, must be of at most one model besides published versions,
    and that is the policy's (none: only published versions are). ``EngineError`` when they
    are of several, or no healthy worker is the policy's."""
    ids = {m for _, m, _ in listed if m is None or not published(m)}
    names = ", ".join(sorted("(no model_id)" if m is None else m for m in ids))
    if policy is None:
        if len(ids) > 1:
            raise EngineError(
                f"the router at {router} serves several models ({names}): set server.model "
                "(SGLangEngine(model=...)) to the policy's, so neither requests nor published "
                "weights reach another model's workers"
            )
        policy = ids

    def ours(m: str | None) -> bool:
        return m in policy or (m is not None and published(m))

    mine = [(url, healthy) for url, m, healthy in listed if ours(m)]
    healthy = [url for url, ok in mine if ok]
    if not healthy:
        if not any(ok for _, _, ok in listed):
            raise EngineError(f"the router at {router} lists no healthy worker")
        wanted = ", ".join(repr(m) for m in sorted(policy, key=str)) or "a published version"
        raise EngineError(
            f"no healthy worker of the router at {router} serves model {wanted} (it lists {names})"
        )
    return healthy, policy, len(mine) < len(listed)


async def router_workers(http: Transport, server: Upstream) -> list[Worker] | None:
    """The workers behind ``server`` when it is a router; ``None`` when it is not."""
    try:
        body = await http.call(server, "GET", "/workers", timeout=30)
    except SGLangHTTPError as exc:
        if exc.status in (404, 405):
            return None
        raise
    return _regular(body, server.url)


def router_workers_blocking(http: Transport, server: Upstream) -> list[Worker] | None:
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
    return _regular(response.content, server.url)
