"""The request guard of ``agentrl serve``: no body can turn into a 500, no failure into plain text.

An aiohttp middleware in front of every endpoint:

- A body that is not valid UTF-8 (JSON text must be, RFC 8259) is a 400 naming the first bad
  byte's offset. JSON parsers differ on how they report it (msgspec releases before 0.23 call
  it malformed JSON outside strings but raise ``UnicodeDecodeError`` inside them, which would
  otherwise be a 500; later ones call it a decode error everywhere), so the guard turns a
  ``UnicodeDecodeError`` from any handler that decodes its body into the 400, and the
  endpoints check the bytes of a body msgspec refused (``utf8_error``) before naming a field.
  An endpoint that ignores its body (``/flush_cache``) ignores a bad one too, as SGLang's do.
- A body nested deeper than the JSON decoder's recursion limit is a 400.
- A body is read whole before the endpoint runs, within ``body_timeout_s`` of its headers; past
  it a 408 that closes the connection (aiohttp never fails the payload of a chunked body whose
  framing breaks after the headers arrived: the endpoint would wait for it forever).
- aiohttp's own refusals (an unknown path, a method the endpoint does not take, a body over
  the size limit) are answered in the same JSON shape with their status (SGLang's FastAPI
  answers them in JSON too), not as aiohttp's plain-text pages.
- Any other unexpected exception becomes a JSON 500 in the server's error shape (aiohttp's default
  is a plain-text page a JSON client cannot parse); the server keeps serving. A handler that had
  already started its answer (a stream) is left to aiohttp, which closes the connection: a second
  answer cannot follow the first on the wire.

``install_request_guard(app)`` adds both the middleware and the hook that notices started answers.

Errors have the shape of ``/generate``'s: ``{"error": {"message": ..., "field": ...}, "object":
"error", "code": N}``.
"""

from __future__ import annotations

import asyncio
import sys
import traceback
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, http_exceptions, web

from . import _wire as w
from ._server_limits import DEFAULT_BODY_TIMEOUT_S

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, field: str | None = None) -> web.Response:
    """The server's JSON error answer."""
    body = w.WireError(w.WireErrorBody(message, field), code=status)
    return web.Response(body=w.encoder.encode(body), status=status, content_type="application/json")


def utf8_error(raw: bytes) -> str | None:
    """Where ``raw`` stops being UTF-8 (the byte, its value, why), or None."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte {exc.start} (0x{raw[exc.start]:02x}): {exc.reason}"
    return None


_STARTED: web.RequestKey[bool] = web.RequestKey("agentrl_answer_started", bool)


async def _mark_started(request: web.Request, response: web.StreamResponse) -> None:
    request[_STARTED] = True


_BODY_TIMEOUT_S: web.AppKey[float] = web.AppKey("agentrl_body_timeout_s", float)


def install_request_guard(
    app: web.Application, *, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
) -> None:
    """Guard every endpoint of ``app`` (call before the app starts); a body must arrive
    within ``body_timeout_s`` of its headers."""
    app[_BODY_TIMEOUT_S] = body_timeout_s
    app.middlewares.append(request_guard)
    app.on_response_prepare.append(_mark_started)


@web.middleware
async def request_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse malformed bodies with a 400; answer unexpected failures with a JSON 500."""
    path = request.path
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding not in ("", "identity"):  # its size on the wire says nothing of what it holds
        message = f"Content-Encoding {encoding!r} is not accepted: send the body uncompressed"
        return error_response(415, f"{path}: {message}")
    try:
        if request.body_exists:  # read whole under a deadline; handlers get it from memory
            timeout_s = request.app[_BODY_TIMEOUT_S]
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                answer = error_response(
                    408,
                    f"{path}: the request body did not arrive within {timeout_s:g} s of its "
                    "headers (--body-timeout-s), or its chunked framing is broken",
                )
                answer.force_close()  # the rest of the body is never read
                return answer
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or request.get(_STARTED):
            raise
        # aiohttp's own refusals (404, 405, 413...) in the JSON shape clients parse; headers
        # such as 405's Allow are kept
        message = f"{path}: {exc.text or exc.reason}".removesuffix("\n")
        answer = error_response(exc.status, message)
        for name, value in exc.headers.items():
            if name.lower() not in ("content-type", "content-length"):
                answer.headers[name] = value
        return answer
    except RecursionError:
        if request.get(_STARTED):
            raise
        return error_response(400, f"{path}: the request body nests too deeply")
    except UnicodeDecodeError as exc:
        bad = utf8_error(await request.read()) if request.body_exists else None
        if bad is None:  # not the body's fault
            return _internal_error(request, exc)
        if request.get(_STARTED):
            raise
        return error_response(400, f"{path}: the request body is not valid UTF-8 at {bad}")
    except (ConnectionError, web.RequestPayloadError, http_exceptions.HttpProcessingError) as exc:
        if request.get(_STARTED):
            raise
        # the client went away mid-body, or sent a body its framing does not describe
        return error_response(400, f"{path}: the request body could not be read: {exc}")
    except Exception as exc:
        return _internal_error(request, exc)


def _internal_error(request: web.Request, exc: Exception) -> web.Response:
    """A bug of ours: say so in JSON, keep serving (re-raised once an answer has started)."""
    if request.get(_STARTED):
        raise exc
    print(f"agentrl serve: {request.path}: internal error", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    return error_response(500, f"internal error: {exc!r}")
