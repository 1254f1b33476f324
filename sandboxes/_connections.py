"""``ConnectionGuard``: the sandbox service's connections, bounded in number and in pace.

Each accepted connection is wrapped in a ``_GuardedConnection`` (an ``asyncio.Protocol`` in
front of aiohttp's own) that knows which phase it is in:

- ``idle``: open, no byte of a request yet (after accept, or between keep-alive requests):
  closed after ``idle_timeout_s``;
- ``head``: a request head is arriving: it must be whole (``CRLF CRLF``) within
  ``header_timeout_s`` of its first byte and at most ``max_head_bytes`` long, else the
  connection is closed (this is what ends a slowloris client trickling headers);
- ``body``: the application is reading the request's body (``receiving``/``received``); the
  body has its own deadline there;
- ``busy``: the application is handling a request (``begin``/``end``, called by the service's
  middleware); the answer has its own deadline there;
- ``closing``: the answer said ``Connection: close``; what the client still sends is drained
  and dropped (aiohttp's lingering close) until the connection ends.

At most ``max_connections`` are open. A new connection over the cap evicts the connection that
has been waiting longest for a request head (``idle`` or ``head``), or when there is none, the
one that has been receiving its body longest: slow, idle and trickling clients make room, and a
client that sends its request at once (``/health``) is always served. An evicted connection
whose request was on its way is answered ``503 overloaded`` (nothing ran: the client may send
it again); one with no request is closed. When every connection is
busy, the new one is answered ``503 overloaded`` and closed after a short linger (its request
is read and dropped so the client sees the answer rather than a reset).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ._types import ErrorBody, ErrorResponse

LINGER_S = 2.0
MAX_LINGERING = 64  # connections being turned away at once; past it they are reset


def overloaded_answer(message: str) -> bytes:
    body = msgspec.json.encode(ErrorResponse(ErrorBody(type="overloaded", message=message)))
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardStatistics(msgspec.Struct):
    """Counters of the connection guard (exported as metrics)."""

    open: int
    """Connections open now (served ones; not those being turned away)."""
    accepted: int
    evicted: int
    """Connections closed at the cap to make room (waiting for a request head, or receiving a
    body)."""
    refused: int
    """Connections answered 503 at the cap (every open one was busy)."""
    idle_timeouts: int
    header_timeouts: int
    head_too_large: int


class _GuardedConnection(asyncio.Protocol):
    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self.guard = guard
        self.make_inner = make_inner
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        self.state = "idle"
        self.since = 0.0  # when it began waiting for a request head
        self.head_bytes = 0
        self.tail = b""  # last bytes of the head so far (a CRLF CRLF may straddle two reads)
        self.timer: asyncio.TimerHandle | None = None
        self.refused = False

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.guard._admit(self):
            self.refused = True
            self.guard._refuse(self)
            return
        self.inner = self.make_inner()
        self.inner.connection_made(transport)
        self._wait_for_head()

    def data_received(self, data: bytes) -> None:
        if self.refused or self.inner is None:
            return  # dropped: the 503 is on its way
        if self.state == "idle":
            self.state = "head"
            self._arm(self.guard.header_timeout_s, "header")
            self.head_bytes = 0
            self.tail = b""
        if self.state == "head":
            seen = self.tail + data
            end = seen.find(b"\r\n\r\n")
            if end >= 0:
                self.head_bytes += end + 4 - len(self.tail)
                self.state = "head_done"  # the application takes it from here (begin)
            else:
                self.head_bytes += len(data)
                self.tail = seen[-3:]
            if self.head_bytes > self.guard.max_head_bytes:
                self.guard.head_too_large += 1
                self.close()
                return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.refused or self.inner is None:
            return True  # keep the write side open for the 503
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard._forget(self)
        self._detach(exc)

    def _detach(self, exc: Exception | None) -> None:
        """aiohttp's side of the connection ends (once): its handler's body read fails, and
        it writes nothing more on this transport."""
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # -- phases ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """The application took a request: no head deadline while it works."""
        self.state = "busy"
        self._disarm()

    def receiving(self) -> None:
        """The application reads the body: evictable at the cap (after the waiting ones)."""
        if self.state == "busy":
            self.state = "body"
            self.since = time.monotonic()

    def received(self) -> None:
        if self.state == "body":
            self.state = "busy"

    def end(self, *, closing: bool = False) -> None:
        """The answer is sent: wait for the next request (keep-alive), or, when the answer
        closes the connection, let aiohttp drain what the client still sends (bounded by its
        lingering time) so the client reads the answer rather than a reset."""
        if self.state == "closed":
            return
        if self.guard.stopping:  # the service stops: no next request on this connection
            self.state = "closing"
            self._disarm()
            if self.transport is not None:
                self.transport.close()  # after what is written: the answer goes out first
            return
        if closing:
            self.state = "closing"
            self._arm(self.guard.idle_timeout_s + LINGER_S, "closing")
            return
        self._wait_for_head()

    def _wait_for_head(self) -> None:
        self.state = "idle"
        self.since = time.monotonic()
        self._arm(self.guard.idle_timeout_s, "idle")

    @property
    def waiting(self) -> bool:
        """Waiting for a request head, or for its end (may be evicted at the cap)."""
        return self.state in ("idle", "head", "closing")

    def _arm(self, delay: float, why: str) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(delay, self._expire, why)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self, why: str) -> None:
        self.timer = None
        if self.state in ("idle", "head", "head_done", "closing"):
            if why == "header":
                self.guard.header_timeouts += 1
            elif why == "idle":
                self.guard.idle_timeouts += 1
            self.close()

    def close(self) -> None:
        self.state = "closed"
        self._disarm()
        if self.transport is not None:
            self.transport.close()

    def evict(self, message: str) -> None:
        """Make room at the cap. A connection with a request on its way (its head or body
        arriving) is answered ``503 overloaded`` first: nothing of it ran, so the client may
        send it again (a bare close reads as "may have run"). One with none is closed."""
        if self.state not in ("head", "body") or self.transport is None:
            self.close()
            return
        self._disarm()
        self.state = "closed"
        self.refused = True  # what the client still sends is dropped
        self.guard._linger(self.transport, message)
        if self.inner is not None:  # aiohttp would close the transport at once: no linger
            self.inner.transport = None
        self._detach(ConnectionResetError("evicted at the connection cap"))


class ConnectionGuard:
    """Counts, times and caps the connections of one listening service (see the module doc)."""

    def __init__(
        self,
        *,
        max_connections: int,
        idle_timeout_s: float,
        header_timeout_s: float,
        max_head_bytes: int,
    ) -> None:
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.header_timeout_s = header_timeout_s
        self.max_head_bytes = max_head_bytes
        self._open: dict[_GuardedConnection, None] = {}
        self._by_transport: dict[Any, _GuardedConnection] = {}
        self._lingering: set[asyncio.Transport] = set()
        self.stopping = False
        """Set at a stop (``close_all``): no connection is kept for another request."""
        self.accepted = 0
        self.evicted = 0
        self.refused = 0
        self.idle_timeouts = 0
        self.header_timeouts = 0
        self.head_too_large = 0

    def protocol_factory(self, make_inner: Callable[[], asyncio.Protocol]) -> Any:
        """A factory for ``loop.create_server`` wrapping ``make_inner`` (aiohttp's server)."""
        return lambda: _GuardedConnection(self, make_inner)

    def connection_of(self, transport: Any) -> _GuardedConnection | None:
        return self._by_transport.get(transport)

    def statistics(self) -> GuardStatistics:
        return GuardStatistics(
            open=len(self._open),
            accepted=self.accepted,
            evicted=self.evicted,
            refused=self.refused,
            idle_timeouts=self.idle_timeouts,
            header_timeouts=self.header_timeouts,
            head_too_large=self.head_too_large,
        )

    def close_all(self) -> None:
        """At a stop: close every connection still waiting for a request, and the ones being
        refused; answer the ones whose body is still arriving ``503 overloaded`` (nothing of
        theirs ran: they linger so that their clients read it). From now on a connection whose
        request ends is closed, never kept for another request."""
        self.stopping = True
        refused = list(self._lingering)
        for conn in list(self._open):
            if conn.waiting:
                conn.close()
            elif conn.state == "body":
                conn.evict("the service is stopping; this request's body had not arrived, so "
                           "nothing ran: send it again elsewhere")  # fmt: skip
        for transport in refused:
            transport.abort()

    # -- for _GuardedConnection --------------------------------------------------------------------
    def _admit(self, conn: _GuardedConnection) -> bool:
        if len(self._open) >= self.max_connections:
            waiting = [c for c in self._open if c.waiting]
            if not waiting:  # then the slowest uploads: nothing of theirs has run yet
                waiting = [c for c in self._open if c.state == "body"]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c.since)
            self.evicted += 1
            self._forget(oldest)  # its connection_lost comes later; the slot is free now
            oldest.evict(
                f"closed to make room at max_connections={self.max_connections} before its "
                "request was read; nothing ran, retry later"
            )
        self._open[conn] = None
        self._by_transport[conn.transport] = conn
        self.accepted += 1
        return True

    def _forget(self, conn: _GuardedConnection) -> None:
        self._open.pop(conn, None)
        if self._by_transport.get(conn.transport) is conn:
            del self._by_transport[conn.transport]

    def _refuse(self, conn: _GuardedConnection) -> None:
        self.refused += 1
        assert conn.transport is not None
        self._linger(
            conn.transport,
            f"{len(self._open)} connections open, all busy (max_connections="
            f"{self.max_connections}); nothing ran, retry later",
        )

    def _linger(self, transport: asyncio.Transport, message: str) -> None:
        """Answer ``503 overloaded`` with ``message`` and close after a short linger (what the
        client still sends is dropped, so it reads the answer rather than a reset)."""
        if len(self._lingering) >= MAX_LINGERING:
            transport.abort()
            return
        transport.write(overloaded_answer(message))
        if transport.can_write_eof():
            transport.write_eof()
        self._lingering.add(transport)

        def done() -> None:
            self._lingering.discard(transport)
            transport.close()

        asyncio.get_running_loop().call_later(LINGER_S, done)
