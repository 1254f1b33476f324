"""Synchronous vs asynchronous training: the same config and seeds under ``train.mode: sync``
and ``async`` with ``max_version_lag`` 1 and 2, colocated (the embedded engine in the trainer
process) and disaggregated (one ``agentrl serve`` process + the trainer, weights through
safetensors snapshots).

Per run, from its ledger: trained samples per second of loop time (the steps' wall time,
evaluation excluded), the learner's idle fraction (waiting for samples), the actors' idle
fraction, the version lag of what was trained, and the greedy evaluation reward on
``--eval-tasks`` held-out tasks after the last step (the same number of samples in every run).
Ratios are against the sync run of the same placement, measured in the same invocation.

    .venv/bin/python bench/loop_bench.py                          # SmolLM2-135M on vowels-v0
    .venv/bin/python bench/loop_bench.py --placements colocated --steps 6 --json out.json

``vowels-v0`` (tests/trainer/vowels_env.py) rewards the share of vowels in a short answer: every
group carries a reward signal, so each step trains on every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": ("sync", 0), "async-k1": ("async", 1), "async-k2": ("async", 2)}


def _config(args: argparse.Namespace, mode: str, lag: int, urls: list[str]) -> dict:
    return {
        "model": args.model,
        "env": "vowels_env:vowels-v0",
        "rollout": {
            "max_new_tokens": args.new_tokens,
            "concurrency": 64,
            "group_size": args.group,
            "seed": 7,
        },
        "algorithm": {"name": "grpo", "old_logprobs": "recompute", "tis_cap": 2.0},
        "optimizer": {"lr": args.lr},
        "train": {
            "max_steps": args.steps,
            "tasks_per_step": args.tasks,
            "micro_batch_tokens": 1024,
            "mode": mode,
            "max_version_lag": max(lag, 1),
            "seed": 3,
            "num_threads": args.learner_threads,
        },
        "engine": {"num_threads": args.engine_threads} if not urls else {},
        "server": {"urls": urls},
        "checkpoint": {"every_steps": 0, "at_end": False},
        "eval": {"every_steps": args.steps, "num_tasks": args.eval_tasks},
        "logging": {"progress": False, "trackers": [], "interval_s": 0},
    }


def _run(args: argparse.Namespace, name: str, cfg: dict, work: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "trainer"))
    from agentrl.loop import load_train_config, read_ledger, train

    path = work / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    out = work / name
    train(load_train_config(path), out)
    ledger = read_ledger(out / "ledger.jsonl")
    loop_s = sum(r["step_s"] - r.get("eval_s", 0.0) for r in ledger)
    trained = sum(r["trajectories_trained"] for r in ledger)
    spans = [r["step_s"] - r.get("eval_s", 0.0) for r in ledger]
    total = max(sum(spans), 1e-9)

    def weighted(key: str) -> float:
        return sum((r.get(key) or 0.0) * s for r, s in zip(ledger, spans, strict=True)) / total

    return {
        "loop_s": loop_s,
        "samples": trained,
        "samples_per_s": trained / loop_s,
        "learner_idle_fraction": weighted("learner_idle_fraction"),
        "actor_idle_fraction": weighted("actor_idle_fraction"),
        "lag_max": max(r["version_lag_max"] for r in ledger),
        "lag_mean": sum(r["version_lag"] for r in ledger) / len(ledger),
        "train_reward_last": ledger[-1]["reward_mean"],
        "eval_reward": ledger[-1].get("eval_reward_mean"),
    }


class _Server:
    """``agentrl serve`` on a free loopback port, stopped by PID."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> str:
        cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--model", self.args.model]
        cmd += ["--host", "127.0.0.1", "--port", "0"]
        cmd += ["--num-threads", str(self.args.engine_threads), "--max-batch-size", "64"]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 300
        while not self.url:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-2000:]
            assert time.monotonic() < deadline, "agentrl serve did not start in 300 s"
            for line in Path(self.log.name).read_text().splitlines():
                if "listening on" in line:
                    self.url = line.rsplit(" ", 1)[1].strip()
            time.sleep(0.2)
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5).read()
                return self.url
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.url} did not answer /health")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
            self.log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=4, help="tasks per step")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--eval-tasks", type=int, default=16)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--learner-threads", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument(
        "--placements", nargs="+", default=["colocated", "disaggregated"],
        choices=["colocated", "disaggregated"],
    )  # fmt: skip
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for placement in args.placements:
            for name in args.modes:
                mode, lag = MODES[name]
                work = Path(tmp) / placement
                work.mkdir(exist_ok=True)
                if placement == "disaggregated":
                    with _Server(args) as url:
                        cfg = _config(args, mode, lag, [url])
                        row = _run(args, name, cfg, work)
                else:
                    row = _run(args, name, _config(args, mode, lag, []), work)
                results[f"{placement}/{name}"] = row
                print(f"{placement}/{name}: {json.dumps(row)}", flush=True)
    _report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


def _report(results: dict[str, dict]) -> None:
    print("\n| run | samples/s | vs sync | learner idle | actor idle | lag mean/max | "
          "eval reward |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for key, row in results.items():
        base = results.get(key.split("/")[0] + "/sync")
        ratio = row["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        print(
            f"| {key} | {row['samples_per_s']:.3f} | {ratio:.2f}× | "
            f"{row['learner_idle_fraction']:.2f} | {row['actor_idle_fraction']:.2f} | "
            f"{row['lag_mean']:.2f}/{row['lag_max']} | {row['eval_reward']} |"
        )


if __name__ == "__main__":
    main()
