"""Start ``agentrl sandbox serve`` as a real subprocess on a free loopback port (test helper).

``running_service(...)`` starts the service the way a user does (``python -m agentrl.sandboxes
serve --port 0 …``), waits for its "listening on URL" line, yields a handle, and on exit sends
SIGTERM and waits for a clean shutdown (the pool closed). Everything it starts it stops, by PID.
"""

from __future__ import annotations

import os
import queue
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# exactly what a user runs: `agentrl sandbox serve …`
SERVE_CMD = [sys.executable, "-m", "agentrl.cli", "sandbox", "serve"]
_URL_RE = re.compile(r"listening on (http://\S+)")


@contextmanager
def scratch_root() -> Iterator[Path]:
    """A world-traversable temp dir for a local pool's sandboxes (pytest's ``tmp_path`` sits
    below a 0700 dir the sandbox uids cannot enter); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="agentrl-test-svc-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class ServiceProcess:
    proc: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def status(self, key: str) -> int:
        """A ``/proc/PID/status`` value of the service process in kB (``VmRSS``, ``VmHWM``)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise KeyError(key)

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal the service and wait for it to exit; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"the service ignored signal {sig} for {timeout_s} s") from None

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def _pump(proc: subprocess.Popen, lines: list[str], found: queue.Queue) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        match = _URL_RE.search(line)
        if match:
            found.put(match.group(1))
    found.put(None)


@contextmanager
def running_service(
    *args: str,
    env: dict[str, str] | None = None,
    start_timeout_s: float = 120.0,
    nofile: tuple[int, int] | None = None,
) -> Iterator[ServiceProcess]:
    """A running service (``--port 0`` is added); stopped with SIGTERM afterwards.
    ``nofile`` sets its RLIMIT_NOFILE (soft, hard), as a host's defaults would."""

    def limit_fds() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    proc = subprocess.Popen(
        [*SERVE_CMD, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        preexec_fn=limit_fds if nofile is not None else None,
    )
    lines: list[str] = []
    found: queue.Queue = queue.Queue()
    pump = threading.Thread(target=_pump, args=(proc, lines, found), daemon=True)
    pump.start()
    deadline = time.monotonic() + start_timeout_s
    url = None
    try:
        while url is None:
            try:
                url = found.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("the service did not start: " + "\n".join(lines)) from None
            if url is None:
                raise AssertionError(
                    f"the service exited ({proc.wait()}) before listening:\n" + "\n".join(lines)
                )
        handle = ServiceProcess(proc, url, lines)
        yield handle
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        pump.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
