"""``python -m agentrl.sandboxes serve`` / ``agentrl sandbox serve``: one pool behind the HTTP app.

Loopback by default; a non-loopback ``--host`` requires a bearer token (``--token`` or
``$AGENTRL_SANDBOX_TOKEN``). Prints ``… listening on http://HOST:PORT`` once ready (``--port 0``
picks a free port). SIGTERM/SIGINT: stop accepting, let running requests finish (bounded), close
the pool (every container and temp dir it made goes), exit 0. Exit codes: 2 bad arguments or
configuration, 3 the backend is unavailable on this host, 1 any other sandbox error.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import sys
from typing import Any

from aiohttp import web

from ._config import PoolConfig
from ._errors import BackendUnavailable, SandboxError
from ._pool import open_sandbox_pool
from ._service import DEFAULT_MAX_BATCH, DEFAULT_MAX_REQUEST_BYTES, make_app

DEFAULT_PORT = 8090
TOKEN_ENV = "AGENTRL_SANDBOX_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _pool_config(args: argparse.Namespace) -> PoolConfig:
    data: dict[str, Any] = {}
    if args.config:
        with open(args.config) as f:
            data = json.load(f)
    backend = dict(data.get("backend") or {})
    if args.backend:
        if backend.get("type") not in (None, args.backend):
            backend = {}
        backend["type"] = args.backend
    backend.setdefault("type", "docker")
    if args.image:
        backend["image"] = args.image
    data["backend"] = backend
    for key in ("size", "max_queue", "queue_timeout_s", "recycle_after"):
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    return PoolConfig.model_validate(data)


async def serve(
    config: PoolConfig,
    host: str,
    port: int,
    *,
    token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_batch: int = DEFAULT_MAX_BATCH,
    shutdown_timeout_s: float = 30.0,
    ready: Any = None,
) -> None:
    """Open the pool, serve until SIGTERM/SIGINT, then stop accepting, drain, close the pool."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with open_sandbox_pool(config) as pool:
            app = make_app(
                pool, token=token, max_request_bytes=max_request_bytes, max_batch=max_batch
            )
            runner = web.AppRunner(app, handle_signals=False, access_log=None)
            await runner.setup()
            try:
                site = web.TCPSite(runner, host, port, shutdown_timeout=shutdown_timeout_s)
                await site.start()
                bound = runner.addresses[0]
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
                await runner.cleanup()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    print("agentrl sandbox service: pool closed", flush=True)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="agentrl sandbox serve", description="Serve a sandbox pool over HTTP."
    )
    parser.add_argument("--backend", choices=("docker", "gvisor", "local"), default=None)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument(
        "--token",
        default=None,
        help=f"bearer token every request must carry (default ${TOKEN_ENV}); required when "
        "--host is not a loopback address",
    )
    parser.add_argument("--config", default=None, help="PoolConfig as a JSON file")
    parser.add_argument("--image", default=None, help="image for docker/gvisor")
    parser.add_argument("--size", type=int, default=None, help="warm sandboxes (default 4)")
    parser.add_argument("--max-queue", type=int, default=None, help="waiting requests (64)")
    parser.add_argument("--queue-timeout-s", type=float, default=None, help="(default 30)")
    parser.add_argument("--recycle-after", type=int, default=None, help="(default 100)")
    parser.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_BYTES / 2**20)
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
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
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not is_loopback(args.host) and not token:
        print(
            f"error: binding {args.host} (not loopback) requires a bearer token: pass --token "
            f"or set ${TOKEN_ENV}",
            file=sys.stderr,
        )
        return 2
    try:
        config = _pool_config(args)
    except (OSError, ValueError) as exc:
        print(f"error: invalid pool configuration: {exc}", file=sys.stderr)
        return 2
    try:
        _run_unwrapped(
            serve(
                config,
                args.host,
                args.port,
                token=token,
                max_request_bytes=int(args.max_request_mb * 2**20),
                max_batch=args.max_batch,
            )
        )
    except BackendUnavailable as exc:
        print(f"error: backend {config.backend.type} unavailable: {exc}", file=sys.stderr)
        return 3
    except (SandboxError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
