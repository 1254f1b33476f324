"""Tool-call rate, reward and throughput of a model on calc-v0, per difficulty level.

    python bench/calc_levels.py --model smollm2-135m -n 8 --group 4

Runs real rollouts on the embedded engine (one rollout per level, same seed) and prints one
row per level: trajectories, tool-call rate (share of trajectories with >= 1 call), valid-call
rate (share of calls that ran without error), pass rate (reward 1), mean turns, model tokens/s.
"""

from __future__ import annotations

import argparse
import platform
import time

import agentrl
from agentrl._report import summarize


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--levels", default="0,1,2,3,4")
    p.add_argument("--fewshot", type=int, default=1)
    args = p.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} {platform.processor() or ''}")
    print(f"# model={args.model} n={args.n} group={args.group} max_turns={args.max_turns}")
    print(
        "| level | trajectories | tool-call rate | valid calls | pass rate | mean turns | tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for level in [int(x) for x in args.levels.split(",")]:
        cfg = agentrl.RolloutConfig(
            group_size=args.group,
            max_turns=args.max_turns,
            env_kwargs={"levels": [level], "fewshot": bool(args.fewshot)},
        )
        result = agentrl.rollout("calc-v0", model=args.model, n=args.n, config=cfg)
        s = summarize(result.trajectories, elapsed_s=result.elapsed_s)
        valid = s.tool_calls_ok / s.tool_calls if s.tool_calls else 0.0
        print(
            f"| {level} | {s.trajectories} | {s.tool_call_rate:.0%} | {valid:.0%} "
            f"({s.tool_calls_ok}/{s.tool_calls}) | {s.pass_rate:.0%} | {s.mean_turns:.2f} "
            f"| {s.tokens_per_s:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
