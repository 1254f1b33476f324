"""Data parallelism on CPU: two gloo ranks under torchrun, each training on its share of the
groups (different micro-batch counts), take the same step as one process on all groups."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_runs import run_worker

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("multirank_worker.py")


@pytest.mark.parametrize(
    ("algorithm", "mini_batches"),
    [
        ("grpo", "1"),
        ("ppo", "1"),  # advantages whitened over ranks
        # 5 groups in 3 updates: rank 1 holds 2 groups, so one of its mini-batches is empty;
        # it must still take part in all 3 updates (the same ones as one process makes)
        ("grpo", "3"),
    ],
)
def test_two_ranks_equal_one_process(tmp_path, algorithm, mini_batches):
    alone = run_worker(WORKER, 1, tmp_path / "one.pt", algorithm, mini_batches, timeout=300)
    pair = run_worker(WORKER, 2, tmp_path / "two.pt", algorithm, mini_batches, timeout=300)
    assert alone["updates"] == pair["updates"] == int(mini_batches)
    assert pair["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)
    for name, value in alone["weights"].items():
        diff = float((pair["weights"][name] - value).abs().max())
        assert diff < 1e-6, f"{name}: {diff}"
