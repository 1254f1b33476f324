"""The one way a run gets its sandbox: a ``sandbox:`` spec → an opened, metered runner.

A spec is what a config's ``sandbox:`` key (or ``agentrl rollout --sandbox``) holds:

- ``local`` | ``docker`` | ``gvisor``: an in-process pool of that backend with default options;
- ``http(s)://HOST:PORT[,HOST:PORT…]``: ``agentrl sandbox serve`` at one or several addresses
  (replicas: a ``ReplicatedSandbox`` sends each request to the least loaded one that is up,
  fails over only what provably did not run; bearer token from ``$AGENTRL_SANDBOX_TOKEN``);
- a path to a ``PoolConfig`` file (``.json``, ``.yaml`` or ``.yml``);
- a mapping of the pool's options (a ``PoolConfig``: ``{backend: {type: docker}, size: 8}``).

``sandbox_spec`` checks one (errors name ``sandbox`` and the value); ``open_env_sandbox`` is
what the commands call: it refuses, before anything heavy starts, an environment that runs code
with no sandbox configured (or a sandbox for one that takes none), and opens the runner once
for the whole run — closed when the run ends, on errors and Ctrl-C too. The runner is a
``MeteredSandbox``: the pool or client behind it, plus the counters the training ledger logs
under ``sandbox/…`` (``take_interval`` per runner, ``interval_metrics`` over the ranks).
"""

from __future__ import annotations

import os
import reprlib
import statistics
import time
import urllib.parse
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from agentrl import ConfigError, read_config_file
from agentrl.sandboxes import (
    PoolBusy,
    PoolConfig,
    ReplicatedSandbox,
    RunRequest,
    RunResult,
    SandboxClient,
    SandboxPool,
    SandboxRunner,
    SandboxUnreachable,
    open_sandbox_pool,
)

from ._sandbox import sandbox_errors, wants_sandbox

BACKENDS = ("local", "docker", "gvisor")
TOKEN_ENV = "AGENTRL_SANDBOX_TOKEN"
POOL_FILES = (".json", ".yaml", ".yml")
EXPECTED = (
    "expected local | docker | gvisor | http(s)://HOST:PORT[,HOST:PORT…] | a PoolConfig file "
    "(.json, .yaml) | a mapping of the pool's options"
)

SandboxSpec = str | PoolConfig
"""A checked spec: a backend name, service URLs or a file path (``str``), or pool options."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def _short(value: Any) -> str:
    """``repr(value)`` shortened for an error message (long strings and containers cut)."""
    return _REPR.repr(value)


def sandbox_spec(value: Any, where: str = "sandbox") -> SandboxSpec:
    """Check a spec (see the module docs); a mapping becomes a ``PoolConfig``. Raises
    ``ConfigError`` naming ``where``, the field inside the pool's options and the value."""
    if isinstance(value, PoolConfig):
        return value
    if isinstance(value, Mapping):
        return _pool_options(dict(value), where)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{_at(where)}{EXPECTED}, got {_short(value)}")
    value = value.strip()
    if value in BACKENDS or value.endswith(POOL_FILES):
        return value
    if value.startswith(("http://", "https://")):
        service_urls(value, where)  # refuse a malformed address now
        return value
    raise ConfigError(f"{_at(where)}unknown sandbox {_short(value)}: {EXPECTED}")


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def service_urls(spec: str, where: str = "sandbox") -> list[str]:
    """``http://a:1,b:2`` → ``["http://a:1", "http://b:2"]`` (an address without a scheme
    takes the first one's); each must be ``http(s)://HOST[:PORT]`` with nothing after it, and
    no host and port may be given twice."""
    scheme = spec.split("://", 1)[0]
    urls = []
    seen: dict[tuple[str, int], str] = {}
    for item in spec.split(","):
        url = item.strip() if "://" in item else f"{scheme}://{item.strip()}"
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 — raises ValueError for a port that is not a number
        except ValueError as exc:
            raise ConfigError(f"{_at(where)}bad sandbox service address {item!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"{_at(where)}bad sandbox service address {item!r}: expected http(s)://HOST:PORT"
            )
        if parts.path.strip("/") or parts.query or parts.fragment:
            raise ConfigError(
                f"{_at(where)}sandbox service address {item!r} has a path: give only "
                "http(s)://HOST:PORT"
            )
        url = f"{parts.scheme}://{parts.netloc}"
        where_to = (parts.hostname, parts.port or {"http": 80, "https": 443}[parts.scheme])
        if where_to in seen:
            raise ConfigError(
                f"{_at(where)}address {item.strip()!r} is given twice (as "
                f"{seen[where_to]!r}): each replica once, or its share of the work doubles"
            )
        seen[where_to] = item.strip()
        urls.append(url)
    return urls


def _pool_options(data: dict[str, Any], where: str) -> PoolConfig:
    try:
        return PoolConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in (where, *err['loc']) if x)}: {err['msg']}"
            + ("" if isinstance(err.get("input"), dict) else f" (got {_short(err.get('input'))})")
            for err in exc.errors()
        )
        raise ConfigError(f"invalid sandbox options: {problems}") from None


def _pool_file(path: str, where: str) -> PoolConfig:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{where}: no such sandbox pool file: {path}")
    try:
        data = read_config_file(file)
    except ConfigError as exc:
        raise ConfigError(f"sandbox config {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"sandbox config {path}: expected a mapping of the pool's options")
    return _pool_options(data, f"{where} ({path})")


def pool_config(spec: SandboxSpec, where: str = "sandbox") -> PoolConfig | None:
    """The pool a spec opens in this process (None for a service)."""
    spec = sandbox_spec(spec, where)
    if isinstance(spec, PoolConfig):
        return spec
    if spec in BACKENDS:
        return PoolConfig.model_validate({"backend": {"type": spec}})
    if spec.startswith(("http://", "https://")):
        return None
    return _pool_file(spec, where)


class MeteredSandbox:
    """A ``SandboxRunner`` over the run's pool, service client or clients, counting what the
    ledger logs: programs run, refusals for capacity (each makes a lease wait and retry), and
    each program's time in the sandbox (``RunResult.wall_s``) and per request (queueing and
    transfer included). ``take_interval()`` returns them since its previous call."""

    def __init__(self, runners: Sequence[SandboxRunner], pool: SandboxPool | None = None):
        if not runners:
            raise ValueError("MeteredSandbox needs at least one runner")
        self.runners = list(runners)
        self.pool = pool
        """The in-process pool, when there is one (its ``statistics()`` feed the metrics)."""
        self._in_flight = [0] * len(self.runners)
        self._next = 0
        self.execs = 0
        """Programs that ran (every status but ``invalid_request``)."""
        self.busy = 0
        """Requests refused for capacity (nothing ran; the lease waits and retries)."""
        self.timeouts = 0
        self.sandbox_errors = 0
        """Results with status ``sandbox_error``: the sandbox failed, not the program."""
        self._exec_s: list[float] = []
        self._request_s: list[float] = []
        self._last: dict[str, int] = {}

    def _order(self) -> list[int]:
        """Runner indices, least busy first (ties: round robin)."""
        n = len(self.runners)
        start = self._next
        self._next = (self._next + 1) % n
        return sorted(((start + k) % n for k in range(n)), key=lambda i: self._in_flight[i])

    async def _call(self, method: str, arg: Any) -> Any:
        last: Exception | None = None
        for i in self._order():  # another server may have room (nothing ran on a refusal)
            self._in_flight[i] += 1
            started = time.perf_counter()
            try:
                out = await getattr(self.runners[i], method)(arg)
            except PoolBusy as exc:
                last = exc
                continue
            except SandboxUnreachable as exc:
                if len(self.runners) == 1:
                    raise
                last = exc
                continue
            finally:
                self._in_flight[i] -= 1
            self._request_s.append(time.perf_counter() - started)
            return out
        if isinstance(last, PoolBusy):
            self.busy += 1
        assert last is not None
        raise last

    def _count(self, results: Sequence[RunResult]) -> None:
        for result in results:
            if result.status == "invalid_request":
                continue
            self.execs += 1
            self._exec_s.append(result.wall_s)
            self.timeouts += result.status == "timeout"
            self.sandbox_errors += result.status == "sandbox_error"

    async def run(self, request: RunRequest) -> RunResult:
        result = await self._call("run", request)
        self._count([result])
        return result

    async def run_batch(self, requests: Sequence[RunRequest]) -> list[RunResult]:
        results = await self._call("run_batch", list(requests))
        self._count(results)
        return results

    def take_interval(self) -> SandboxInterval:
        """What happened since the previous call (counts, latency samples) and the pool's
        gauges now."""
        counts = {
            "execs": self.execs,
            "busy_waits": self.busy,
            "timeouts": self.timeouts,
            "sandbox_errors": self.sandbox_errors,
        }
        gauges: dict[str, int] = {}
        for runner in self.runners:
            if isinstance(runner, ReplicatedSandbox):
                for i, replica in enumerate(runner.statistics()):
                    for key in ("requests", "busy", "unreachable", "failures"):
                        counts[f"replica{i}/{key}"] = getattr(replica, key)
                    gauges[f"replica{i}/up"] = int(replica.up)
        if self.pool is not None:
            stats = self.pool.statistics()
            counts.update(recycles=stats.recycles, create_failures=stats.create_failures)
            gauges = {"in_use": stats.in_use, "idle": stats.idle, "queued": stats.queued}
        delta = {k: v - self._last.get(k, 0) for k, v in counts.items()}
        self._last = counts
        interval = SandboxInterval(delta, gauges, self._exec_s, self._request_s)
        self._exec_s, self._request_s = [], []
        return interval


@dataclass
class SandboxInterval:
    """One runner's activity over an interval (``MeteredSandbox.take_interval``)."""

    counts: dict[str, int]
    """Programs run (``execs``), capacity refusals (``busy_waits``), ``timeouts``,
    ``sandbox_errors``; with a pool, ``recycles`` and ``create_failures``; with service
    replicas, ``replica<i>/requests``, ``/busy``, ``/unreachable``, ``/failures`` for the
    ``i``-th address."""
    gauges: dict[str, int]
    """A pool's ``in_use``, ``idle``, ``queued`` at the end of the interval; with service
    replicas, ``replica<i>/up`` (1 or 0)."""
    exec_s: list[float]
    """Each program's wall time in its sandbox, seconds."""
    request_s: list[float]
    """Each request's time as the caller saw it (queueing and transfer included), seconds."""


def interval_metrics(parts: Sequence[SandboxInterval], prefix: str = "sandbox") -> dict[str, Any]:
    """Ledger fields ``{prefix}/…`` from the intervals of one or several runners (one per
    rank): counts and gauges summed, p50/p99 over every sample."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in (*part.counts.items(), *part.gauges.items()):
            out[f"{prefix}/{key}"] = out.get(f"{prefix}/{key}", 0) + value
    for name in ("exec_s", "request_s"):
        samples = [x for part in parts for x in getattr(part, name)]
        out[f"{prefix}/{name}_p50"] = _quantile(samples, 0.50)
        out[f"{prefix}/{name}_p99"] = _quantile(samples, 0.99)
    return out


def _quantile(samples: list[float], q: float) -> float | None:
    """The ``q`` quantile (linear interpolation between order statistics); None if empty."""
    if not samples:
        return None
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[round(q * 100) - 1]


@asynccontextmanager
async def open_sandbox_runner(
    spec: SandboxSpec | Mapping[str, Any],
    *,
    size: int | None = None,
    token: str | None = None,
    where: str = "sandbox",
) -> AsyncIterator[MeteredSandbox]:
    """Open the sandbox a run shares, from a spec (see the module docs); ``size`` overrides
    the pool's size. Raises ``agentrl.ConfigError`` for a bad spec (naming ``where``) and
    ``agentrl.SandboxError`` when it cannot be opened (backend unavailable, service
    unreachable)."""
    checked = sandbox_spec(spec, where)
    config = pool_config(checked, where)
    label = checked if isinstance(checked, str) else f"{config.backend.type} pool"  # type: ignore[union-attr]
    with sandbox_errors(f"sandbox {label}"):
        if config is None:
            token = token or os.environ.get(TOKEN_ENV) or None
            urls = service_urls(str(checked), where)
            async with AsyncExitStack() as stack:
                if len(urls) == 1:
                    client = await stack.enter_async_context(SandboxClient(urls[0], token=token))
                    await client.health()  # fail now, clearly, if the service is not there
                    yield MeteredSandbox([client])
                    return
                # replicas: a refused connection fails over at once (the replica is probed back)
                clients = [
                    await stack.enter_async_context(
                        SandboxClient(url, token=token, connect_retries=0)
                    )
                    for url in urls
                ]
                replicas = ReplicatedSandbox(clients)
                await replicas.refresh()  # fail now, clearly, if no replica is there
                yield MeteredSandbox([replicas])
            return
        if size is not None:
            config = config.model_copy(update={"size": size})
        async with open_sandbox_pool(config) as pool:
            yield MeteredSandbox([pool], pool)


def check_env_sandbox(spec: Any, env_id: str, factory: Any, where: str = "sandbox") -> bool:
    """Whether the environment gets a sandbox; raises ``ConfigError`` when one that runs code
    has none configured, or one that takes none is given one (checked before anything is
    loaded)."""
    wants = wants_sandbox(factory)
    if spec is None and wants:
        # `agentrl rollout` takes --sandbox; a training or eval config takes `sandbox:`
        how = "--sandbox KIND" if where == "--sandbox" else "--set sandbox=KIND"
        raise ConfigError(
            f"{env_id} runs code in a sandbox and none is configured: set `sandbox:` in the "
            "config (local | docker | gvisor | http(s)://HOST:PORT | a PoolConfig file | the "
            f"pool's options), or pass {how}"
        )
    if spec is not None and not wants:
        raise ConfigError(
            f"{where}: {env_id} takes no sandbox: remove `sandbox:` (got {_short(spec)})"
        )
    if spec is not None:
        sandbox_spec(spec, where)
    return wants


@asynccontextmanager
async def open_env_sandbox(
    spec: Any, env_id: str, factory: Any, *, where: str = "sandbox"
) -> AsyncIterator[dict[str, Any]]:
    """The environment factory's resources for a run: ``{"sandbox": runner}`` opened from
    ``spec`` for an environment that runs code, ``{}`` for one that does not (see
    ``check_env_sandbox``); the runner is closed when the block ends."""
    if not check_env_sandbox(spec, env_id, factory, where):
        yield {}
        return
    async with open_sandbox_runner(spec, where=where) as runner:
        yield {"sandbox": runner}
