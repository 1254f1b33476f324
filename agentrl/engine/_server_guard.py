"""The request guard of ``agentrl serve``: no body can turn into a 500, no failure into plain text.

An aiohttp middleware in front of every endpoint:

- A body that is not valid UTF-8 (JSON text must be, RFC 8259) is a 400 naming the first bad
  byte's offset, before any handler sees it. JSON parsers differ on where they check this (msgspec
  only inside strings, and there it raises ``UnicodeDecodeError`` rather than its own error), so
  the guard checks the whole body once, whichever endpoint it is for.
- A body nested deeper than the JSON decoder's recursion limit is a 400.
- Any other unexpected exception becomes a JSON 500 in the server's error shape (aiohttp's default
  is a plain-text page a JSON client cannot parse); the server keeps serving. A handler that had
  already started its answer (a stream) is left to aiohttp, which closes the connection: a second
  answer cannot follow the first on the wire.

``install_request_guard(app)`` adds both the middleware and the hook that notices started answers.

Errors have the shape of ``/generate``'s: ``{"error": {"message": ..., "field": ...}, "object":
"error", "code": N}``.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Awaitable, Callable

from aiohttp import web

from . import _wire as w

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, field: str | None = None) -> web.Response:
    """The server's JSON error answer."""
    body = w.WireError(w.WireErrorBody(message, field), code=status)
    return web.Response(body=w.encoder.encode(body), status=status, content_type="application/json")


def _utf8_error(raw: bytes) -> str | None:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte {exc.start} (0x{raw[exc.start]:02x}): {exc.reason}"
    return None


_STARTED: web.RequestKey[bool] = web.RequestKey("agentrl_answer_started", bool)


async def _mark_started(request: web.Request, response: web.StreamResponse) -> None:
    request[_STARTED] = True


def install_request_guard(app: web.Application) -> None:
    """Guard every endpoint of ``app`` (call before the app starts)."""
    app.middlewares.append(request_guard)
    app.on_response_prepare.append(_mark_started)


@web.middleware
async def request_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse malformed bodies with a 400; answer unexpected failures with a JSON 500."""
    path = request.path
    if request.can_read_body:
        raw = await request.read()  # aiohttp caches it: the handler's read() is free
        bad = _utf8_error(raw)
        if bad is not None:
            return error_response(400, f"{path}: the request body is not valid UTF-8 at {bad}")
    try:
        return await handler(request)
    except web.HTTPException:
        raise  # aiohttp's own answers (404, 405, 413): already well-formed
    except RecursionError:
        return error_response(400, f"{path}: the request body nests too deeply")
    except UnicodeError as exc:
        return error_response(400, f"{path}: the request holds text that is not valid: {exc}")
    except Exception as exc:  # a bug of ours: say so in JSON, keep serving
        if request.get(_STARTED):
            raise
        print(f"agentrl serve: {path}: internal error", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return error_response(500, f"internal error: {exc!r}")
