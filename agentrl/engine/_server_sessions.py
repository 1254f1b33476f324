"""SGLang session semantics for ``agentrl serve`` (mirrors SGLang 0.5.17's ``session_controller``).

Inside a session, a request's ``input_ids`` is the *new suffix*: the server prepends the parent
request's input + output and sends the whole context to the engine, with the engine session that
belongs to this server session, so the embedded engine reuses the KV it pinned.

- **Classic** sessions keep a tree of requests keyed by ``rid``. ``session_params.rid`` names the
  parent (``None``: a new root); the parent must have finished. ``replace`` aborts the parent if
  it still runs and drops its other children (``rid=None`` with ``replace``: drops every node).
  ``drop_previous_output`` prepends the parent's input only; a nonzero ``offset`` keeps
  ``context[:offset]`` (Python slicing, so ``-1`` drops the last token) before the suffix.
- **Streaming** sessions (``"streaming": true``) are append-only: one request at a time, the
  parent is always the last finished request, and replace/offset/drop_previous_output are refused.
- As in SGLang, a leading BOS token of an appended suffix is dropped, and the parent contributes
  ``output_ids[:max_new_tokens]``. A request aborted by a ``replace`` stays in the tree without
  output; a failed one is removed (it can never become a parent).
- ``timeout`` (seconds) closes a session that saw no request for that long. Closing a session
  aborts the requests it still runs (classic and streaming alike: each answers ``abort`` with its
  tokens so far) and releases its engine session when they have ended.
- At most ``max_sessions`` sessions are open at once (``--max-sessions``); opening one more is
  refused with the cap named, since a session without a timeout lives until it is closed.

Every refusal raises ``SessionError`` (HTTP 400, SGLang aborts these requests the same way).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from agentrl._errors import EngineError

from ._protocol import Engine
from ._wire import WireSessionParams


class SessionError(EngineError):
    """A session request SGLang would abort (bad session id, unknown parent, ...); ``field``
    names the request field at fault (``session_params`` unless another is given)."""

    def __init__(self, message: str, field: str = "session_params") -> None:
        super().__init__(message)
        self.field = field


@dataclass(eq=False)
class _Node:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] | None = None
    """``None`` while the request runs."""
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)
    cancel: Callable[[], None] | None = None
    aborted: bool = False


@dataclass(eq=False)
class ServerSession:
    id: str
    capacity_of_str_len: int
    streaming: bool
    timeout: float | None
    engine_session: str
    last_active: float = field(default_factory=time.monotonic)
    nodes: dict[str, _Node] = field(default_factory=dict)
    inflight: int = 0
    engine_session_busy: bool = False
    closed: bool = False
    running: _Node | None = None
    """A streaming session's running turn (it joins ``nodes`` when it finishes)."""


@dataclass(eq=False)
class Turn:
    """One request inside a session: the whole context and the engine session to run it with."""

    session: ServerSession
    node: _Node
    context: list[int]
    engine_session: str | None


class SessionTable:
    """The open sessions of one server. Single event loop: no locks, no awaits inside edits."""

    def __init__(
        self, engine: Engine, bos_token_id: int | None, max_sessions: int | None = None
    ) -> None:
        self._engine = engine
        self._bos = bos_token_id
        self._max_sessions = max_sessions
        self._sessions: dict[str, ServerSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    async def open(
        self,
        session_id: str | None,
        capacity_of_str_len: int | None,
        streaming: bool,
        timeout: float | None,
    ) -> str:
        await self.reap()
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._sessions:
            raise SessionError(
                f"session_id {session_id!r} is already open: failed to open the session",
                "session_id",
            )
        if timeout is not None and not timeout > 0:
            raise SessionError(f"timeout must be > 0 seconds, got {timeout}", "timeout")
        self._check_room()
        engine_session = await self._engine.open_session()
        if session_id in self._sessions:  # opened concurrently while we awaited
            await self._engine.close_session(engine_session)
            raise SessionError(f"session_id {session_id!r} is already open", "session_id")
        try:
            self._check_room()  # others may have filled the table while we awaited
        except SessionError:
            await self._engine.close_session(engine_session)
            raise
        self._sessions[session_id] = ServerSession(
            session_id, capacity_of_str_len or 0, streaming, timeout, engine_session
        )
        return session_id

    def _check_room(self) -> None:
        cap = self._max_sessions
        if cap is not None and len(self._sessions) >= cap:
            raise SessionError(
                f"the session table is full: {len(self._sessions)} sessions are open, "
                f"max_sessions={cap} (--max-sessions); close sessions or open them with a timeout",
                "session_id",
            )

    async def close(self, session_id: str) -> bool:
        """Close a session; False when it is not open (SGLang answers 200 either way)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.closed = True
        for node in [*session.nodes.values(), *filter(None, [session.running])]:
            _abort(node)
        if session.inflight == 0:
            await self._release(session)
        return True

    async def close_all(self) -> None:
        for session_id in list(self._sessions):
            await self.close(session_id)

    async def reap(self) -> None:
        now = time.monotonic()
        expired = [
            s.id
            for s in self._sessions.values()
            if s.timeout is not None and s.inflight == 0 and now - s.last_active > s.timeout
        ]
        for session_id in expired:
            await self.close(session_id)

    def begin(
        self, params: WireSessionParams, suffix: list[int], rid: str, max_new_tokens: int
    ) -> Turn:
        """Build the context of a new request in ``params.id`` and register it as running."""
        session = self._sessions.get(params.id or "")
        if session is None:
            raise SessionError(
                f"session_params.id {params.id!r}: invalid session id (not open)",
                "session_params.id",
            )
        parent = self._parent(session, params)
        if rid in session.nodes:
            raise SessionError(f"rid {rid!r} is already used in session {session.id!r}", "rid")
        context = list(suffix)
        if parent is not None:
            if self._bos is not None and context and context[0] == self._bos:
                context = context[1:]  # SGLang trims a BOS from an appended turn
            base = list(parent.input_ids)
            if not params.drop_previous_output:
                base += (parent.output_ids or [])[: parent.max_new_tokens]
            context = base[: params.offset] + context if params.offset else base + context
        if not context:
            raise SessionError("input_ids: the request's context is empty", "input_ids")
        # a streaming session keeps its last turn only: no link back to the turns before it
        # (each holds its whole context: the chain would grow with the square of the turns)
        node = _Node(rid, context, max_new_tokens, parent=None if session.streaming else parent)
        if not session.streaming:
            if parent is not None:
                parent.children.append(node)
            session.nodes[rid] = node
        else:
            session.running = node
        session.inflight += 1
        session.last_active = time.monotonic()
        engine_session = None
        if not session.engine_session_busy:
            session.engine_session_busy = True
            engine_session = session.engine_session
        return Turn(session, node, context, engine_session)

    def _parent(self, session: ServerSession, params: WireSessionParams) -> _Node | None:
        if session.streaming:
            if session.inflight:
                raise SessionError("Streaming session already has an active request.")
            if params.replace:
                raise SessionError("Streaming sessions do not support replace.")
            if params.drop_previous_output:
                raise SessionError("Streaming sessions do not support drop_previous_output.")
            if params.offset:
                raise SessionError("Streaming sessions do not support offset.")
            return next(iter(session.nodes.values()), None)
        if params.rid is None:
            if params.replace:
                for node in list(session.nodes.values()):
                    _drop(session, node)
            return None
        parent = session.nodes.get(params.rid)
        if parent is None:
            raise SessionError(
                f"session_params.rid {params.rid!r}: invalid request session id",
                "session_params.rid",
            )
        if params.replace:
            _abort(parent)
            for child in list(parent.children):
                _drop(session, child)
        elif parent.output_ids is None:
            raise SessionError(
                f"session_params.rid {params.rid!r}: appending to a request that hasn't finished"
            )
        return parent

    async def finish(self, turn: Turn, output_ids: list[int] | None) -> None:
        """Record the outcome (``None``: failed or aborted) and free the turn's resources."""
        session, node = turn.session, turn.node
        session.inflight -= 1
        session.last_active = time.monotonic()
        if turn.engine_session is not None:
            session.engine_session_busy = False
        node.cancel = None
        if session.running is node:
            session.running = None
        if output_ids is not None and not node.aborted:
            node.output_ids = list(output_ids)
            if session.streaming:
                session.nodes = {node.rid: node}
        elif node.aborted:
            node.output_ids = []  # aborted by a replace: finished, without output (kept)
        elif not session.streaming and session.nodes.get(node.rid) is node:
            _drop(session, node)  # failed: it can never be a parent
        if session.closed and session.inflight == 0:
            await self._release(session)

    async def _release(self, session: ServerSession) -> None:
        session.nodes.clear()
        try:
            await self._engine.close_session(session.engine_session)
        except EngineError:
            pass  # the engine already dropped it (closed, or its own TTL)


def _abort(node: _Node) -> None:
    if node.output_ids is None and node.cancel is not None:
        node.aborted = True
        node.cancel()


def _drop(session: ServerSession, node: _Node) -> None:
    """Remove ``node`` and its subtree from ``session`` (aborting what still runs)."""
    for child in list(node.children):
        _drop(session, child)
    _abort(node)
    if node.parent is not None and node in node.parent.children:
        node.parent.children.remove(node)
    if session.nodes.get(node.rid) is node:
        del session.nodes[node.rid]
