"""Asynchronous training survives ``kill -9`` at any moment: killed several times at random
points (sampling ahead, training, publishing, writing a checkpoint), then ``--resume``d to the
end, the run has every step once, versions that continue, no torn line, and every task slot
trained exactly once — proved from the task slots in ``trajectories.jsonl``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agentrl import read_trajectories

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
STEPS, TASKS, GROUP = 6, 2, 2
CONFIG = {
    "model": "tiny-random",
    "env": "vowels_env:vowels-v0",
    "rollout": {"max_new_tokens": 8, "concurrency": 8, "group_size": GROUP},
    "algorithm": {"name": "grpo", "old_logprobs": "recompute", "tis_cap": 2.0},
    "optimizer": {"lr": 1e-3},
    "train": {
        "max_steps": STEPS, "tasks_per_step": TASKS, "micro_batch_tokens": 256,
        "mode": "async", "max_version_lag": 2,
    },
    "checkpoint": {"every_steps": 1, "keep": 2},
    "logging": {"trackers": [], "interval_s": 0.5},
}  # fmt: skip


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests" / "trainer"), os.environ.get("PYTHONPATH", "")])
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in dist}, "PYTHONPATH": path}


def _start(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "a") as err:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "agentrl.cli", "train", *args],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _kill_after_a_checkpoint(proc: subprocess.Popen, run: Path, rng: random.Random) -> bool:
    """SIGKILL ``proc`` a random 0–1.5 s after a checkpoint newer than the ones before it
    appears; False when the run ended first."""
    before = set((run / "checkpoints").glob("step-*")) if (run / "checkpoints").exists() else set()
    deadline = time.monotonic() + 600
    while proc.poll() is None:
        now = set((run / "checkpoints").glob("step-*/state.json"))
        if {p.parent for p in now} - before:
            time.sleep(rng.uniform(0.0, 1.5))
            if proc.poll() is not None:
                return False
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        assert time.monotonic() < deadline, "no checkpoint within 600 s"
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async-kill")
    config = tmp / "config.yaml"
    config.write_text(json.dumps(CONFIG))
    run = tmp / "run"
    rng = random.Random(int(os.environ.get("AGENTRL_TEST_SEED", "0")) or 1234)
    log = tmp / "stderr.log"
    proc = _start(log, "--config", str(config), "--out", str(run))
    kills = 0
    while kills < 3 and _kill_after_a_checkpoint(proc, run, rng):
        kills += 1
        proc = _start(log, "--resume", str(run))
    proc.wait(timeout=900)
    assert proc.returncode == 0, log.read_text()[-4000:]
    return run, kills


def test_kills_lose_no_task_and_train_none_twice(killed_run):
    run, kills = killed_run
    assert kills >= 1, "the run ended before it could be killed: the test proves nothing"
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == list(range(1, STEPS + 1))
    assert [r["policy_version"] for r in ledger] == list(range(1, STEPS + 1))
    assert all(r["version_lag_max"] <= 2 for r in ledger)
    # no torn line in any run file (each line parses), trajectories unique by id
    for name in ("trajectories.jsonl", "runtime.jsonl"):
        for line in (run / name).read_text().splitlines():
            json.loads(line)
    trajs = read_trajectories(str(run / "trajectories.jsonl"))
    assert len({t.id for t in trajs}) == len(trajs)
    slots = Counter(int(t.group_id.rsplit("@", 1)[1]) for t in trajs)
    assert sorted(slots) == list(range(STEPS * TASKS)), "a task slot was lost"
    assert set(slots.values()) == {GROUP}, "a task slot was trained twice"
    for record in ledger:  # the ledger's slots are the trajectories' slots, step by step
        step = str(record["step"])
        mine = sorted({int(t.group_id.rsplit("@", 1)[1]) for t in trajs if t.info["step"] == step})
        assert mine == sorted(record["task_slots"]), record["step"]
