"""Data parallelism on CPU: two gloo ranks under torchrun, each training on its share of the
groups (different micro-batch counts), take the same step as one process on all groups."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_runs import run_worker

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("multirank_worker.py")


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])  # ppo: advantages whitened over ranks
def test_two_ranks_equal_one_process(tmp_path, algorithm):
    alone = run_worker(WORKER, 1, tmp_path / "one.pt", algorithm, timeout=300)
    pair = run_worker(WORKER, 2, tmp_path / "two.pt", algorithm, timeout=300)
    assert pair["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)
    for name, value in alone["weights"].items():
        diff = float((pair["weights"][name] - value).abs().max())
        assert diff < 1e-6, f"{name}: {diff}"
