"""A checkpoint save that fails on one rank, under torchrun (two gloo ranks): every rank learns
it at the same point and raises, none is left waiting in a collective, and the partial folder
is removed. (The failing rank's own error explains a full disk; the others name that rank.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import free_port

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("save_worker.py")


def _save_on_two_ranks(tmp_path: Path, fail: str) -> tuple[Path, list[dict]]:
    root, out = tmp_path / "ckpt", tmp_path / "outcome"
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER),
         str(out), str(root), fail],
        env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return root, [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("fail", ["write:1", "write:0", "manifest"])
def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path, fail):
    root, outcomes = _save_on_two_ranks(tmp_path, fail)
    assert [o["saved"] for o in outcomes] == [False, False], outcomes
    failing = 0 if fail in ("write:0", "manifest") else 1
    assert "no space left on device (ENOSPC)" in outcomes[failing]["message"], outcomes
    other = outcomes[1 - failing]["message"]
    assert f"failed on another rank (rank {failing}: OSError: [Errno 28]" in other, outcomes
    assert sorted(p.name for p in root.iterdir()) == [], "a partial checkpoint was left"


def test_a_save_that_works_on_every_rank(tmp_path):
    root, outcomes = _save_on_two_ranks(tmp_path, "none")
    assert outcomes == [{"saved": True}, {"saved": True}]
    assert sorted(p.name for p in (root / "step-00000001").iterdir()) == [
        "manifest.json", "part-0.bin", "part-1.bin", "rng-rank0.pt", "rng-rank1.pt", "state.json"
    ]  # fmt: skip
