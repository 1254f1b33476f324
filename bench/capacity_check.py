"""``agentrl plan capacity --from-run`` against the runtime: predicted vs measured schedule.

Trains SmolLM2-135M on ``vowels-v0`` with ``bench/loop_bench.py``'s config (colocated) in the
modes given, then calibrates the capacity model from each run's ledger and compares what it
predicts for the run's own actor count with what the run measured: step time, the learner's
and the actors' idle fractions, the buffer backlog and the mean version lag.

    .venv/bin/python bench/capacity_check.py --modes sync async-k1 --steps 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "trainer"))

KEYS = ("step_s", "learner_idle_fraction", "actor_idle_fraction", "backlog_mean", "lag_mean")


def compare(run: Path) -> dict:
    from agentrl.plan._capacity import simulate
    from agentrl.plan._capacity_run import from_run

    settings, measured = from_run(str(run))
    predicted = simulate(settings, measured.actors)
    rows = {}
    for key in KEYS:
        p, m = getattr(predicted, key), getattr(measured, key)
        rows[key] = {"predicted": p, "measured": m, "ratio": p / m if m else None}
    return {"settings": settings.__dict__, "rows": rows}


def main() -> int:
    import loop_bench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--modes", nargs="+", default=["sync", "async-k1"], choices=list(loop_bench.MODES)
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None, help="keep the runs here")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.lr, args.eval_tasks, args.engine_threads, args.learner_threads = 1e-5, 0, 1, 1
    work = args.out or Path(tempfile.mkdtemp(prefix="agentrl-capacity-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in args.modes:
        train_mode, lag = loop_bench.MODES[mode]
        cfg = loop_bench._config(args, train_mode, lag, [])
        cfg["eval"] = {"every_steps": 0}
        cfg["logging"]["interval_s"] = 0.5  # backlog sampled often enough for its mean
        loop_bench._run(args, mode, cfg, work)
        results[mode] = compare(work / mode)
        print(mode)
        for key, row in results[mode]["rows"].items():
            ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}"
            print(f"  {key:<24} predicted {row['predicted']:9.3f}  measured "
                  f"{row['measured']:9.3f}  ratio {ratio}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
