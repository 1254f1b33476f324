"""Run a test worker script in one process or under torchrun (gloo, loopback) and read back
what it saved: the way the multi-rank tests compare one process with several."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from serve_helpers import free_port


def run_worker(worker: Path, ranks: int, out: Path, *args: str, timeout: float) -> dict:
    """``python [-m torch.distributed.run ...] WORKER OUT ARGS`` with ``ranks`` processes (1:
    no launcher), one torch thread each; the object the worker saved to ``out``."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    launcher: list[str] = []
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                    "--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, *launcher, str(worker), str(out), *args],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)
