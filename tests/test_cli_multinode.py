"""``agentrl train`` across two "nodes" on loopback: two torchrun invocations with ``--nnodes 2``
(one gloo process each, static rendezvous on 127.0.0.1), as a user starts a job on two machines.
Also ``server.urls`` with two ranks against a real ``agentrl serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_helpers import free_port, start_serve, stop_serve

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "model": "tiny-random",
    "env": "vowels_env:vowels-v0",
    "rollout": {"max_new_tokens": 4, "concurrency": 4, "group_size": 2},
    "algorithm": {"name": "grpo"},
    "optimizer": {"lr": 1e-3},
    "train": {"max_steps": 3, "tasks_per_step": 2, "micro_batch_tokens": 256},
    "checkpoint": {"every_steps": 1, "keep": 5},
    "eval": {"every_steps": 0},
    "logging": {"trackers": []},
}
BOUND_S = 600  # one node's whole run on a shared 2-core box
TIMEOUT_S = 60  # train.collective_timeout_s: well above a tiny step's rollout imbalance


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests" / "trainer"), os.environ.get("PYTHONPATH", "")])
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist}
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


class Node:
    """One "node": ``torchrun --nnodes 2 --node-rank R`` in its own process group."""

    def __init__(self, rank: int, port: int, log: Path, *args: str, first: str = "") -> None:
        """``first``: a folder put first on the node's PYTHONPATH (the node then runs in the
        log's folder: ``python -m`` puts the working directory before PYTHONPATH)."""
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
            str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
            str(port), "--max-restarts", "0", "-m", "agentrl.cli", *args,
        ]  # fmt: skip
        self.log = log
        with open(log, "wb") as out:
            env = _env()
            if first:
                env["PYTHONPATH"] = os.pathsep.join([first, env["PYTHONPATH"]])
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=log.parent if first else None,
            )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the node: its workers (torchrun starts each in its own session), then its
        torchrun agent's process group."""
        for pid in _children(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _two_nodes(tmp: Path, name: str, *args: str, outs: tuple[Path, Path]) -> tuple[Node, Node]:
    port = free_port()
    nodes = tuple(
        Node(r, port, tmp / f"{name}-node{r}.log", *args, "--out", str(outs[r])) for r in (0, 1)
    )
    return nodes  # type: ignore[return-value]


def _finish(nodes: list[Node] | tuple[Node, ...]) -> tuple[list[int], list[str]]:
    """Wait for the nodes (each killed after, whatever happened); exit codes and outputs."""
    try:
        codes = [n.wait(BOUND_S) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    return codes, [n.output() for n in nodes]


def _run_two_nodes(tmp: Path, name: str, *args: str, outs: tuple[Path, Path]) -> list[str]:
    codes, logs = _finish(_two_nodes(tmp, name, *args, outs=outs))
    assert codes == [0, 0], "\n----\n".join(x[-4000:] for x in logs)
    return logs


def _ledger(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]


def _both_refused(nodes: list[Node], run: Path) -> list[str]:
    """Wait for two nodes that must both refuse to start training; their outputs."""
    codes, outputs = _finish(nodes)
    assert codes[0] != 0 and codes[1] != 0, "\n----\n".join(x[-3000:] for x in outputs)
    assert not (run / "ledger.jsonl").exists() or not _ledger(run)
    return outputs


def _config(tmp: Path, **extra) -> Path:
    path = tmp / "config.yaml"
    path.write_text(json.dumps({**CONFIG, **extra}))
    return path


def test_two_nodes_train_checkpoint_and_resume(tmp_path):
    """Both nodes train the same steps (rank 0 reports and writes the run files once); each
    checkpoint holds both ranks' partitions in the one shared run folder; a resume on both
    nodes continues from it."""
    config, run = _config(tmp_path), tmp_path / "run"
    first = _run_two_nodes(tmp_path, "a", "train", "--config", str(config), "--max-steps", "2",
                           outs=(run, run))  # fmt: skip
    assert "done: 2 steps" in first[0] and "done:" not in first[1], "only rank 0 reports"
    assert [r["step"] for r in _ledger(run)] == [1, 2]
    for step in (1, 2):
        ckpt = run / "checkpoints" / f"step-{step:08d}"
        state = json.loads((ckpt / "state.json").read_text())
        assert state["world_size"] == 2 and state["step"] == step
        assert sorted(p.name for p in ckpt.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]
    trajs = (run / "trajectories.jsonl").read_text().splitlines()
    assert len(trajs) == 2 * 2 * 2, "each trajectory written once (2 steps × 2 tasks × 2)"
    second = _run_two_nodes(tmp_path, "b", "train", "--resume", str(run), "--max-steps", "3",
                            outs=(run, run))  # fmt: skip
    assert "resuming from checkpoint step 2" in second[0]
    ledger = _ledger(run)
    assert [r["step"] for r in ledger] == [1, 2, 3]
    assert ledger[-1]["policy_version"] == 3


def test_node_local_out_is_refused_on_every_node(tmp_path):
    """Two nodes naming different run folders (a node-local --out): both end with the same
    error naming the rank that cannot see rank 0's files, before any model runs."""
    config = _config(tmp_path)
    nodes = _two_nodes(tmp_path, "local", "train", "--config", str(config),
                       outs=(tmp_path / "n0", tmp_path / "n1"))  # fmt: skip
    try:
        codes = [n.wait(BOUND_S) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert codes[0] != 0 and codes[1] != 0
    for node in nodes:
        assert "rank 1 on" in node.output() and "cannot see the config.yaml" in node.output()
    assert not (tmp_path / "n0" / "ledger.jsonl").exists() or not _ledger(tmp_path / "n0")


def test_nodes_given_different_configs_are_refused_naming_the_keys(tmp_path):
    """Two nodes started with different ``--config`` files (here another learning rate) would
    each step their shard of the optimizer their own way: both end before any model runs,
    with the same error naming the key and both values."""
    folder = [tmp_path / "c0", tmp_path / "c1"]
    configs = []
    for rank, lr in enumerate((1e-3, 2e-3)):
        folder[rank].mkdir()
        configs.append(_config(folder[rank], optimizer={"lr": lr}))
    port = free_port()
    out = ("--out", str(tmp_path / "run"))
    nodes = [
        Node(r, port, tmp_path / f"node{r}.log", "train", "--config", str(configs[r]), *out)
        for r in (0, 1)
    ]
    for out in _both_refused(nodes, tmp_path / "run"):
        assert "every node must be given the same configuration" in out, out[-3000:]
        assert "optimizer.lr: 0.001 on rank 0, 0.002 on rank 1" in out, out[-3000:]


def test_nodes_on_different_code_are_refused_naming_both(tmp_path):
    """A node started from another install (here a copy of agentrl with one source file
    changed, first on that node's PYTHONPATH) would train with other code in silence: both
    nodes end before any model runs, with the same error naming both builds."""
    import importlib.util
    import re
    import shutil

    spec = importlib.util.find_spec("agentrl")
    assert spec is not None and spec.submodule_search_locations
    other = tmp_path / "other-install"
    shutil.copytree(
        spec.submodule_search_locations[0],
        other / "agentrl",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    with open(other / "agentrl" / "_config.py", "a") as source:
        source.write("\n# built from another commit\n")
    config, port = _config(tmp_path), free_port()
    args = ("train", "--config", str(config), "--out", str(tmp_path / "run"))
    nodes = [
        Node(r, port, tmp_path / f"node{r}.log", *args, first=str(other) if r else "")
        for r in (0, 1)
    ]
    for out in _both_refused(nodes, tmp_path / "run"):
        assert "every node must run the same code" in out, out[-3000:]
        sources = re.findall(
            r"rank 0 on \S+ runs agentrl \S+ \(sources (\w+)\).*?"
            r"rank 1 on \S+ \(agentrl \S+ \(sources (\w+)\)",
            out,
            re.S,
        )
        assert sources and sources[0][0] != sources[0][1], out[-3000:]


def test_a_dead_node_ends_the_other_with_an_error(tmp_path):
    """SIGKILL one node after its first checkpoint: the other ends (non-zero, an error)
    within ``train.collective_timeout_s`` and torchrun's teardown instead of waiting in a
    collective."""
    train = {**CONFIG["train"], "max_steps": 50, "collective_timeout_s": TIMEOUT_S}
    config, run = _config(tmp_path, train=train), tmp_path / "run"
    nodes = _two_nodes(tmp_path, "dead", "train", "--config", str(config), outs=(run, run))
    try:
        marker = run / "checkpoints" / "step-00000001" / "state.json"
        deadline = time.monotonic() + BOUND_S
        while not marker.exists():
            assert nodes[0].proc.poll() is None, nodes[0].output()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.5)
        nodes[1].kill()
        killed = time.monotonic()
        try:
            code = nodes[0].proc.wait(TIMEOUT_S + 120)  # the timeout, then torchrun's teardown
        except subprocess.TimeoutExpired:
            ps = ["ps", "-o", "pid,ppid,stat,etime,args", "-g", str(nodes[0].proc.pid)]
            tree = subprocess.run(ps, capture_output=True, text=True).stdout
            raise AssertionError(f"still running:\n{tree}\n{nodes[0].output()[-3000:]}") from None
        took = time.monotonic() - killed
    finally:
        for n in nodes:
            n.kill()
    out = nodes[0].output()
    assert code != 0, out[-3000:]
    assert took < TIMEOUT_S + 120, took
    print(f"survivor ended {took:.1f} s after the other node died")
    assert "Error" in out, out[-3000:]


def test_two_ranks_sample_from_shared_servers(tmp_path, tiny_model_path):
    """``server.urls`` under torchrun (sync): both ranks sample their share of each step from
    the same two ``agentrl serve`` processes; rank 0 publishes each version once (one snapshot
    folder per version), both servers end at the last version, and the trainer's logprobs of
    every rank's samples match the servers' (the servers held the learner's weights)."""
    import httpx

    from agentrl import read_trajectories

    servers = [start_serve(tiny_model_path, tmp_path / f"serve{i}.log") for i in (0, 1)]
    urls = [url for _, url in servers]
    try:
        config = _config(
            tmp_path,
            server={"urls": urls, "keep_snapshots": 5},
            train={**CONFIG["train"], "max_steps": 2},
        )
        run = tmp_path / "run"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "agentrl.cli", "train", "--config", str(config), "--out", str(run),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=BOUND_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
        versions = [httpx.get(u + "/get_weight_version", timeout=10).json() for u in urls]
    finally:
        for server, _ in servers:
            stop_serve(server)
    assert [str(v["weight_version"]) for v in versions] == ["2", "2"]
    assert sorted(p.name for p in (run / "weights").iterdir()) == [
        "v00000000",
        "v00000001",
        "v00000002",
    ]
    ledger = _ledger(run)
    assert [r["step"] for r in ledger] == [1, 2]
    for record in ledger:
        assert record["rollout_version"] == record["step"] - 1
        assert record["trajectories_in"] == 2 * 2, "both ranks' groups reached the learner"
        assert record["mismatch_abs_mean"] < 1e-3, record  # scored the ids the servers sampled
    trajs = read_trajectories(str(run / "trajectories.jsonl"))
    assert sorted({t.policy_version for t in trajs}) == [0, 1]
    assert len(trajs) == 2 * 2 * 2
