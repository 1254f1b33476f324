"""Data parallelism on CPU: two gloo ranks under torchrun, each training on its share of the
groups (different micro-batch counts), take the same step as one process on all groups."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("multirank_worker.py")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(args: list[str], out: Path, algorithm: str) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.run(
        [sys.executable, *args, str(WORKER), str(out), algorithm],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])  # ppo: advantages whitened over ranks
def test_two_ranks_equal_one_process(tmp_path, algorithm):
    alone = _run([], tmp_path / "one.pt", algorithm)
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", _free_port()]
    pair = _run(torchrun, tmp_path / "two.pt", algorithm)
    assert pair["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)
    for name, value in alone["weights"].items():
        diff = float((pair["weights"][name] - value).abs().max())
        assert diff < 1e-6, f"{name}: {diff}"
