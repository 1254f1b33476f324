"""``python -m agentrl.sandboxes serve`` / ``agentrl sandbox serve``: one pool behind the HTTP app.

Loopback by default; a non-loopback ``--host`` requires a bearer token (``--token`` or
``$AGENTRL_SANDBOX_TOKEN``; printable ASCII). Prints ``… listening on http://HOST:PORT`` once
ready (``--port 0`` picks a free port). The service's own limits (``ServiceConfig``) come from
the ``"service"`` object of ``--config`` and the flags, which win. The listening socket sits
behind a ``ConnectionGuard`` (connection cap, idle and header deadlines); at start the
file-descriptor limit is raised to fit ``max_connections`` or the service refuses to start.
SIGTERM/SIGINT: stop accepting, let running requests finish (``shutdown_timeout_s``), close the
pool (every container and temp dir it made goes), exit 0. Exit codes: 2 bad arguments or
configuration, 3 the backend is unavailable on this host, 1 any other sandbox error.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import os
import reprlib
import resource
import signal
import sys
from typing import Any

import pydantic
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ._config import DEFAULT_IMAGE, PoolConfig, ServiceConfig
from ._connections import MAX_LINGERING, ConnectionGuard
from ._errors import BackendUnavailable, SandboxError
from ._pool import open_sandbox_pool
from ._service import make_app
from ._service_state import STATE, ServiceState

DEFAULT_PORT = 8090
TOKEN_ENV = "AGENTRL_SANDBOX_TOKEN"
FDS_PER_SANDBOX = 8  # pipes of a local supervisor, a container's exec socket, their spares
FDS_RESERVED = 64  # the interpreter, logs, the docker client, the listening sockets
LISTEN_BACKLOG = 64
# asyncio accepts up to a backlog of sockets per wake-up and hands them to the guard a loop
# iteration later: under a connection flood a few backlogs are open beyond the cap for a moment
ACCEPT_BURSTS = 4


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_SERVICE_FLAGS = {  # flag attribute → ServiceConfig field (and the unit it is given in)
    "max_request_mb": ("max_request_bytes", 2**20),
    "max_batch": ("max_batch", 1),
    "max_answer_mb": ("max_answer_bytes", 2**20),
    "max_inflight_mb": ("max_inflight_bytes", 2**20),
    "max_connections": ("max_connections", 1),
    "idle_timeout_s": ("idle_timeout_s", 1),
    "header_timeout_s": ("header_timeout_s", 1),
    "body_timeout_s": ("body_timeout_s", 1),
    "send_timeout_s": ("send_timeout_s", 1),
}


_POOL_FLAGS = ("size", "max_queue", "queue_timeout_s", "recycle_after")
"""Flag attributes that set the ``PoolConfig`` field of the same name."""


def _flag(attribute: str) -> str:
    return "--" + attribute.replace("_", "-")


def _short(value: Any) -> str:
    """``repr(value)`` for an error message, long values cut."""
    text = repr(value) if isinstance(value, int | float | bool | None) else _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def _describe(exc: pydantic.ValidationError, flags: dict[str, str], where: str = "") -> str:
    """The errors of ``exc`` on one line: a field a flag set is named by the flag and the value
    given (``--size -1: ...``), any other by its dotted path in ``--config`` (``where``)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if loc in flags:
            parts.append(
                f"{flags[loc]}: {message}"
                + (f" ({loc})" if loc.replace("_", "-") not in flags[loc] else "")
            )
        elif loc:
            value = "" if isinstance(err.get("input"), dict) else f" (got {_short(err['input'])})"
            parts.append(f"{'.'.join(x for x in (where, loc) if x)}: {message}{value}")
        else:
            parts.append(message)
    return "; ".join(parts)


def _read_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--config``: a JSON object (strict UTF-8, no key twice in one object)."""
    if not args.config:
        return {}
    with open(args.config, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{args.config}: line {line}: not UTF-8 text") from None

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in items:
            if key in seen:
                raise ValueError(f"{args.config}: key {_short(key)} appears twice in one object")
            seen[key] = value
        return seen

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{args.config} is not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise ValueError(f"{args.config}: nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"{args.config}: must hold a JSON object")
    return data


def _section(data: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    section = data.get(name)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ValueError(f"{where}: {name}: expected an object, got {_short(section)}")
    return dict(section)


def _service_config(args: argparse.Namespace, data: dict[str, Any]) -> ServiceConfig:
    service = _section(data, "service", args.config)
    flags = {}
    for attribute, (field, unit) in _SERVICE_FLAGS.items():
        value = getattr(args, attribute, None)
        if value is None:
            continue
        given = f"{_flag(attribute)} {value}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{given}: must be a finite number")
        service[field] = int(value * unit) if unit != 1 else value
        flags[field] = given
    try:
        return ServiceConfig.model_validate(service)
    except pydantic.ValidationError as exc:
        raise ValueError(_describe(exc, flags, "service")) from None


def _pool_config(args: argparse.Namespace, data: dict[str, Any] | None = None) -> PoolConfig:
    data = {k: v for k, v in (data or {}).items() if k != "service"}
    backend = _section(data, "backend", args.config)
    flags = {}
    if args.backend:
        if backend.get("type") not in (None, args.backend):
            backend = {}
        backend["type"] = args.backend
        flags["backend.type"] = f"--backend {args.backend}"
    backend.setdefault("type", "docker")
    if args.image:
        backend["image"] = args.image
        flags[f"backend.{backend['type']}.image"] = f"--image {_short(args.image)}"
    data["backend"] = backend
    for key in _POOL_FLAGS:
        value = getattr(args, key)
        if value is not None:
            data[key] = value
            flags[key] = f"{_flag(key)} {value}"
    try:
        return PoolConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ValueError(_describe(exc, flags)) from None


class _OneLineClientErrors(logging.Filter):
    """aiohttp logs a traceback for every malformed request it refuses (400): bad input from a
    client is not a fault of the service, so it becomes one line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            where = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "refused a malformed request from %s with %s: %s"
            record.args = (where, exc.code, str(exc.message).strip()[:200])
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def fds_needed(service: ServiceConfig, pool: PoolConfig) -> int:
    """File descriptors the service may hold at once: its connections (with the ones being
    turned away and those accepted in a burst before the guard sees them) and the pool's."""
    connections = service.max_connections + MAX_LINGERING + ACCEPT_BURSTS * LISTEN_BACKLOG
    return connections + FDS_RESERVED + FDS_PER_SANDBOX * pool.size


def fit_fd_limit(service: ServiceConfig, pool: PoolConfig) -> int:
    """Raise the soft RLIMIT_NOFILE (up to the hard one) to ``fds_needed``; ``ValueError`` when
    even the hard limit is too low. The file descriptors needed."""
    need = fds_needed(service, pool)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(
                f"max_connections={service.max_connections} with size={pool.size} needs about "
                f"{need} file descriptors; RLIMIT_NOFILE allows {hard}: raise it (ulimit -n) "
                "or lower max_connections"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


async def serve(
    config: PoolConfig,
    host: str,
    port: int,
    *,
    token: str | None = None,
    service: ServiceConfig | None = None,
    ready: Any = None,
) -> None:
    """Open the pool, serve until SIGTERM/SIGINT, then stop accepting, drain, close the pool."""
    service = service or ServiceConfig()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with open_sandbox_pool(config) as pool:
            guard = ConnectionGuard(
                max_connections=service.max_connections,
                idle_timeout_s=service.idle_timeout_s,
                header_timeout_s=service.header_timeout_s,
                max_head_bytes=service.max_head_bytes,
            )
            app = make_app(pool, token=token, config=service, guard=guard)
            runner = web.AppRunner(
                app,
                handle_signals=False,
                access_log=None,
                auto_decompress=False,  # a compressed body is refused (415), never inflated
                keepalive_timeout=service.idle_timeout_s,
                # the stop waits for running requests itself (_finish_requests): aiohttp's
                # own wait takes twice its timeout (a graceful wait, then one after a cancel
                # that does not reach the handler)
                shutdown_timeout=STOP_GRACE_S,
            )
            await runner.setup()
            assert runner.server is not None
            listener = await loop.create_server(
                guard.protocol_factory(runner.server),
                host,
                port,
                backlog=LISTEN_BACKLOG,
                reuse_address=True,
            )
            try:
                bound = listener.sockets[0].getsockname()
                url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
                print(
                    f"agentrl sandbox service: backend={pool.backend_name} size="
                    f"{config.size} listening on {url}",
                    flush=True,
                )
                if ready is not None:
                    ready(url)
                await stop.wait()
                print("agentrl sandbox service: stopping", flush=True)
            finally:
                listener.close()  # stop accepting
                guard.close_all()  # connections with no request running
                await _finish_requests(app[STATE], service.shutdown_timeout_s)
                await runner.cleanup()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    print("agentrl sandbox service: pool closed", flush=True)


STOP_GRACE_S = 2.0
"""How long cancelled requests get to end (their sandbox runs killed) at a stop."""


async def _finish_requests(state: ServiceState, timeout_s: float) -> None:
    """Let the requests running at a stop (and any whose head had arrived) finish within
    ``timeout_s``; cancel the rest (their runs are killed, their clients get no answer) and
    give them ``STOP_GRACE_S`` to end."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while state.handlers:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        await asyncio.wait(set(state.handlers), timeout=left)
    late = set(state.handlers)
    for task in late:
        task.cancel()
    if late:
        await asyncio.wait(late, timeout=STOP_GRACE_S)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="agentrl sandbox serve", description="Serve a sandbox pool over HTTP."
    )
    parser.add_argument(
        "--backend",
        choices=("docker", "gvisor", "local"),
        default=None,
        help="where programs run (default: the --config file's backend, else docker)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="default %(default)s; 0 picks a free one"
    )
    parser.add_argument(
        "--token",
        default=None,
        help=f"bearer token every request must carry (default ${TOKEN_ENV}); required when "
        "--host is not a loopback address",
    )
    parser.add_argument(
        "--config", default=None, help="PoolConfig as a JSON file (JSON only: no YAML here)"
    )
    parser.add_argument(
        "--image", default=None, help=f"image for docker/gvisor (default {DEFAULT_IMAGE})"
    )
    parser.add_argument(
        "--size", type=int, default=None, help="warm sandboxes, the most runs at once (default 4)"
    )
    parser.add_argument(
        "--max-queue", type=int, default=None, help="requests that may wait for one (default 64)"
    )
    parser.add_argument(
        "--queue-timeout-s",
        type=float,
        default=None,
        help="seconds a request waits for a sandbox before a 429 busy (default 30)",
    )
    parser.add_argument(
        "--recycle-after",
        type=int,
        default=None,
        help="runs per sandbox before a fresh one replaces it (default 100)",
    )
    limits = parser.add_argument_group(
        "service limits", "ServiceConfig; also the 'service' object of --config (flags win)"
    )
    limits.add_argument("--max-request-mb", type=float, help="largest request body (64)")
    limits.add_argument("--max-batch", type=int, help="most items in one batch (256)")
    limits.add_argument(
        "--max-answer-mb", type=float, help="largest answer: items x 2 x output_limit_bytes (64)"
    )
    limits.add_argument(
        "--max-inflight-mb", type=float, help="bodies and answers held at once (256)"
    )
    limits.add_argument("--max-connections", type=int, help="open connections (256)")
    limits.add_argument("--idle-timeout-s", type=float, help="idle connection lifetime (30)")
    limits.add_argument("--header-timeout-s", type=float, help="time for a request head (10)")
    limits.add_argument("--body-timeout-s", type=float, help="time for a request body (60)")
    limits.add_argument("--send-timeout-s", type=float, help="time to take an answer (60)")
    return parser


def serve_main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m agentrl.sandboxes serve`` / ``agentrl sandbox serve``."""
    args = build_parser().parse_args(argv)
    return run_from_args(args)


def _run_unwrapped(coro: Any) -> None:
    """``asyncio.run``, re-raising the first sandbox error out of a task group's group."""
    try:
        asyncio.run(coro)
    except BaseExceptionGroup as group:
        match = group.subgroup(lambda e: isinstance(e, SandboxError | OSError))
        if match is None:
            raise
        first: BaseException = match
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group


def run_from_args(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_OneLineClientErrors())
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not is_loopback(args.host) and not token:
        print(
            f"error: binding {args.host} (not loopback) requires a bearer token: pass --token "
            f"or set ${TOKEN_ENV}",
            file=sys.stderr,
        )
        return 2
    if token is not None and not (token.isascii() and token.isprintable() and " " not in token):
        print("error: the bearer token must be printable ASCII without spaces", file=sys.stderr)
        return 2
    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port {args.port}: must be 0 to 65535 (0 picks a free port)")
        data = _read_config(args)
        config = _pool_config(args, data)
        service = _service_config(args, data)
    except OSError as exc:
        print(
            f"error: invalid configuration: {exc.strerror or exc}: {args.config}", file=sys.stderr
        )
        return 2
    except ValueError as exc:
        print(f"error: invalid configuration: {exc}", file=sys.stderr)
        return 2
    try:
        fit_fd_limit(service, config)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        _run_unwrapped(serve(config, args.host, args.port, token=token, service=service))
    except BackendUnavailable as exc:
        print(f"error: backend {config.backend.type} unavailable: {exc}", file=sys.stderr)
        return 3
    except (SandboxError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
