"""Learner benchmarks (issue D): packed vs padded training throughput, and the loop's step time.

1. ``layouts``: forward + backward (chunked log-prob, a policy-gradient loss) of one optimizer
   step's worth of GRPO-shaped trajectories (groups sharing a prompt; prompt and response
   lengths log-normal, long-tailed) in five layouts of the same micro-batch budget: packed
   with each group's prompt once (shared prefix), packed with per-sequence (varlen)
   attention, packed with a dense block-causal mask, padded with rows sorted by length (the
   trainer's fallback), and padded in arrival order (what a trainer that pads each
   micro-batch to its longest row does). Reported: trajectory tokens (Σ of each sequence's
   positions, what every layout delivers) per second of wall time and per CPU-second of this
   process (steadier on a shared machine), and the padding share.
2. ``loop``: ``agentrl train`` for a few steps (SmolLM2-135M on calc-v0 by default) and the
   per-step time breakdown from its ledger (rollout / reference / logprob / update / publish).

    .venv/bin/python bench/trainer_bench.py layouts --model smollm2-135m --groups 3
    .venv/bin/python bench/trainer_bench.py loop --steps 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _trajectory(rng: random.Random, prompt: list[int], response: int, name: str, group: str):
    from agentrl._types import SamplingParams, Span, Trajectory

    ids = prompt + [rng.randrange(3, 40000) for _ in range(response)]
    n, length = len(prompt), len(prompt) + response
    return Trajectory(
        id=name, env="bench", task_id=group, group_id=group, policy_version=0, status="done",
        termination_reason="stop", reward=1.0, turn_rewards=[], error=None,
        sampling=SamplingParams(), tokenizer_fingerprint="", token_ids=ids,
        loss_mask=[0] * n + [1] * response, logprobs=[None] * n + [-2.0] * response,
        spans=[Span(0, n, "prompt", 0), Span(n, length, "model", 0)],
    )  # fmt: skip


def _lognormal(rng: random.Random, mean: int, low: int, high: int, sigma: float = 0.7) -> int:
    mu = math.log(mean) - sigma**2 / 2
    return int(min(high, max(low, rng.lognormvariate(mu, sigma))))


def _groups(args: argparse.Namespace) -> list:
    """GRPO-shaped data: groups share a prompt; prompt and response lengths are long-tailed."""
    rng = random.Random(args.seed)
    trajs = []
    for g in range(args.groups):
        n = _lognormal(rng, args.prompt_len, 32, args.max_len // 2)
        prompt = [1] + [rng.randrange(3, 40000) for _ in range(n - 1)]
        for s in range(args.group_size):
            response = _lognormal(rng, args.response_len, 8, args.max_len // 2)
            trajs.append(_trajectory(rng, prompt, response, f"g{g}s{s}", f"g{g}"))
    return trajs


def _arrival_padded(trajs, budget: int, pad_id: int):
    """Micro-batches in arrival order, each padded to its longest row (no sorting)."""
    from agentrl.trainer import pad_trajectories

    groups, current, width = [], [], 0
    for t in trajs:
        w = max(width, len(t.token_ids))
        if current and w * (len(current) + 1) > budget:
            groups.append(current)
            current, w = [], len(t.token_ids)
        current.append(t)
        width = w
    groups.append(current)
    return [b for g in groups for b in pad_trajectories(g, budget, pad_id=pad_id)]


def _run_layout(model, batches, *, varlen: bool) -> tuple[float, float]:
    """Forward + backward over ``batches``; (wall seconds, CPU seconds of this process)."""
    from agentrl.trainer import model_inputs, token_logprobs_and_entropy
    from agentrl.trainer._attention import varlen_kwargs

    model.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter(), time.process_time()
    for b in batches:
        if varlen:
            extra = varlen_kwargs(*b.attention_segments) if b.packed else {}
            inputs = {"input_ids": b.input_ids, "position_ids": b.position_ids, **extra}
        else:
            inputs = model_inputs(b)
        hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
        n, t, h = hidden.shape
        out = token_logprobs_and_entropy(
            hidden.reshape(n * t, h), model.lm_head.weight, b.targets.reshape(-1),
            mask=b.loss_mask.reshape(-1),
        )  # fmt: skip
        (-(out.logprobs.sum()) / b.step_loss_tokens).backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def layouts(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from agentrl._models import resolve_model
    from agentrl.trainer import pack_shared_prefix, pack_trajectories, pad_trajectories
    from agentrl.trainer._attention import use_varlen_attention

    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    varlen = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    use_varlen_attention(varlen)
    trajs = _groups(args)
    lengths = [len(t.token_ids) for t in trajs]
    real = sum(n - 1 for n in lengths)  # positions 0..L-1 (the last token is only a target)
    budget = args.micro_batch_tokens
    cases = {
        "packed, shared prefix": (varlen, pack_shared_prefix(trajs, budget, pad_id=2), True),
        "packed, varlen attention": (varlen, pack_trajectories(trajs, budget, pad_id=2), True),
        "packed, dense block mask": (dense, pack_trajectories(trajs, budget, pad_id=2), False),
        "padded, sorted (fallback)": (varlen, pad_trajectories(trajs, budget, pad_id=2), True),
        "padded, arrival order": (varlen, _arrival_padded(trajs, budget, 2), True),
    }
    # round-robin repeats, best of each: on a shared box, load comes and goes; CPU seconds of
    # this process are the steadier measure of the work a layout needs
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (model, batches, use_varlen) in cases.items():
            timings[name].append(_run_layout(model, batches, varlen=use_varlen))
    results = {}
    for name, (_, batches, _) in cases.items():
        positions = sum(b.input_ids.numel() for b in batches)
        wall = min(w for w, _ in timings[name])
        cpu = min(c for _, c in timings[name])
        results[name] = {
            "micro_batches": len(batches),
            "positions": positions,
            "padding_share": max(0.0, 1 - real / positions),
            "wall_s": wall,
            "cpu_s": cpu,
            "tokens_per_s": real / wall,
            "tokens_per_cpu_s": real / cpu,
        }
        print(f"{name:26} {len(batches):2} micro-batches  positions {positions:6}  "
              f"wall {wall:7.2f} s  {real / wall:7.1f} tok/s   cpu {cpu:7.2f} s  "
              f"{real / cpu:7.1f} tok/cpu-s", flush=True)  # fmt: skip
    base = results["packed, shared prefix"]
    for r in results.values():
        r["shared_prefix_speedup_wall"] = base["tokens_per_s"] / r["tokens_per_s"]
        r["shared_prefix_speedup_cpu"] = base["tokens_per_cpu_s"] / r["tokens_per_cpu_s"]
    return {
        "model": args.model,
        "lengths": lengths,
        "real_tokens": real,
        "micro_batch_tokens": budget,
        "threads": args.threads,
        "results": results,
    }


def loop(args: argparse.Namespace) -> dict:
    from agentrl.loop import load_train_config, read_ledger, train

    sets = [
        "eval.every_steps=0", "eval.at_start=false", "logging.tensorboard=false",
        "checkpoint.every_steps=0", "checkpoint.at_end=false", *args.set,
    ]  # fmt: skip
    cfg = load_train_config(args.config, sets, model=args.model, max_steps=args.steps)
    out = Path(args.out or tempfile.mkdtemp(prefix="trainer-bench-"))
    started = time.perf_counter()
    train(cfg, out)
    wall = time.perf_counter() - started
    ledger = read_ledger(out / "ledger.jsonl")
    keys = ("rollout_s", "reference_s", "logprob_s", "update_s", "publish_s", "step_s")
    rows = [{k: r[k] for k in (*keys, "learner_tokens", "gen_tokens")} for r in ledger]
    for r in rows:
        parts = " ".join(f"{k[:-2]} {r[k]:6.1f}s" for k in keys)
        share = r["publish_s"] / r["step_s"]
        print(f"{parts}  publish share {share:.2%}  learner tokens {r['learner_tokens']}")
    mean = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    return {"config": str(args.config), "steps": rows, "mean": mean, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("layouts")
    a.add_argument("--model", default="smollm2-135m")
    a.add_argument("--groups", type=int, default=4)
    a.add_argument("--group-size", type=int, default=4)
    a.add_argument("--prompt-len", type=int, default=300, help="mean prompt tokens")
    a.add_argument("--response-len", type=int, default=150, help="mean response tokens")
    a.add_argument("--max-len", type=int, default=2048)
    a.add_argument("--micro-batch-tokens", type=int, default=4096)
    a.add_argument("--repeats", type=int, default=2)
    a.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("loop")
    b.add_argument("--config", default=str(ROOT / "examples" / "train_calc_grpo.yaml"))
    b.add_argument("--model", default=None)
    b.add_argument("--steps", type=int, default=2)
    b.add_argument("--set", action="append", default=[])
    b.add_argument("--out", default=None)
    for s in (a, b):
        s.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    result = layouts(args) if args.what == "layouts" else loop(args)
    result["load_average"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
