"""Learner benchmarks: packed vs padded training throughput, and the loop's step time.

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
3. ``step``: the learner alone (``Learner.train_step``, GRPO, DeepSpeed ZeRO-3; bf16 on a GPU)
   on synthetic GRPO groups of fixed length: update tokens/s, model FLOP utilisation and peak
   device memory (CUDA ``max_memory_allocated``; on CPU the process's peak RSS). The first step
   is a warm-up and is not timed.

    .venv/bin/python bench/trainer_bench.py layouts --model smollm2-135m --groups 3
    .venv/bin/python bench/trainer_bench.py loop --steps 2
    .venv/bin/python bench/trainer_bench.py step --model FOLDER --seqs 8 --seq-len 1024

MFU counts the matrix work of one update (forward + backward = 3 forward passes):
``6 · N_matmul`` per token (every linear layer and the LM head; the embedding lookup is free)
plus causal attention ``6 · layers · hidden · S`` per token of an ``S``-token sequence
(``QKᵀ`` and ``PV``, each ``2·S·hidden`` per token per layer, halved by the causal mask, times 3
for the backward), over a peak rate: the datasheet's dense bf16 rate when the card is known
(``--peak-flops`` overrides it), else none.
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


def _trajectory(
    rng: random.Random, prompt: list[int], response: int, name: str, group: str,
    vocab: int = 40000, reward: float = 1.0,
):  # fmt: skip
    from agentrl._types import SamplingParams, Span, Trajectory

    ids = prompt + [rng.randrange(3, vocab) for _ in range(response)]
    n, length = len(prompt), len(prompt) + response
    return Trajectory(
        id=name, env="bench", task_id=group, group_id=group, policy_version=0, status="done",
        termination_reason="stop", reward=reward, turn_rewards=[], error=None,
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
        "eval.every_steps=0", "eval.at_start=false", "logging.trackers=[]",
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


# Dense (no sparsity) bf16 tensor-core rates from the vendors' datasheets, FLOP/s.
DATASHEET_BF16_FLOPS = {"H100 80GB HBM3": 989e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def _datasheet_peak(name: str) -> float | None:
    for key, value in DATASHEET_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def step_flops(config, seq_lens: list[int]) -> float:  # noqa: ANN001
    """Model FLOPs of one update (fwd + bwd) over sequences of ``seq_lens`` tokens."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
    per_layer += 3 * hidden * config.intermediate_size  # gate, up, down
    matmul_params = layers * per_layer + config.vocab_size * hidden  # + the LM head
    tokens = sum(seq_lens)
    attention = sum(6 * layers * heads * head_dim * s * s for s in seq_lens)
    return 6 * matmul_params * tokens + attention


def step(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    from agentrl.trainer import (
        AlgorithmConfig,
        Learner,
        LearnerSettings,
        OptimizerConfig,
        init_distributed,
    )

    dist = init_distributed()
    cuda = dist.device.type == "cuda"
    config = AutoConfig.from_pretrained(args.model)
    rng = random.Random(args.seed)
    vocab = config.vocab_size

    def batch(step_index: int) -> list:
        trajs = []
        for g in range(args.seqs // args.group_size):
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
            for s in range(args.group_size):
                response = args.seq_len - args.prompt_len
                name = f"{step_index}-{g}-{s}"
                reward = float(s % 2)  # every group informative
                trajs.append(_trajectory(rng, prompt, response, name, f"g{g}", vocab, reward))
        return trajs

    learner = Learner(
        LearnerSettings(
            model_path=str(args.model),
            algorithm=AlgorithmConfig(name="grpo", kl_coef=0.0),
            optimizer=OptimizerConfig(lr=1e-6),
            total_steps=args.steps + 1,
            temperature=1.0,
            pad_id=0,
            micro_batch_tokens=args.micro_batch_tokens,
            gradient_checkpointing=args.gradient_checkpointing,
            kernels=args.kernels,
        )
    )
    learner.train_step(batch(0))  # warm-up: allocator, kernels, Triton compiles
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for i in range(args.steps):
        trajs = batch(i + 1)
        started = time.perf_counter()
        stats = learner.train_step(trajs)
        if cuda:
            torch.cuda.synchronize()
        rows.append({"step_s": time.perf_counter() - started, "update_s": stats.update_s,
                     "logprob_s": stats.logprob_s, "learner_tokens": stats.learner_tokens,
                     "loss": stats.loss})  # fmt: skip
    seq_lens = [args.seq_len - 1] * args.seqs  # positions scored: the last token is a target
    flops = step_flops(config, seq_lens)
    update_s = statistics.median(r["update_s"] for r in rows)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = args.peak_flops or (_datasheet_peak(name) if cuda else None)
    result = {
        "model": str(args.model),
        "device": name,
        "dtype": "bfloat16" if cuda else "float32",
        "params": sum(p.numel() for p in learner.optimizer_parameters()) or None,
        "seqs": args.seqs,
        "seq_len": args.seq_len,
        "micro_batch_tokens": args.micro_batch_tokens,
        "gradient_checkpointing": args.gradient_checkpointing,
        "kernels": args.kernels,
        "steps": rows,
        "update_s": update_s,
        "update_tokens_per_s": sum(seq_lens) / update_s,
        "model_flops_per_update": flops,
        "achieved_flop_s": flops / update_s,
        "peak_flop_s": peak,
        "mfu": flops / update_s / peak if peak else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else _peak_rss(),
    }
    mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a"
    print(f"{name}: {args.seqs}x{args.seq_len} tokens, update {update_s * 1000:.0f} ms "
          f"({result['update_tokens_per_s']:.0f} tok/s, {result['achieved_flop_s'] / 1e12:.1f} "
          f"TFLOP/s, MFU {mfu}), peak memory {result['peak_memory_bytes'] / 2**30:.2f} GiB",
          flush=True)  # fmt: skip
    return result


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main_parser() -> argparse.ArgumentParser:
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
    c = sub.add_parser("step")
    c.add_argument("--model", required=True, help="a model folder (config + safetensors)")
    c.add_argument("--seqs", type=int, default=8)
    c.add_argument("--seq-len", type=int, default=1024)
    c.add_argument("--prompt-len", type=int, default=256)
    c.add_argument("--group-size", type=int, default=4)
    c.add_argument("--micro-batch-tokens", type=int, default=8192)
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"])
    c.add_argument("--gradient-checkpointing", action="store_true")
    c.add_argument("--peak-flops", type=float, default=None, help="FLOP/s for the MFU")
    c.add_argument("--seed", type=int, default=0)
    for s in (a, b, c):
        s.add_argument("--json", default=None, help="also write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = main_parser().parse_args(argv)
    result = {"layouts": layouts, "loop": loop, "step": step}[args.what](args)
    result["load_average"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
