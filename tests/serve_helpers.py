"""Start and stop a real ``agentrl serve`` (the SGLang HTTP subset), and the real
``sglang-router`` in front of such servers, on free loopback ports; make perturbed model copies
to load into them."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(
    proc: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    log: Path,
    what: str,
    seconds: float,
    errors: tuple[type[Exception], ...] = (httpx.HTTPError,),
) -> None:
    """Poll ``ready()`` (``errors`` count as not yet) until it holds; a process that exits, or
    ``seconds`` passing (then it is stopped), raise with ``what`` and its log."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()}")
        try:
            if ready():
                return
        except errors:
            pass
        time.sleep(0.2)
    stop_serve(proc)
    raise RuntimeError(f"{what} was not ready after {seconds:.0f} s: {log.read_text()}")


def start_serve(model: Path, log: Path, *options: str) -> tuple[subprocess.Popen[bytes], str]:
    """``agentrl serve --model MODEL`` plus ``options``; returns it once healthy, and its URL."""
    port = free_port()
    serve = [sys.executable, "-m", "agentrl.cli", "serve"]  # as a user runs it
    cmd = [*serve, "--model", str(model), "--port", str(port), "--num-threads", "1", *options]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        return httpx.get(url + "/health", timeout=1).status_code == 200

    wait_ready(proc, healthy, log, "agentrl serve", 180)
    return proc, url


@contextmanager
def serving(model: Path, log: Path, *options: str) -> Iterator[str]:
    """``start_serve`` for the ``with`` block; the server is stopped when it ends."""
    proc, url = start_serve(model, log, *options)
    try:
        yield url
    finally:
        stop_serve(proc)


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def perturbed_copy(model_dir: Path, dest: Path, seed: int = 1) -> Path:
    """A copy of ``model_dir`` whose weights got seeded noise (same shapes, same tokenizer)."""
    shutil.copytree(model_dir, dest)
    state = load_file(dest / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    noisy = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    save_file(noisy, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def metric(url: str, name: str) -> float:
    """The value of ``name`` on the server's ``/metrics`` (Prometheus text, labels or not)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def listed_workers(router: str) -> dict[str, bool]:
    """The workers an ``sglang-router`` lists, and whether it finds each healthy."""
    workers = httpx.get(router + "/workers", timeout=10).json()["workers"]
    return {w["url"]: w["is_healthy"] for w in workers}


def start_router(
    workers: list[str], log: Path, health_check_s: int = 1, failures: int = 1
) -> tuple[subprocess.Popen[bytes], str]:
    """``sglang-router`` with round-robin routing (the policy least likely to keep a session on
    one worker by chance) and a health check every ``health_check_s``, a worker unhealthy after
    ``failures`` failed checks in a row (a test that does not kill workers takes more, so a
    worker busy loading weights on a loaded machine is not dropped). Its metrics listener gets
    a free loopback port too: on its default (29000) a second router on the host fails to
    start."""
    port = free_port()
    cmd = [
        *(sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"),
        *("--port", str(port), "--policy", "round_robin", "--worker-urls", *workers),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
        *("--health-check-interval-secs", str(health_check_s)),
        *("--health-failure-threshold", str(failures)),
        *("--worker-startup-timeout-secs", "60", "--log-level", "warn"),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def lists_its_workers() -> bool:
        listed = listed_workers(url)
        return all(listed.get(w) for w in workers) and len(listed) == len(workers)

    errors = (httpx.HTTPError, KeyError, ValueError)
    wait_ready(proc, lists_its_workers, log, "sglang-router (listing its workers)", 90, errors)
    return proc, url
