"""Async client of the sandbox service (httpx; runs under trio and asyncio).

``SandboxClient`` satisfies ``SandboxRunner``, like ``SandboxPool``: code written against one
works with the other. Retries are safe by construction:

- a **connection error before the request was sent** (``httpx.ConnectError`` /
  ``ConnectTimeout``) is retried with exponential backoff, at most ``connect_retries`` times,
  then raises ``SandboxUnreachable``;
- **anything after the request may have been sent** — a read timeout, a dropped connection, a
  5xx — is never re-sent (the program may have run): ``SandboxNoAnswer`` / ``SandboxHTTPError``;
- **429** (the pool is over capacity) and **503 ``overloaded``** (the service's memory budget
  or connection cap is full) mean nothing ran: ``SandboxBusy`` (a ``PoolBusy`` with
  ``retry_after_s``), or, with ``retry_busy=True``, a wait of ``Retry-After`` and a retry, at
  most ``max_busy_retries`` times. Any other 503 (a proxy's) is not known to be safe: raised;
- no free connection of this client's own (``max_connections`` requests already in flight to
  the service) within the ``timeout``: nothing was sent, so this is ``SandboxBusy`` too (the
  capacity that ran out is the client's);
- a batch refused for its size (413 ``answer_too_large`` / ``request_too_large``, 400 with too
  many items; nothing ran) is split by the ``limit`` the service names and sent again in parts,
  one after another. Once a part has run, a later part that fails (busy, unreachable, no
  answer, an error) does not raise: its items come back as ``status="sandbox_error"`` saying
  whether they ran, so that no caller re-sends the parts that ran.

Invalid requests behave exactly as with the pool (one validation function): ``run`` raises
``InvalidRequest`` naming the field and value (checked here before sending, and from the
service's 400), and in ``run_batch`` such an item comes back as ``status="invalid_request"``
while the others run.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import anyio
import httpx
import msgspec

from ._errors import PoolBusy, SandboxError
from ._types import BatchRequest, BatchResult, InvalidRequest, RunRequest, RunResult, encode
from ._validate import validate_request

_result_decoder = msgspec.json.Decoder(RunResult)
_batch_decoder = msgspec.json.Decoder(BatchResult)


class SandboxBusy(PoolBusy):
    """The service answered 429: over capacity, nothing ran; retrying later is safe."""


class SandboxUnreachable(SandboxError):
    """No connection to the service could be made (after the bounded retries); nothing ran."""


class SandboxNoAnswer(SandboxError):
    """The request was sent but no answer came (timeout, dropped connection). The program may
    have run, so the client does not re-send it."""


class SandboxHTTPError(SandboxError):
    """The service answered with an error (4xx other than 429, or 5xx)."""

    def __init__(
        self, status_code: int, error_type: str, message: str, field: str | None = None
    ) -> None:
        super().__init__(f"HTTP {status_code} {error_type}: {message}")
        self.status_code = status_code
        self.error_type = error_type
        self.field = field


class _Error(msgspec.Struct):
    type: str
    message: str
    field: str | None = None
    limit: int | None = None


class _ErrorResponse(msgspec.Struct):
    error: _Error


_error_decoder = msgspec.json.Decoder(_ErrorResponse)


def _error_of(response: httpx.Response) -> _Error:
    """The service's structured error, or a stand-in for any other body (a proxy's page)."""
    try:
        return _error_decoder.decode(response.content).error
    except (msgspec.DecodeError, ValueError):
        return _Error("http_error", response.text[:500] or response.reason_phrase)


def _nothing_ran(response: httpx.Response) -> bool:
    """429 from the pool, or 503 ``overloaded`` from the service: refused before running."""
    if response.status_code == 429:
        return True
    return response.status_code == 503 and _error_of(response).type == "overloaded"


class SandboxClient:
    """Talks to ``agentrl sandbox serve``. Use as ``async with SandboxClient(url) as c:``.

    ``timeout`` is the time allowed over the programs' own limits (queueing, transfer): a run
    may take ``timeout + request.timeout_s``, a batch ``timeout + sum of timeout_s``."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        connect_retries: int = 3,
        backoff_s: float = 0.1,
        retry_busy: bool = False,
        max_busy_retries: int = 5,
        max_busy_wait_s: float = 30.0,
        max_connections: int = 100,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if connect_retries < 0 or max_busy_retries < 0:
            raise ValueError("retry counts must be >= 0")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        parts = urllib.parse.urlsplit(base_url) if isinstance(base_url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            # refused here: httpx would fail the first request without sending it, and that
            # failure reads as one that may have run
            raise ValueError(
                f"sandbox service URL {base_url!r}: expected http(s)://HOST:PORT (e.g. "
                "http://127.0.0.1:8090)"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.connect_retries = connect_retries
        self.backoff_s = backoff_s
        self.retry_busy = retry_busy
        self.max_busy_retries = max_busy_retries
        self.max_busy_wait_s = max_busy_wait_s
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.max_connections = max_connections
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            trust_env=False,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=20),
        )
        self.connect_attempts = 0
        """Connection attempts that failed before a request was sent (for tests and logs)."""

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _timeout(self, program_s: float, limit_s: float | None = None) -> httpx.Timeout:
        if limit_s is not None:  # one bound for every phase (a health probe)
            return httpx.Timeout(limit_s, connect=min(limit_s, self.connect_timeout))
        return httpx.Timeout(
            connect=self.connect_timeout,
            read=self.timeout + program_s,
            write=self.timeout,
            pool=self.timeout,
        )

    async def _send(
        self,
        method: str,
        path: str,
        body: bytes | None,
        program_s: float,
        limit_s: float | None = None,
    ) -> Any:
        connect_failures = 0
        busy_retries = 0
        while True:
            try:
                response = await self._http.request(
                    method, path, content=body, timeout=self._timeout(program_s, limit_s)
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # nothing was sent: safe to retry, with backoff and a bound
                self.connect_attempts += 1
                connect_failures += 1
                if connect_failures > self.connect_retries:
                    raise SandboxUnreachable(
                        f"cannot connect to {self.base_url} after {connect_failures} attempts: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                await anyio.sleep(self.backoff_s * 2 ** (connect_failures - 1))
                continue
            except httpx.PoolTimeout as exc:
                # every connection of this client stayed in use: the request never left here
                if self.retry_busy and busy_retries < self.max_busy_retries:
                    busy_retries += 1
                    continue
                raise SandboxBusy(
                    f"{method} {path}: none of this client's {self.max_connections} connections "
                    f"to {self.base_url} came free in time; nothing was sent",
                    1.0,
                ) from exc
            except httpx.TimeoutException as exc:
                raise SandboxNoAnswer(
                    f"{method} {path}: no answer in time ({type(exc).__name__}); the request "
                    "may have run and is not re-sent"
                ) from exc
            except httpx.TransportError as exc:
                raise SandboxNoAnswer(
                    f"{method} {path}: connection failed after sending "
                    f"({type(exc).__name__}: {exc}); the request may have run and is not re-sent"
                ) from exc
            if _nothing_ran(response):
                retry_after = _retry_after(response)
                if self.retry_busy and busy_retries < self.max_busy_retries:
                    busy_retries += 1
                    await anyio.sleep(min(retry_after, self.max_busy_wait_s))
                    continue
                raise SandboxBusy(_error_of(response).message, retry_after)
            return response

    async def run(self, request: RunRequest) -> RunResult:
        """Run one program on the service. Raises ``InvalidRequest`` for a request that breaks
        a rule (nothing ran), ``SandboxBusy`` when over capacity (nothing ran)."""
        validate_request(request)
        response = await self._send("POST", "/v1/run", encode(request), request.timeout_s)
        if response.status_code == 400:
            error = _error_of(response)
            if error.type == "invalid_request":
                raise InvalidRequest(error.field or "request", error.message)
        _raise_for_status(response)
        return _decode(response, _result_decoder)

    async def run_batch(self, requests: Sequence[RunRequest]) -> list[RunResult]:
        """Run several programs; results in order. An item that breaks a rule comes back as
        ``status="invalid_request"`` without running; a batch too large for the service is
        sent in parts (one after another)."""
        results: list[RunResult | None] = [None] * len(requests)
        valid: list[int] = []
        for i, request in enumerate(requests):
            try:
                validate_request(request)
            except InvalidRequest as exc:
                results[i] = RunResult(status="invalid_request", error=f"requests[{i}].{exc}")
            else:
                valid.append(i)
        if valid:
            ran = await self._batch([requests[i] for i in valid])
            for i, result in zip(valid, ran, strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    async def _batch(self, requests: list[RunRequest]) -> list[RunResult]:
        body = encode(BatchRequest(requests=requests))
        total = sum(r.timeout_s for r in requests)
        response = await self._send("POST", "/v1/run_batch", body, total)
        if response.status_code in (400, 413):
            parts = _split(requests, _error_of(response), response.status_code)
            if parts is not None:
                return await self._parts(parts)
        _raise_for_status(response)
        results = _decode(response, _batch_decoder).results
        if len(results) != len(requests):
            raise SandboxHTTPError(
                response.status_code,
                "protocol_error",
                f"{len(results)} results for {len(requests)} requests",
            )
        return results

    async def _parts(self, parts: list[list[RunRequest]]) -> list[RunResult]:
        """A split batch, part by part. A failure of the first part is the batch's (nothing
        ran); after that, a part's failure becomes its items' results: raising would tell the
        caller that nothing ran, and a retry would run the earlier parts twice."""
        results = await self._batch(parts[0])
        for part in parts[1:]:
            try:
                results += await self._batch(part)
            except (PoolBusy, SandboxUnreachable) as exc:
                error = f"not run: a later part of a split batch was refused ({exc})"
                results += [RunResult(status="sandbox_error", error=error) for _ in part]
            except SandboxError as exc:
                error = (
                    "a later part of a split batch failed; it may have run and is not re-sent "
                    f"({exc})"
                )
                results += [RunResult(status="sandbox_error", error=error) for _ in part]
        return results

    async def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Backend, pool statistics, limits and guarantees; ``timeout_s`` bounds each phase
        (default: the client's timeouts)."""
        response = await self._send("GET", "/health", None, 0.0, timeout_s)
        _raise_for_status(response)
        try:
            health = json.loads(response.content)
        except ValueError:
            health = None
        if not isinstance(health, dict):
            raise SandboxHTTPError(
                response.status_code,
                "protocol_error",
                f"{self.base_url}/health answered {response.content[:100]!r}, not a sandbox "
                "service's health",
            )
        return health

    async def metrics(self) -> str:
        """The Prometheus text exposition."""
        response = await self._send("GET", "/metrics", None, 0.0)
        _raise_for_status(response)
        return response.text


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.0, float(response.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


def _split(
    requests: list[RunRequest], error: _Error, status_code: int
) -> list[list[RunRequest]] | None:
    """Parts of a batch the service refused for its size (nothing ran), each within the limit
    it named and each smaller than the batch (so splitting ends); ``None`` when the refusal is
    of another kind or one item alone is too large. A limit of items that cannot split the
    batch (below 1, or not below its length) is a ``SandboxHTTPError``: re-sending would be
    refused the same way."""
    if error.limit is None or len(requests) < 2:
        return None
    if error.type == "invalid_request" and error.field == "requests":  # too many items
        n = error.limit
        if not 1 <= n < len(requests):
            raise SandboxHTTPError(
                status_code,
                error.type,
                f"the service refused a batch of {len(requests)} items for its size but named "
                f"a limit of {n} items per batch, which does not split it: not re-sent "
                f"({error.message[:200]})",
                error.field,
            )
        return [requests[i : i + n] for i in range(0, len(requests), n)]
    if error.type == "answer_too_large":
        sizes = [2 * r.output_limit_bytes for r in requests]
    elif error.type == "request_too_large":
        sizes = [len(encode(r)) + 1 for r in requests]
        error.limit -= len(b'{"requests":[]}')
    else:
        return None
    if max(sizes) > error.limit:
        return None
    parts: list[list[RunRequest]] = [[]]
    used = 0
    for request, size in zip(requests, sizes, strict=True):
        if parts[-1] and used + size > error.limit:
            parts.append([])
            used = 0
        parts[-1].append(request)
        used += size
    return parts if len(parts) > 1 else None


def _decode(response: httpx.Response, decoder: msgspec.json.Decoder[Any]) -> Any:
    """The answer's value; an answer that is not one (a proxy's page, a service of another
    version) is a ``SandboxHTTPError``: the request may have run, so it is not re-sent."""
    try:
        return decoder.decode(response.content)
    except msgspec.DecodeError as exc:
        raise SandboxHTTPError(
            response.status_code,
            "protocol_error",
            f"{response.request.url}: the answer is not what the service sends ({exc}; it "
            f"begins {response.content[:80]!r}); the request may have run and is not re-sent",
        ) from exc


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code >= 400:
        error = _error_of(response)
        raise SandboxHTTPError(response.status_code, error.type, error.message, error.field)
