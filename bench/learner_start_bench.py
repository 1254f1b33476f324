"""The start of a learner rank: a fresh interpreter that joins its process group and builds the
trained policy and the frozen reference (HF weights, DeepSpeed ZeRO-3), the way each rank of
``agentrl train`` starts. Two ways, alternating, in fresh processes: agentrl's ``initialize``
(DeepSpeed's Muon module, and the TorchInductor its ``torch.compile`` wrappers load, left
unimported) against plain ``deepspeed.initialize``. Reported: CPU seconds (user + system) and
wall seconds per start, median of ``--rounds``, and the ratio plain / agentrl.

    .venv/bin/python bench/learner_start_bench.py [--model tiny-random] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = """
import sys
import agentrl.trainer._engine as engine
from agentrl.trainer import OptimizerConfig, init_distributed, open_policy, open_reference
if sys.argv[2] == "plain":  # DeepSpeed's own initialize, Muon imported
    def initialize(**kwargs):
        return engine.import_deepspeed().initialize(**kwargs)
    engine.initialize = initialize
init_distributed(num_threads=1)
open_policy(sys.argv[1], optimizer=OptimizerConfig(), total_updates=1, temperature=1.0)
open_reference(sys.argv[1], temperature=1.0)
print("inductor" if "torch._inductor.compile_fx" in sys.modules else "no inductor")
"""


def start(model: str, way: str) -> tuple[float, float, str]:
    """CPU and wall seconds of one start, and whether TorchInductor was loaded."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, model, way], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{way} start failed: {proc.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, proc.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random", help="a registered name or a folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    from agentrl._models import resolve_model

    model = str(resolve_model(args.model))
    runs: dict[str, list[tuple[float, float, str]]] = {"agentrl": [], "plain": []}
    for _ in range(args.rounds):
        for way in runs:
            runs[way].append(start(model, way))
    report: dict[str, dict] = {}
    for way, rows in runs.items():
        report[way] = {
            "cpu_s": statistics.median(r[0] for r in rows),
            "wall_s": statistics.median(r[1] for r in rows),
            "loaded": sorted({r[2] for r in rows}),
        }
        print(
            f"{way:8s} cpu {report[way]['cpu_s']:6.2f} s  wall {report[way]['wall_s']:6.2f} s  "
            f"({', '.join(report[way]['loaded'])}; median of {args.rounds})"
        )
    cpu = report["plain"]["cpu_s"] / report["agentrl"]["cpu_s"]
    wall = report["plain"]["wall_s"] / report["agentrl"]["wall_s"]
    print(f"plain / agentrl: cpu {cpu:.2f}x, wall {wall:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **report}, indent=2))


if __name__ == "__main__":
    main()
