"""Which of ``SGLangEngine``'s servers gets a request: the URLs checked, new sessions placed on
the server with the fewest sessions, and servers that refused a connection left aside for a
while (a router goes on listing a dead worker as healthy until its next health check).
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Sequence

import httpx

from agentrl._config import short_repr
from agentrl._errors import EngineError, exception_chain

from ._sglang_http import Upstream


def server_urls(urls: str | Sequence[str]) -> list[str]:
    """The servers' base URLs, checked: at least one, each ``http(s)://HOST[:PORT][/PATH]``
    (a router's or a server's), none given twice; ``EngineError`` names the value."""
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise EngineError("SGLangEngine needs at least one server URL")
    seen: dict[tuple[str, str, int, str], str] = {}
    out = []
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url.strip() if isinstance(url, str) else "")
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme, 0)
        except ValueError as exc:
            raise EngineError(f"server URL {short_repr(url)}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EngineError(f"server URL {short_repr(url)}: expected http(s)://HOST:PORT")
        if parts.query or parts.fragment:
            raise EngineError(f"server URL {short_repr(url)}: give no query or fragment")
        key = (parts.scheme, parts.hostname, port, parts.path.rstrip("/"))
        if key in seen:
            raise EngineError(
                f"server URL {short_repr(url)} is given twice (as {short_repr(seen[key])}): "
                "each server or router once"
            )
        seen[key] = url
        out.append(url.strip().rstrip("/"))
    return out


REFUSED_S = 30.0
"""How long a server that refused a connection gets no new sessions or plain requests (unless
every server did)."""


def refused(exc: BaseException) -> bool:
    """The request failed to connect: nothing was sent."""
    return isinstance(exc.__cause__, httpx.ConnectError | httpx.ConnectTimeout)


def broken(exc: BaseException) -> bool:
    """The connection broke after the request was sent (reset, closed without a reply)."""
    cause = exc.__cause__
    return isinstance(
        cause, httpx.ReadError | httpx.WriteError | httpx.CloseError | httpx.RemoteProtocolError
    )


def connection_refused(exc: BaseException) -> bool:
    """The server's host refused the connection (ECONNREFUSED: nothing listens on the port),
    not a connect timeout, an unreachable host or a name that does not resolve."""
    return any(isinstance(link, ConnectionRefusedError) for link in exception_chain(exc))


def answering(pool: list[Upstream]) -> list[Upstream]:
    """The servers in ``pool`` that have not refused a connection in the last ``REFUSED_S``."""
    now = time.monotonic()
    return [s for s in pool if s.refused_at is None or now - s.refused_at > REFUSED_S]


def placement(server: Upstream) -> tuple[int, int]:
    """Where a session goes: the server with the fewest sessions, then requests."""
    return server.sessions, server.inflight
