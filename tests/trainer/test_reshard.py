"""A checkpoint saved by 2 ranks resumes at 1 rank and the reverse (DeepSpeed's universal
checkpoint, converted at load time): real processes (torchrun, gloo, loopback), tiny-random.
The resumed learner holds exactly the saved fp32 weights and Adam moments, parameter by
parameter; its next step at 1 rank equals the 2-rank step from the same state on the same data
within the bound ``test_multirank`` uses for one step at 1 vs. 2 ranks (fp32 reduction order
only), and at 2 ranks (after 1 → 2) equals it exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rank_runs import run_worker

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("reshard_worker.py")


def _run(ranks: int, out: Path, *args: str) -> dict:
    return run_worker(WORKER, ranks, out, *args, timeout=480)


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name, tensors in want.items():
        for kind, value in tensors.items():
            assert torch.equal(got[name][kind], value), f"{what}: {name} {kind} differs"


def _assert_close(got: dict, want: dict, what: str) -> None:
    for name, tensors in want.items():
        diff = float((got[name]["fp32"] - tensors["fp32"]).abs().max())
        assert diff < 1e-6, f"{what}: {name} differs by {diff} after the step"


def test_two_ranks_to_one_and_back(tmp_path):
    two, one, back = tmp_path / "ckpt-ws2", tmp_path / "ckpt-ws1", tmp_path / "unused"
    first = _run(2, tmp_path / "first.pt", "first", "", str(two))
    assert first["world_size"] == 2
    shrunk = _run(1, tmp_path / "shrunk.pt", "resume", str(two), str(one))  # 2 → 1
    grown = _run(2, tmp_path / "grown.pt", "resume", str(one), str(back))  # 1 → 2
    state1 = json.loads((one / "step-00000001" / "state.json").read_text())
    state2 = json.loads((two / "step-00000001" / "state.json").read_text())
    assert (state2["world_size"], state1["world_size"]) == (2, 1)
    assert not list(tmp_path.rglob(".tmp-universal-*")), "the conversion was not removed"
    _assert_equal(shrunk["loaded"], first["saved"], "saved by 2 ranks, loaded by 1")
    _assert_equal(grown["loaded"], first["saved"], "saved by 1 rank, loaded by 2")
    _assert_close(shrunk["after"], first["after"], "step at 1 rank vs 2")
    # same world size, same state, same data: the step after 1 → 2 is the 2-rank step exactly
    _assert_equal(grown["after"], first["after"], "step at 2 ranks after 1 → 2")
    moved = max(
        float((first["after"][n]["fp32"] - first["saved"][n]["fp32"]).abs().max())
        for n in first["saved"]
    )
    assert moved > 1e-4  # the second step moved the weights far beyond the bound
