"""``SGLangEngine``: the ``Engine`` protocol over SGLang's HTTP API (SGLang 0.5.17, agentrl serve).

Requests go through httpx (anyio-native: trio and asyncio). Every ``/generate`` asks for
``return_logprob`` with ``logprob_start_len=-1`` (output logprobs only), ``no_stop_trim`` and
``skip_special_tokens=false``; ids and logprobs come from ``meta_info.output_token_logprobs``.

Sessions. ``open_session`` opens a server session on one server and pins the trajectory there
(sticky routing; new sessions go to the server with the fewest sessions and requests). It asks
for a streaming session (KV kept between turns) and falls back to a classic one when the server
refuses. The caller always passes the whole context; the engine remembers what the server holds
for the session (the last request's input + output, as SGLang prepends them) and sends only the
new suffix with ``session_params.rid`` naming the last request. When the context does not extend
what the server holds (or the suffix starts with BOS, which SGLang would strip), it starts over:
a new root request with the whole context (classic), or a fresh server session (streaming).
A reply whose ``prompt_tokens`` differs from the context length, or a 400 that mentions the
session, drops the session state and the request is repeated without the session.
Weight updates restart every session's chain (streaming KV was computed with the old weights).

Routers (``_sglang_router``). A URL that answers ``GET /workers`` is an ``sglang-router``: plain
requests go through it (its policy balances them), while sessions, weight updates and model
info go to the healthy workers it lists that serve the policy's model, so a session's turns
always reach the worker holding its KV (a router that also lists other models' workers is
bypassed: plain requests go to the policy's workers directly). Each weight update asks the
router for its workers again (and once more after loading, so a worker registered meanwhile
gets the weights too) and reads every worker's ``weight_version`` back. A session whose worker
stops accepting connections, or was left out of a weight update, moves to another worker and
sends its whole context there.

Failures. A server that refuses the connection (nothing was sent) hands the request to another
server; so does one that dies while it runs the request (the connection breaks and the server
refuses connections afterwards: the request runs nowhere), once per request. A session moves
with the request, its whole context sent to the new server.

Connections (``_sglang_http``): one pooled ``httpx.AsyncClient`` lives while requests are in
flight; ``async with engine:`` keeps it (and its keep-alive connections) for the whole block.
Used without ``async with`` (e.g. handed to ``agentrl.rollout``), the pool closes whenever the
engine goes idle, so no socket outlives the event loop. Connection failures (nothing was sent)
are retried with backoff; timeouts, broken connections and HTTP errors raise ``EngineError``
naming URL, status and body (``SGLangHTTPError`` for an HTTP error status).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec

from agentrl._config import short_repr
from agentrl._errors import EngineError
from agentrl._types import GenerateResult, SamplingParams

from . import _wire as w
from ._options import IN_FLIGHT_RULES
from ._sglang_http import SGLangHTTPError, Transport, Upstream, to_result, wire_sampling
from ._sglang_router import Worker, router_workers, router_workers_blocking, the_model
from ._sglang_servers import (
    answering,
    broken,
    connection_refused,
    placement,
    refused,
    server_urls,
)

T = TypeVar("T")

_DEATH_PROBES = 10
_DEATH_WAIT_S = 2.0
"""After a connection broke mid-request: health probes, and for how long, while each is
accepted and dropped unanswered (a refused one says the server's process ended)."""


class SGLangStatistics(msgspec.Struct, frozen=True):
    """Counters since the engine was created (``SGLangEngine.statistics()``)."""

    requests: int
    session_requests: int
    """Requests that sent only a suffix inside a session."""
    tokens_sent: int
    tokens_saved: int
    """Context tokens not sent because the session held them."""
    session_restarts: int
    fallbacks: int
    """Session requests repeated without the session (server refused or disagreed)."""
    session_moves: int
    """Sessions moved to another of a router's workers because theirs stopped accepting
    connections or was left out of a weight update (the whole context is sent again there)."""
    workers_skipped: int
    """Workers a router no longer listed as healthy when weights were published (left out)."""
    regenerated: int
    """Requests sampled again on another server because theirs died while running them (the
    connection broke, and the server refused connections since)."""
    connect_retries: int


@dataclass(eq=False)
class _Session:
    server: Upstream
    capacity: int
    remote_id: str | None = None
    streaming: bool = False
    used: bool = False
    """The remote session already holds a turn (streaming sessions can only be appended to)."""
    history: list[int] | None = None
    """What the server holds for ``last_rid``: its input + output ids."""
    last_rid: str | None = None
    busy: bool = False
    behind: bool = False
    """Its worker was left out of the last weight update (the router listed it unhealthy):
    the next turn moves to a worker that holds the new weights."""


class SGLangEngine:
    """The ``Engine`` protocol over one or more SGLang-compatible servers. See the module docs.

    ``max_context`` defaults to the smallest ``max_model_len`` the servers report on
    ``/v1/models``; ``bos_token_id`` defaults to ``bos_token_id`` in the served model's
    ``config.json`` when that folder exists on this machine. ``in_flight``: the rule for
    requests in flight across a weight update that every server must run (``EngineError`` when
    connecting otherwise): SGLang runs ``"finish"``, ``agentrl serve`` reports its own.
    ``GenerateResult.token_versions`` comes from ``agentrl serve``'s ``meta_info`` extension
    when the tokens span versions, else every token gets the reply's ``weight_version``.
    ``model``: the policy's model id behind routers (the ``model_id`` the router lists for its
    workers, their ``--served-model-name``); needed only when a router serves several models.
    ``snapshot_dir``: where the run publishes weights from; a worker a router lists under a path
    inside it (one registered after loading a published version) is the policy's too.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        max_context: int | None = None,
        bos_token_id: int | None = None,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        connect_retries: int = 3,
        streaming_sessions: bool = True,
        session_timeout_s: float | None = 3600.0,
        in_flight: str = "finish",
        model: str | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        urls = server_urls(urls)
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise EngineError(f"model: expected a model id, got {short_repr(model)}")
        if in_flight not in IN_FLIGHT_RULES:
            raise EngineError(
                f"in_flight: expected one of {', '.join(IN_FLIGHT_RULES)}, "
                f"got {short_repr(in_flight)}"
            )
        self.in_flight = in_flight
        self._entry = [Upstream(u) for u in urls]
        """The given URLs (servers and routers)."""
        self._plain_to = list(self._entry)
        """Where plain requests go: the given URLs, but a router that lists other models'
        workers too is replaced by the policy's workers."""
        self._policy: set[str | None] | None = None if model is None else {model}
        """The model ids of the policy's workers behind routers (None: not known yet; told
        from the first listing when no ``model`` is given)."""
        self._published: set[str] = set()
        """The paths weights were published from (a worker that loaded one reports it)."""
        self._snapshots = None if snapshot_dir is None else os.path.normpath(snapshot_dir)
        self._routers: list[Upstream] = []
        self._servers = list(self._entry)
        """The servers themselves (a router's healthy workers in its place): sessions,
        weights, model info."""
        self._max_context = max_context
        self._bos = bos_token_id
        self._streaming = streaming_sessions
        self._session_timeout = session_timeout_s
        https = any(s.url.startswith("https") for s in self._entry)
        self._http = Transport(request_timeout_s, connect_timeout_s, connect_retries, https)
        self._sessions: dict[str, _Session] = {}
        self._weight_version = 0
        self.flush_timeout_s = 120.0
        self.flush_retries = 0  # /flush_cache refusals seen after weight updates
        self._connected = False
        self._connecting: anyio.Event | None = None
        self._closed = False
        self._scopes: set[anyio.CancelScope] = set()
        self._hold: AsyncExitStack | None = None
        self._turn = 0
        self._counts = dict.fromkeys(SGLangStatistics.__struct_fields__[:-1], 0)

    # --- protocol properties ----------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def max_context(self) -> int:
        """Most tokens one request may reach (asks the servers, blocking, if still unknown)."""
        if self._max_context is None:
            if not self._connected:
                self._expand([(s, router_workers_blocking(self._http, s)) for s in self._entry])
            for server in self._servers:
                self._http.probe_blocking(server)
            self._settle()
        if self._max_context is None:
            raise EngineError("the servers report no context length: pass max_context=")
        return self._max_context

    def statistics(self) -> SGLangStatistics:
        return SGLangStatistics(**self._counts, connect_retries=self._http.connect_retries)

    # --- connection ---------------------------------------------------------------------------

    async def connect(self) -> None:
        """Find the routers among the URLs and their workers, then read every server's model
        info (weight version, context length, model path)."""
        await self._list_workers()
        await _each(self._servers, self._http.probe)
        self._settle()

    async def _list_workers(self) -> None:
        """Ask each URL whether it is a router (``GET /workers``) and use its healthy workers
        as the servers; workers already known keep their state (sessions, loads)."""
        found: list[tuple[Upstream, list[Worker] | None]] = []

        async def ask(entry: Upstream) -> None:
            try:
                workers = await router_workers(self._http, entry)
            except SGLangHTTPError:  # it answered: its own error says what went wrong
                raise
            except EngineError as exc:  # the first request to it: name the URL given
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                raise EngineError(
                    f"no server answers at {entry.url} (is it running there, and is the "
                    f"address right?): {cause!r}"
                ) from exc
            found.append((entry, workers))

        await _each(self._entry, ask)
        self._expand(sorted(found, key=lambda pair: self._entry.index(pair[0])))

    def _expand(self, found: list[tuple[Upstream, list[Worker] | None]]) -> None:
        known = {s.url: s for s in self._servers}
        servers: list[Upstream] = []
        plain: list[Upstream] = []
        routers: list[Upstream] = []
        policy = self._policy
        for entry, listed in found:
            if listed is None:
                servers.append(entry)
                plain.append(entry)
                continue
            urls, policy, mixed = the_model(listed, policy, self._is_published, entry.url)
            workers = [known.get(url) or Upstream(url) for url in urls]
            routers.append(entry)
            servers.extend(workers)
            plain.extend(workers if mixed else [entry])
        self._policy = policy
        self._routers = routers
        self._servers = list({s.url: s for s in servers}.values())
        self._plain_to = list({s.url: s for s in plain}.values())

    def _settle(self) -> None:
        self._check_in_flight()
        self._connected = True
        self._weight_version = min(s.weight_version for s in self._servers)
        contexts = [s.max_context for s in self._servers if s.max_context]
        if self._max_context is None and contexts:
            self._max_context = min(contexts)
        if self._bos is None and self._servers[0].model_path:
            config = Path(self._servers[0].model_path) / "config.json"
            try:
                bos = json.loads(config.read_text()).get("bos_token_id")
            except (OSError, ValueError):
                bos = None
            self._bos = bos if isinstance(bos, int) else None

    def _is_published(self, model_id: str) -> bool:
        """Whether a worker listed as ``model_id`` loaded weights this run published: a path
        given to ``update_weights``, or a version folder (``v`` and digits) of
        ``snapshot_dir``, however either is spelled."""
        path = os.path.normpath(model_id)
        if path in self._published:
            return True
        folder, name = os.path.split(path)
        return (
            self._snapshots is not None
            and folder == self._snapshots
            and name.startswith("v")
            and name[1:].isdigit()
        )

    def _check_in_flight(self) -> None:
        """Every server must run the ``in_flight`` rule this engine was opened with: the rule
        is the server's (SGLang finishes requests in flight on their old weights and cannot
        report per-token versions; ``agentrl serve --in-flight`` chooses)."""
        wrong = [s for s in self._servers if s.in_flight != self.in_flight]
        if wrong:
            found = ", ".join(f"{s.url} runs {s.in_flight!r}" for s in wrong)
            raise EngineError(
                f"in_flight={self.in_flight!r} cannot be honoured: {found} (SGLang always "
                "finishes requests in flight on their old weights; agentrl serve takes "
                "--in-flight finish|abort|partial)"
            )

    async def _ready(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")
        while not self._connected:  # one probe at a time; the others wait for its outcome
            if self._connecting is None:
                self._connecting = anyio.Event()
                try:
                    await self.connect()
                finally:
                    event, self._connecting = self._connecting, None
                    event.set()
            else:
                await self._connecting.wait()

    # --- generate -----------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> GenerateResult:
        """Sample a continuation of the whole context ``input_ids`` (see the module docs)."""
        await self._ready()
        ids = [int(t) for t in input_ids]
        if not ids:
            raise EngineError("input_ids is empty")
        state = None
        if session is not None:
            state = self._sessions.get(session)
            if state is None:
                raise EngineError(f"unknown session {session!r}")
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                if state is None:
                    return await self._plain(ids, sampling)
                if state.busy:
                    return await self._generate(state.server, ids, ids, sampling)
                state.busy = True
                try:
                    return await self._session_turn(state, ids, sampling)
                finally:
                    state.busy = False
            finally:
                self._scopes.discard(scope)
        # only reached when aclose() cancelled this request
        version = self._weight_version
        return GenerateResult([], [], "abort", prompt_tokens=len(ids), weight_version=version)

    async def _plain(self, ids: list[int], sampling: SamplingParams) -> GenerateResult:
        """A request outside sessions to the least-loaded of the servers and routers plain
        requests go to; one that refuses the connection (nothing was sent), or dies while it
        runs the request (``_died``), hands it to another, when there is another (a request
        is sent again after a death once)."""
        tried: list[Upstream] = []
        again = False
        while True:
            server = self._least_loaded(sessions=False, avoid=tried)
            try:
                return await self._generate(server, ids, ids, sampling)
            except EngineError as exc:
                if len(tried) + 1 >= len(self._plain_to):
                    raise
                if not refused(exc):  # a router that died may have passed it on: not again
                    in_router = any(server is r for r in self._routers)
                    if again or in_router or not await self._died(server, exc):
                        raise
                    again = True
                    self._counts["regenerated"] += 1
                server.refused_at = time.monotonic()
                tried.append(server)

    async def _session_turn(
        self, state: _Session, ids: list[int], sampling: SamplingParams
    ) -> GenerateResult:
        """One turn; a server that refuses connections (so nothing was sent), or dies while it
        runs the turn (``_died``), loses the session to another server, where the turn starts
        over with the whole context (once)."""
        if state.behind:
            state.behind = False
            await self._move(state, relist=False)
        try:
            return await self._in_session(state, ids, sampling)
        except EngineError as exc:
            if len(self._servers) < 2 and not self._routers:
                raise
            died = not refused(exc)
            if died and not await self._died(state.server, exc):
                raise
            state.server.refused_at = time.monotonic()
            if not await self._move(state, relist=bool(self._routers), alive=False):
                raise
            if died:
                self._counts["regenerated"] += 1
        return await self._in_session(state, ids, sampling)

    async def _died(self, server: Upstream, exc: EngineError) -> bool:
        """Whether ``exc`` is the connection breaking mid-request (the request was sent) and
        ``server`` refuses connections since: its process ended, so the request runs nowhere
        and sampling it again elsewhere cannot run it twice. Probes that are accepted and
        dropped unanswered (a process still closing its sockets as it exits, or a forwarder
        whose server may be alive behind it) are repeated for up to ``_DEATH_WAIT_S``; a server
        that answers, does not answer in time, or is never refused keeps the failure (and a
        request that brought one down is sent again only once)."""
        if not broken(exc):
            return False
        for _ in range(_DEATH_PROBES):
            try:
                await self._http.call(server, "GET", "/health", timeout=10, retries=0)
            except EngineError as probe:
                if connection_refused(probe):
                    return True
                if not broken(probe):
                    return False
                await anyio.sleep(_DEATH_WAIT_S / _DEATH_PROBES)
            else:
                return False  # it answered
        return False

    async def _move(self, state: _Session, *, relist: bool = True, alive: bool = True) -> bool:
        """Put the session on another server (a router's workers asked again when ``relist``),
        preferring those at the engine's weight version; its next turn sends the whole
        context there. The old server's session is closed when it is ``alive``. False when
        there is no other server."""
        if relist:
            await self._list_workers()
        others = [s for s in self._servers if s.url != state.server.url]
        if not others:
            return False
        others = answering(others) or others
        current = [s for s in others if s.weight_version == self._weight_version]
        old, state.server = state.server, min(current or others, key=placement)
        old.sessions -= 1
        state.server.sessions += 1
        if state.remote_id is not None and alive:  # free its KV there
            try:
                await self._close_remote(old, state.remote_id)
            except EngineError:
                pass
        state.remote_id, state.history, state.last_rid, state.used = None, None, None, False
        self._counts["session_moves"] += 1
        return True

    async def _in_session(
        self, state: _Session, ids: list[int], sampling: SamplingParams
    ) -> GenerateResult:
        held = state.history
        if state.remote_id is not None and held and _extends(ids, held, self._bos):
            params = w.WireSessionParams(id=state.remote_id, rid=state.last_rid)
            send = ids[len(held) :]
        else:
            if state.remote_id is None or (state.streaming and state.used):
                await self._restart(state)
            params, send = w.WireSessionParams(id=state.remote_id), ids
        rid = uuid.uuid4().hex
        try:
            result = await self._generate(state.server, ids, send, sampling, rid, params)
        except SGLangHTTPError as exc:
            if exc.status != 400 or "session" not in exc.body.lower():
                raise
            result = None
        state.used = True
        if result is None or result.prompt_tokens != len(ids):
            # the server refused the session request or built another context: start over
            self._counts["fallbacks"] += 1
            state.history, state.last_rid = None, None
            if state.streaming:
                await self._restart(state)
            return await self._generate(state.server, ids, ids, sampling)
        if send is not ids:
            self._counts["session_requests"] += 1
            self._counts["tokens_saved"] += len(ids) - len(send)
        ok = result.finish_reason != "abort"
        state.history = ids + list(result.token_ids) if ok else None
        state.last_rid = rid if ok else None
        return result

    async def _generate(
        self,
        server: Upstream,
        context: list[int],
        send: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        session: w.WireSessionParams | None = None,
    ) -> GenerateResult:
        request = w.WireGenerateReq(
            input_ids=list(send),
            sampling_params=wire_sampling(sampling),
            rid=rid or uuid.uuid4().hex,
            return_logprob=True,
            logprob_start_len=-1,
            session_params=session,
        )
        server.inflight += 1
        try:
            body = await self._http.call(server, "POST", "/generate", request)
        finally:
            server.inflight -= 1
        server.refused_at = None
        self._counts["requests"] += 1
        self._counts["tokens_sent"] += len(send)
        try:
            reply = w.generate_resp_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise EngineError(f"{server.url}/generate: unexpected reply: {exc}") from exc
        if isinstance(reply, list):
            if len(reply) != 1:
                raise EngineError(f"{server.url}/generate: {len(reply)} results for one request")
            reply = reply[0]
        return to_result(
            reply, sampling, self._weight_version, server.url, session is None, context
        )

    def _least_loaded(self, *, sessions: bool, avoid: Sequence[Upstream] = ()) -> Upstream:
        """The server for a new session (fewest sessions, then requests) or a plain request
        (fewest requests), among those not in ``avoid`` that have not refused a connection
        lately (all of them when none is left)."""
        self._turn += 1
        pool = self._servers if sessions else self._plain_to
        left = [s for s in pool if all(s is not a for a in avoid)]
        pool = answering(left) or left or pool
        order = pool[self._turn % len(pool) :] + pool
        if sessions:
            return min(order, key=placement)
        return min(order, key=lambda s: s.inflight)

    # --- sessions -----------------------------------------------------------------------------

    async def open_session(self, capacity_tokens: int | None = None) -> str:
        """Open a session on the least-loaded server; its requests stay on that server."""
        await self._ready()
        if capacity_tokens is not None and capacity_tokens < 2:
            raise EngineError(f"capacity_tokens must be >= 2, got {capacity_tokens}")
        capacity = capacity_tokens or self.max_context
        tried: list[Upstream] = []
        while True:  # a server that refuses the connection (nothing was sent): another one
            state = _Session(self._least_loaded(sessions=True, avoid=tried), capacity)
            try:
                await self._open_remote(state)
                break
            except EngineError as exc:
                if not refused(exc) or len(tried) + 1 >= len(self._servers):
                    raise
                state.server.refused_at = time.monotonic()
                tried.append(state.server)
        state.server.refused_at = None
        session_id = uuid.uuid4().hex
        self._sessions[session_id] = state
        state.server.sessions += 1
        return session_id

    async def _open_remote(self, state: _Session) -> None:
        streaming = self._streaming and state.server.streaming is not False
        request = w.WireOpenSessionReq(
            capacity_of_str_len=state.capacity,
            session_id=uuid.uuid4().hex,
            streaming=streaming or None,
            timeout=self._session_timeout,
        )
        try:
            body = await self._http.call(state.server, "POST", "/open_session", request)
        except SGLangHTTPError as exc:
            if not streaming or exc.status != 400:
                raise
            state.server.streaming = streaming = False  # no streaming sessions there
            request.streaming = None
            body = await self._http.call(state.server, "POST", "/open_session", request)
        try:
            remote = w.session_id_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise EngineError(f"{state.server.url}/open_session: unexpected reply: {exc}") from exc
        if not remote:
            raise EngineError(f"{state.server.url}/open_session returned no session id")
        if streaming:
            state.server.streaming = True
        state.remote_id, state.streaming, state.used = remote, streaming, False
        state.history, state.last_rid = None, None

    async def _restart(self, state: _Session) -> None:
        """A fresh server session on the same server (the old one is closed, best effort)."""
        if state.remote_id is not None:
            self._counts["session_restarts"] += 1
            old, state.remote_id = state.remote_id, None
            try:
                await self._close_remote(state.server, old)
            except EngineError:
                pass
        await self._open_remote(state)

    async def _close_remote(self, server: Upstream, remote_id: str) -> None:
        with anyio.CancelScope(shield=True):
            request = w.WireCloseSessionReq(remote_id)
            await self._http.call(server, "POST", "/close_session", request, timeout=30)

    async def close_session(self, session_id: str) -> None:
        state = self._sessions.pop(session_id, None)
        if state is None:
            raise EngineError(f"unknown session {session_id!r}")
        state.server.sessions -= 1
        if state.remote_id is not None:
            await self._close_remote(state.server, state.remote_id)

    # --- weights and lifetime -------------------------------------------------------------

    async def update_weights(self, version: int, source: str | dict[str, Any]) -> None:
        """``/update_weights_from_disk`` on every server (``source``: a folder they can read),
        then ``/flush_cache`` on each, then each server's ``weight_version`` is read back and
        must be ``version``. Behind a router, "every server" is every worker it lists as
        healthy at this moment (asked again here, so workers added since are included, and
        asked once more afterwards: a worker registered while the weights loaded is updated
        too, up to three rounds). Sessions on a worker left out move to an updated worker on
        their next turn, so they never go on sampling from the old weights.

        The update asks for no flush: SGLang 0.5.17's scheduler dies on
        ``flush_cache: true`` while any request is running (an assertion after loading the
        weights takes the whole server down). ``/flush_cache`` instead refuses with 400 while
        requests run, so it is retried until they are done (``flush_timeout_s``); KV computed
        by the old weights is never reused for a prefix once this returns."""
        await self._ready()
        if not isinstance(source, str | os.PathLike):
            raise EngineError("SGLangEngine updates weights from a path only; save the tensors")
        if self._routers:
            before = {s.url for s in self._servers}
            await self._list_workers()
            self._counts["workers_skipped"] += len(before - {s.url for s in self._servers})
        request = w.WireUpdateWeightsFromDiskReq(
            model_path=os.fspath(source), weight_version=str(int(version)), flush_cache=False
        )
        self._published.add(os.path.normpath(request.model_path))
        failures: list[str] = []
        updated: list[Upstream] = []

        async def one(server: Upstream) -> None:
            try:
                body = await self._http.call(server, "POST", "/update_weights_from_disk", request)
                reply = w.update_weights_resp_decoder.decode(body)
                if not reply.success:
                    failures.append(f"{server.url}: {reply.message}")
                    return
            except (EngineError, msgspec.DecodeError) as exc:
                failures.append(f"{server.url}: {exc}")
                return
            try:
                flushed = await self._flush(server)
            except EngineError as exc:  # every server's outcome is reported, none cut short
                failures.append(f"{server.url}: weights loaded, then /flush_cache failed: {exc}")
                return
            if not flushed:
                failures.append(
                    f"{server.url}: weights are at version {int(version)} but /flush_cache kept "
                    f"refusing for {self.flush_timeout_s:g} s (requests running): prefix KV "
                    "from the old weights may be reused"
                )
            try:
                await self._http.probe(server)
            except EngineError as exc:
                failures.append(f"{server.url}: cannot read its weight_version back: {exc}")
                return
            if server.weight_version != int(version):
                failures.append(
                    f"{server.url}: reports weight_version {server.weight_version} after loading "
                    f"version {int(version)}"
                )
                return
            updated.append(server)

        for round_ in range(3):  # a worker the router takes on meanwhile gets this version too
            pending = [s for s in self._servers if all(s is not u for u in updated)]
            if not pending:
                break
            async with anyio.create_task_group() as tg:
                for server in pending:
                    tg.start_soon(one, server)
            if failures or not self._routers or round_ == 2:
                break  # (one that joins during the last round gets the next version)
            try:
                await self._list_workers()
            except EngineError as exc:
                failures.append(f"cannot list the router's workers again: {exc}")
        if all(any(s is u for u in updated) for s in self._servers):
            self._weight_version = int(version)  # every server now serves this version
            for state in self._sessions.values():
                state.history, state.last_rid = None, None
                state.behind = self._routers != [] and all(state.server is not u for u in updated)
        if failures:
            raise EngineError("update_weights failed on " + "; ".join(failures))

    async def _flush(self, server: Upstream) -> bool:
        """``/flush_cache`` until it succeeds (400 means requests are running) or
        ``flush_timeout_s`` passes."""
        delay = 0.05
        with anyio.move_on_after(self.flush_timeout_s):
            while True:
                try:
                    await self._http.call(server, "POST", "/flush_cache", timeout=30)
                    return True
                except SGLangHTTPError as exc:
                    if exc.status != 400:
                        raise
                self.flush_retries += 1
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
        return False

    async def aclose(self) -> None:
        """Abort requests in flight, close open sessions (best effort), drop connections."""
        if self._closed:
            return
        self._closed = True
        for scope in list(self._scopes):
            scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            for session_id in list(self._sessions):
                try:
                    await self.close_session(session_id)
                except EngineError:
                    pass
        hold, self._hold = self._hold, None
        if hold is not None:
            await hold.aclose()

    async def __aenter__(self) -> SGLangEngine:
        self._hold = AsyncExitStack()
        await self._hold.enter_async_context(self._http.use())
        await self._ready()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()


def _extends(ids: list[int], held: list[int], bos: int | None) -> bool:
    n = len(held)
    return len(ids) > n and ids[:n] == held and ids[n] != bos


async def _each(items: Sequence[T], call: Callable[[T], Awaitable[object]]) -> None:
    """``call`` every item at once; one ``EngineError`` naming every item that failed."""
    failures: list[str] = []

    async def one(item: T) -> None:
        try:
            await call(item)
        except EngineError as exc:
            failures.append(str(exc))

    async with anyio.create_task_group() as tg:
        for item in items:
            tg.start_soon(one, item)
    if failures:
        raise EngineError("; ".join(failures))
