"""HTTP plumbing of ``SGLangEngine``: connection pool, retries, error mapping, wire conversion.

``Transport.call`` is one HTTP exchange. Connection failures (nothing was sent) are retried with
backoff; timeouts, broken connections and HTTP error statuses raise ``EngineError`` naming the
URL (and ``SGLangHTTPError`` carries the status and body). One pooled ``httpx.AsyncClient`` lives
while anyone uses the transport (``use()``) and is closed when the last user leaves, so no socket
outlives the event loop that opened it (an engine handed to ``agentrl.rollout`` runs on an event
loop that ends with the rollout).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import msgspec

from agentrl._errors import EngineError
from agentrl._types import GenerateResult, SamplingParams

from . import _wire as w


class SGLangHTTPError(EngineError):
    """A server answered with an HTTP error status."""

    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        super().__init__(f"{method} {url} -> HTTP {status}: {body[:1000]}")
        self.url, self.status, self.body = url, status, body


@dataclass(eq=False)
class Upstream:
    """One server and what the engine knows about it."""

    url: str
    inflight: int = 0
    sessions: int = 0
    streaming: bool | None = None
    """Whether it accepts streaming sessions (None: not asked yet)."""
    max_context: int | None = None
    weight_version: int = 0
    model_path: str | None = None
    in_flight: str = "finish"
    """What it does to requests in flight on a weight update (``/get_model_info``'s
    ``agentrl.in_flight``; SGLang reports none and finishes them on the old weights)."""
    refused_at: float | None = None
    """When it last refused a connection (``time.monotonic()``; None once it answers again):
    new sessions and plain requests go elsewhere for a while, since a router may go on
    listing a dead worker as healthy until its next health check."""


class Transport:
    """HTTP to SGLang-compatible servers (see the module docs)."""

    def __init__(
        self, request_timeout_s: float, connect_timeout_s: float, retries: int, https: bool
    ) -> None:
        self._timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self._verify: Any = httpx.create_ssl_context() if https else False
        self._retries = retries
        self._client: httpx.AsyncClient | None = None
        self._users = 0
        self.connect_retries = 0

    @asynccontextmanager
    async def use(self) -> AsyncIterator[httpx.AsyncClient]:
        if self._client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(
                timeout=self._timeout, verify=self._verify, limits=limits, trust_env=False
            )
        client = self._client
        self._users += 1
        try:
            yield client
        finally:
            self._users -= 1
            if self._users == 0 and self._client is client:
                self._client = None
                with anyio.CancelScope(shield=True):
                    await client.aclose()

    async def call(
        self,
        server: Upstream,
        method: str,
        path: str,
        payload: Any = None,
        timeout: float = 0,
        retries: int | None = None,
    ) -> bytes:
        """One HTTP exchange; retries only failures to connect (nothing was sent), up to
        ``retries`` times (default: the transport's)."""
        url = server.url + path
        content = None if payload is None else w.encoder.encode(payload)
        headers = {"content-type": "application/json"}
        retries = self._retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                async with self.use() as client:
                    response = await client.request(
                        method,
                        url,
                        content=content,
                        headers=headers,
                        timeout=timeout or httpx.USE_CLIENT_DEFAULT,
                    )
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt == retries:
                    raise EngineError(f"cannot connect to {url}: {exc!r}") from exc
                self.connect_retries += 1
                await anyio.sleep(0.2 * 2**attempt)
            except httpx.TimeoutException as exc:
                limit = timeout or self._timeout.read
                raise EngineError(f"{method} {url} timed out after {limit:g} s: {exc!r}") from exc
            except httpx.HTTPError as exc:
                raise EngineError(f"{method} {url} failed: {exc!r}") from exc
        if response.status_code != 200:
            raise SGLangHTTPError(method, url, response.status_code, response.text)
        return response.content

    async def probe(self, server: Upstream) -> None:
        """Read ``/get_model_info`` (model path, weight version) and ``/v1/models`` (context)."""
        try:
            info = w.model_info_decoder.decode(await self.call(server, "GET", "/get_model_info"))
        except msgspec.DecodeError as exc:
            raise EngineError(f"{server.url}/get_model_info: unexpected reply: {exc}") from exc
        _read_info(server, info)
        try:
            models = w.model_list_decoder.decode(await self.call(server, "GET", "/v1/models"))
            server.max_context = models.data[0].max_model_len if models.data else None
        except (EngineError, msgspec.DecodeError):
            server.max_context = None

    def probe_blocking(self, server: Upstream) -> None:
        """``probe`` without an event loop (for a ``max_context`` read before any request)."""
        with httpx.Client(timeout=self._timeout, verify=self._verify, trust_env=False) as client:
            try:
                info = client.get(server.url + "/get_model_info").raise_for_status()
                models = client.get(server.url + "/v1/models").raise_for_status()
            except httpx.HTTPError as exc:
                raise EngineError(f"cannot read model info from {server.url}: {exc}") from exc
        _read_info(server, w.model_info_decoder.decode(info.content))
        cards = w.model_list_decoder.decode(models.content).data
        server.max_context = cards[0].max_model_len if cards else None


def _read_info(server: Upstream, info: w.WireModelInfo) -> None:
    server.model_path = info.model_path
    server.weight_version = w.parse_weight_version(info.weight_version)
    rule = (info.agentrl or {}).get("in_flight")
    server.in_flight = rule if isinstance(rule, str) else "finish"


def wire_sampling(sampling: SamplingParams) -> w.WireSamplingParams:
    """SGLang ``sampling_params`` for ``sampling``: exact sampled ids back, stop tokens included."""
    return w.WireSamplingParams(
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        no_stop_trim=True,
        skip_special_tokens=False,
        sampling_seed=sampling.seed,
    )


def to_result(
    reply: w.WireGenerateResp,
    sampling: SamplingParams,
    version: int,
    url: str,
    whole: bool,
    context: list[int],
) -> GenerateResult:
    """The protocol's result for one ``/generate`` reply; ``EngineError`` when it is inconsistent.

    ``whole``: the request sent the whole ``context``, so ``prompt_tokens`` must equal its length.
    A ``length`` finish whose last id is a stop id counts as ``stop`` (SGLang tests the length
    limit first; the embedded engine, and the rollout runtime, treat that token as a stop).
    """
    meta = reply.meta_info
    entries = meta.output_token_logprobs
    if entries is None:
        raise EngineError(f"{url}/generate: reply has no meta_info.output_token_logprobs")
    ids = [int(e[1]) for e in entries]
    logprobs = [e[0] for e in entries]
    if any(lp is None for lp in logprobs) or len(ids) != meta.completion_tokens:
        raise EngineError(f"{url}/generate: incomplete output_token_logprobs for {meta.id}")
    odd = [lp for lp in logprobs if not math.isfinite(lp)]
    if odd:
        raise EngineError(
            f"{url}/generate: output_token_logprobs of {meta.id} hold {len(odd)} value(s) that "
            f"are not finite (first {odd[0]}): the server's weights or sampling are broken"
        )
    if reply.output_ids is not None and list(reply.output_ids) != ids:
        raise EngineError(f"{url}/generate: output_ids disagree with output_token_logprobs")
    if whole and meta.prompt_tokens != len(context):
        raise EngineError(f"{url}/generate: prompt_tokens {meta.prompt_tokens} != {len(context)}")
    finish = meta.finish_reason
    kind = finish.type if finish is not None else "abort"
    matched: int | str | None = None
    if kind == "stop":
        value = finish.matched if finish is not None else None
        matched = ids[-1] if isinstance(value, list) and ids else value  # type: ignore[assignment]
    elif kind == "length" and ids and ids[-1] in sampling.stop_token_ids:
        kind, matched = "stop", ids[-1]  # SGLang checks the length limit before stop ids
    elif kind not in ("length", "abort"):
        raise EngineError(f"{url}/generate: unknown finish_reason {finish!r}")
    # a reply without the field (an SGLang older than 0.5.17) counts as the version the
    # engine holds; "default" (or any non-integer) is a server no update reached (restarted
    # since the last one): its launch weights, version 0 — never the version published last
    first = version if meta.weight_version is None else w.parse_weight_version(meta.weight_version)
    versions = meta.token_versions  # agentrl serve's, when the tokens span versions
    if versions is not None and (len(versions) != len(ids) or versions != sorted(versions)):
        raise EngineError(
            f"{url}/generate: meta_info.token_versions has {len(versions)} entries for "
            f"{len(ids)} tokens, or decreases"
        )
    return GenerateResult(
        ids,
        [float(lp) for lp in logprobs],  # type: ignore[arg-type]
        kind,  # type: ignore[arg-type]
        matched,
        prompt_tokens=meta.prompt_tokens,
        cached_tokens=meta.cached_tokens,
        weight_version=versions[0] if versions else first,
        # SGLang cannot tell per token: every token then counts as the reply's weight_version
        token_versions=list(versions) if versions else [first] * len(ids),
    )
