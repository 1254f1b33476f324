"""Per-decode-step host time of the embedded engine, at large batch, on the CPU or a GPU.

Drives the engine's scheduler and worker directly (no event loop, no HTTP): ``B`` greedy
requests with short random prompts are prefilled, then ``--steps`` decode steps are timed one by
one and split into

- ``plan``: the scheduler's step plan and the packed ``ForwardBatch`` (block tables, positions,
  slots, masks, copied to the device);
- ``forward``: the model's forward pass (the device is synchronized before and after it, so on
  a GPU this is the device time of the step's kernels plus their launches);
- ``sample``: reading the logits back and sampling, logprob recording, stop checks, bookkeeping;
  ``reduce`` is the part of it spent in the vocabulary-wide reductions (``sample_token`` per row,
  or ``greedy_tokens`` once, including the wait for the device), the rest is Python per row.

``host`` is ``plan + sample``: the work a step does besides the forward; ``python`` is
``host - reduce``, what the host spends per step whatever device runs the reductions. Two
configurations run in the same process, alternating for ``--rounds`` rounds (best round of each
reported): ``row-by-row`` copies the whole ``[B, vocab]`` logits to the host and samples each
row there, ``batched`` picks all greedy rows where the logits are and reads back ids and
logprobs in one copy (the engine's default on a GPU; on the CPU row-by-row is its default).
Both produce the same tokens (on the CPU the same logprobs too, bit for bit; on a GPU the
batched logprobs are the device's ``log_softmax``): the bench prints whether the ids agree, the
largest logprob difference and the ratios batched / row-by-row.

Usage::

    .venv/bin/python bench/engine_step_bench.py --batches 32 128 [--model tiny-random]
    python bench/engine_step_bench.py --device cuda --dtype bfloat16 --decode-attention auto \
        --model FOLDER --batches 1 32 128   # FOLDER:random: random weights of FOLDER's config
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from agentrl._models import resolve_model
from agentrl._types import SamplingParams
from agentrl.engine import _worker
from agentrl.engine._decode import DecodeKernelChooser
from agentrl.engine._kv import KVPool
from agentrl.engine._model import CausalLM, ModelConfig
from agentrl.engine._scheduler import Request, Scheduler
from agentrl.engine._seq import KVManager
from agentrl.engine._session import SessionTable
from agentrl.engine._worker import Worker

PHASES = ("step", "host", "python", "plan", "forward", "sample", "reduce")


def load_model(name: str, device: str, dtype: torch.dtype) -> CausalLM:
    """A registered / local model folder, or ``<folder>:random`` for random weights of that
    folder's config (no weights read)."""
    random_init = name.endswith(":random")
    folder = resolve_model(name.removesuffix(":random"))
    if not random_init:
        return CausalLM.from_folder(folder, dtype, device)
    config = ModelConfig.from_folder(folder)
    gen = torch.Generator().manual_seed(0)
    stub = CausalLM.__new__(CausalLM)
    stub.config = config
    shapes = CausalLM.expected_shapes(stub)
    state = {k: torch.randn(v, generator=gen) * 0.02 for k, v in shapes.items()}
    for key in state:
        if key.endswith("norm.weight"):
            state[key] = torch.ones_like(state[key])
    return CausalLM(config, state, dtype, device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(model: CausalLM, batch: int, args: argparse.Namespace, batched: bool) -> dict:
    """Prefill ``batch`` requests, then time ``args.steps`` decode steps."""
    device = model.device
    config = model.config
    blocks = batch * (-(-(args.prompt + args.steps + 8) // 16)) + 8
    pool = KVPool(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_blocks=blocks,
        block_size=16,
        dtype=model.dtype,
        device=device,
    )
    kv = KVManager(pool, None)
    sessions = SessionTable(cap_tokens=0, ttl_s=None, release=kv.release)
    scheduler = Scheduler(kv, sessions, max_batch_size=batch, max_step_tokens=1 << 20)
    decode = DecodeKernelChooser(args.decode_attention, device, model.dtype)
    worker = Worker(model, None, scheduler, num_threads=args.threads, decode=decode)  # type: ignore[arg-type]
    worker.batched_greedy = batched
    rng = random.Random(0)
    greedy = SamplingParams(max_new_tokens=args.steps + 8, temperature=0)
    requests = []
    for seed in range(batch):
        ids = [rng.randrange(100, config.vocab_size) for _ in range(args.prompt)]
        request = Request(ids, greedy, limit=1 << 20, seed=seed)
        scheduler.add(request)
        requests.append(request)
    times: dict[str, list[float]] = {
        "plan": [],
        "forward": [],
        "sample": [],
        "reduce": [],
        "step": [],
    }
    forward = model.forward
    spent = [0.0]
    reduced = [0.0]
    originals = {name: getattr(_worker, name) for name in ("sample_token", "greedy_tokens")}

    def timing(fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                reduced[0] += time.perf_counter() - start

        return timed

    def timed_forward(*a: Any, **k: Any) -> torch.Tensor:
        synchronize(device)
        start = time.perf_counter()
        out = forward(*a, **k)
        synchronize(device)
        spent[0] = time.perf_counter() - start
        return out

    with torch.inference_mode():
        while any(not r.started for r in requests):  # prefill (and a first decode, warm-up)
            step = scheduler.plan()
            assert step is not None
            worker._run(step)
        for _ in range(2):  # warm-up decode steps
            worker._run(scheduler.plan())  # type: ignore[arg-type]
        model.forward = timed_forward  # type: ignore[method-assign]
        for name, fn in originals.items():
            setattr(_worker, name, timing(fn))
        try:
            for _ in range(args.steps):
                synchronize(device)
                reduced[0] = 0.0
                start = time.perf_counter()
                step = scheduler.plan()
                assert step is not None and len(step.rows) == batch
                planned = time.perf_counter()
                worker._run(step)
                end = time.perf_counter()
                times["plan"].append(planned - start)
                times["forward"].append(spent[0])
                times["sample"].append(end - planned - spent[0])
                times["reduce"].append(reduced[0])
                times["step"].append(end - start)
        finally:
            model.forward = forward  # type: ignore[method-assign]
            for name, fn in originals.items():
                setattr(_worker, name, fn)
    failed = [r.error for r in requests if r.error is not None]
    if failed:
        raise failed[0]
    times["host"] = [p + s for p, s in zip(times["plan"], times["sample"], strict=True)]
    times["python"] = [h - r for h, r in zip(times["host"], times["reduce"], strict=True)]
    out: dict[str, Any] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["outputs"] = [(r.output_ids, r.output_logprobs) for r in requests]
    return out


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options the engine benches share: model, device, dtype, rounds, threads, JSON."""
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the numbers here")


def model_from_args(args: argparse.Namespace) -> CausalLM:
    torch.set_num_threads(args.threads)
    return load_model(args.model, args.device, getattr(torch, args.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--decode-attention", default="sdpa", choices=["auto", "sdpa", "triton"])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    model = model_from_args(args)
    print(
        f"model {args.model} on {model.device} ({args.dtype}), prompt {args.prompt}, "
        f"{args.steps} decode steps timed (median ms per step), best of {args.rounds} rounds"
    )
    report: dict[str, Any] = {"args": vars(args), "rows": []}
    for batch in args.batches:
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for name, batched in (("row-by-row", False), ("batched", True)):
                result = run_once(model, batch, args, batched)
                if name not in best or result["step"] < best[name]["step"]:
                    best[name] = result
        base_out, new_out = best["row-by-row"].pop("outputs"), best["batched"].pop("outputs")
        same_ids = [ids for ids, _ in base_out] == [ids for ids, _ in new_out]
        # on the CPU both paths run the same reductions (equal bit for bit); on a GPU the
        # batched logprobs come from the device's log_softmax, the row-by-row ones from the CPU's
        delta = max(
            (abs(a - b) for (_, la), (_, lb) in zip(base_out, new_out, strict=True)
             for a, b in zip(la, lb, strict=False)),
            default=0.0,
        )  # fmt: skip
        base, new = best["row-by-row"], best["batched"]
        for name, row in best.items():
            cols = "  ".join(f"{k} {row[k]:7.2f}" for k in PHASES)
            print(f"B={batch:4d} {name:11s} {cols}")
        print(
            f"B={batch:4d} batched / row-by-row: step {new['step'] / base['step']:.3f}x, "
            f"host {new['host'] / base['host']:.3f}x, "
            f"python {new['python'] / base['python']:.3f}x, "
            f"sample {new['sample'] / base['sample']:.3f}x; identical ids: {same_ids}, "
            f"max |dlogprob| {delta:.3g}"
        )
        report["rows"].append({"batch": batch, **best, "same_ids": same_ids, "max_dlogprob": delta})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
