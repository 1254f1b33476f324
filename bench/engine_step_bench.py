"""Per-decode-step host time of the embedded engine, at large batch, on the CPU or a GPU.

Drives the engine's scheduler and worker directly (no event loop, no HTTP): ``B`` greedy
requests (or, with ``--temperature T``, seeded requests sampling at ``T``) with short random
prompts are prefilled, then ``--steps`` decode steps are timed one by
one and split into

- ``plan``: the scheduler's step plan and the packed ``ForwardBatch`` (block tables, positions,
  slots, masks, copied to the device);
- ``forward``: the model's forward pass (the device is synchronized before and after it, so on
  a GPU this is the device time of the step's kernels plus their launches);
- ``sample``: reading the logits back and sampling, logprob recording, stop checks, bookkeeping;
  ``reduce`` is the part of it spent in the vocabulary-wide reductions (``sample_token`` per row,
  or ``greedy_picks``/``sampled_picks`` and their ``read_back`` once, including the wait for the
  device), the rest is Python per row.

``host`` is ``plan + sample``: the work a step does besides the forward; ``python`` is
``host - reduce``, what the host spends per step whatever device runs the reductions. Two
configurations run in the same process, alternating for ``--rounds`` rounds (best round of each
reported): ``row-by-row`` copies the whole ``[B, vocab]`` logits to the host and samples each
row there, ``batched`` picks all rows where the logits are and reads back ids and
logprobs in one copy (the engine's default on a GPU; on the CPU row-by-row is its default).
Both produce the same tokens (on the CPU the same logprobs too, bit for bit; on a GPU the
batched logprobs are the device's ``log_softmax``): the bench prints whether the ids agree, the
largest logprob difference and the ratios batched / row-by-row.

With ``--cuda-graph`` a third configuration, ``graphs``, runs the batched one with its decode
steps replayed from captured CUDA graphs (``EngineOptions.cuda_graph``, the engine's default on
a GPU); ``forward`` is then the replay (one launch), synchronized. On the CPU (with
``TRITON_INTERPRET=1``) the graphs' static forward runs eagerly instead: that checks the bench,
its times mean nothing.
``plan`` includes packing the step's inputs: its ``ForwardBatch``, or for a replayed step the
copies into the graphs' buffers.

With ``--fused-ops`` the batched (and graphs) configurations run once more with the fused
elementwise Triton kernels (``EngineOptions.fused_ops``: RMSNorm with its residual add, rotary
embedding, SiLU·mul), as ``batched+fused`` (and ``graphs+fused``), each compared with its
torch-ops twin; the other configurations run the torch operations.

Usage::

    .venv/bin/python bench/engine_step_bench.py --batches 32 128 [--model tiny-random]
    python bench/engine_step_bench.py --device cuda --dtype bfloat16 --decode-attention auto \
        --model FOLDER --batches 1 32 128 --cuda-graph --fused-ops   # FOLDER:random: random weights
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
from agentrl.engine import _scheduler, _worker
from agentrl.engine._decode import AttentionKernelChooser
from agentrl.engine._graphs import DecodeGraphs
from agentrl.engine._kv import KVPool
from agentrl.engine._model import CausalLM, ModelConfig
from agentrl.engine._scheduler import Request, Scheduler
from agentrl.engine._seq import KVManager
from agentrl.engine._session import SessionTable
from agentrl.engine._worker import Worker
from agentrl.kernels import triton_available

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


def run_once(
    model: CausalLM,
    batch: int,
    args: argparse.Namespace,
    batched: bool,
    graphs: bool = False,
    fused: bool = False,
) -> dict:
    """Prefill ``batch`` requests, then time ``args.steps`` decode steps."""
    model.fused_ops = fused  # before any capture: a graph replays the kernels it captured
    device = model.device
    config = model.config
    context = args.prompt + args.steps + 8
    blocks = batch * (-(-context // 16)) + 8
    pool = KVPool(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_blocks=blocks,
        block_size=16,
        dtype=model.dtype,
        device=device,
        pad_block=graphs,
    )
    kv = KVManager(pool, None)
    sessions = SessionTable(cap_tokens=0, ttl_s=None, release=kv.release)
    scheduler = Scheduler(kv, sessions, max_batch_size=batch, max_step_tokens=1 << 20)
    decode = AttentionKernelChooser(args.decode_attention, device, model.dtype)
    replay = "cuda" if device.type == "cuda" else "eager"
    captured = (
        DecodeGraphs(model, pool, max_batch_size=batch, max_context=context, replay=replay)
        if graphs
        else None
    )
    worker = Worker(
        model, None, scheduler, num_threads=args.threads, attention=decode, graphs=captured
    )  # type: ignore[arg-type]
    worker.batched_sampling = batched
    rng = random.Random(0)
    greedy = SamplingParams(max_new_tokens=args.steps + 8, temperature=args.temperature)
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
    replayed = captured.run if captured is not None else None
    pack = _scheduler.Step.forward_batch
    spent = [0.0]
    reduced = [0.0]
    packed = [0.0]
    reductions = ("sample_token", "greedy_picks", "sampled_picks", "read_back")
    originals = {name: getattr(_worker, name) for name in reductions}

    def timing(fn: Any, into: list[float] = reduced) -> Any:
        """``fn``, adding the seconds each call takes to ``into[0]``."""

        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                into[0] += time.perf_counter() - start

        return timed

    def timed_forward(*a: Any, **k: Any) -> torch.Tensor:
        synchronize(device)
        start = time.perf_counter()
        out = forward(*a, **k)
        synchronize(device)
        spent[0] = time.perf_counter() - start
        return out

    def timed_replay(rows: Any) -> torch.Tensor:
        # loading the buffers counts as packing, the rest of the run (synchronized) as the
        # forward
        assert replayed is not None and captured is not None
        synchronize(device)
        start = time.perf_counter()
        before = packed[0]
        out = replayed(rows)
        synchronize(device)
        spent[0] = time.perf_counter() - start - (packed[0] - before)
        return out

    with torch.inference_mode():
        while any(not r.started for r in requests):  # prefill (and a first decode, warm-up)
            step = scheduler.plan()
            assert step is not None
            worker._run(step)
        for _ in range(2):  # warm-up decode steps
            worker._run(scheduler.plan())  # type: ignore[arg-type]
        model.forward = timed_forward  # type: ignore[method-assign]
        if captured is not None:
            captured.run = timed_replay  # type: ignore[method-assign]
            captured.load = timing(captured.load, packed)  # type: ignore[method-assign]
        _scheduler.Step.forward_batch = timing(pack, packed)  # type: ignore[method-assign]
        for name, fn in originals.items():
            setattr(_worker, name, timing(fn))
        try:
            for _ in range(args.steps):
                synchronize(device)
                reduced[0] = packed[0] = 0.0
                start = time.perf_counter()
                step = scheduler.plan()
                assert step is not None and len(step.rows) == batch
                planned = time.perf_counter()
                worker._run(step)
                end = time.perf_counter()
                times["plan"].append(planned - start + packed[0])
                times["forward"].append(spent[0])
                times["sample"].append(end - planned - spent[0] - packed[0])
                times["reduce"].append(reduced[0])
                times["step"].append(end - start)
        finally:
            model.forward = forward  # type: ignore[method-assign]
            _scheduler.Step.forward_batch = pack  # type: ignore[method-assign]
            for name, fn in originals.items():
                setattr(_worker, name, fn)
    failed = [r.error for r in requests if r.error is not None]
    if failed:
        raise failed[0]
    times["host"] = [p + s for p, s in zip(times["plan"], times["sample"], strict=True)]
    times["python"] = [h - r for h, r in zip(times["host"], times["reduce"], strict=True)]
    if captured is not None and captured.replays < args.steps:
        raise RuntimeError(f"only {captured.replays} of {args.steps} steps replayed a graph")
    out: dict[str, Any] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["outputs"] = [(r.output_ids, r.output_logprobs) for r in requests]
    return out


def compare_outputs(a: list, b: list) -> tuple[bool, float]:
    """Whether two runs' ids are identical, and their largest logprob difference."""
    same = [ids for ids, _ in a] == [ids for ids, _ in b]
    delta = max(
        (abs(x - y) for (_, la), (_, lb) in zip(a, b, strict=True)
         for x, y in zip(la, lb, strict=False)),
        default=0.0,
    )  # fmt: skip
    return same, delta


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
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)"
    )
    parser.add_argument(
        "--cuda-graph", action="store_true", help="also time decode steps replayed from CUDA graphs"
    )
    parser.add_argument(
        "--fused-ops", action="store_true", help="also time them with the fused Triton kernels"
    )
    args = parser.parse_args()
    model = model_from_args(args)
    if (args.cuda_graph or args.fused_ops) and not triton_available(model.device):
        parser.error(
            "--cuda-graph and --fused-ops need Triton kernels: a CUDA device, or "
            "TRITON_INTERPRET=1 on the CPU (which checks the bench; its times mean nothing)"
        )
    print(
        f"model {args.model} on {model.device} ({args.dtype}), prompt {args.prompt}, "
        f"{args.steps} decode steps timed (median ms per step), best of {args.rounds} rounds"
    )
    configs = [("row-by-row", False, False, False), ("batched", True, False, False)]
    if args.cuda_graph:
        configs.append(("graphs", True, True, False))
    if args.fused_ops:
        configs += [(f"{name}+fused", True, graphs, True) for name, _, graphs, _ in configs[1:]]
    report: dict[str, Any] = {"args": vars(args), "rows": []}
    for batch in args.batches:
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for name, batched, graphs, fused in configs:
                result = run_once(model, batch, args, batched, graphs, fused)
                if name not in best or result["step"] < best[name]["step"]:
                    best[name] = result
        outputs = {name: best[name].pop("outputs") for name in best}
        for name, row in best.items():
            cols = "  ".join(f"{k} {row[k]:7.2f}" for k in PHASES)
            print(f"B={batch:4d} {name:13s} {cols}")
        # on the CPU row-by-row and batched run the same reductions (equal bit for bit); on a
        # GPU the batched logprobs come from the device's log_softmax, the row-by-row ones from
        # the CPU's; graphs run the Triton decode kernel on padded batches
        row: dict[str, Any] = {"batch": batch, **best}
        pairs = [("row-by-row", "batched"), ("batched", "graphs")]
        pairs += [(name, f"{name}+fused") for name in ("batched", "graphs")]
        for base, new in pairs:
            if new not in best:
                continue
            same, delta = compare_outputs(outputs[base], outputs[new])
            a, b = best[base], best[new]
            print(
                f"B={batch:4d} {new} / {base}: step {b['step'] / a['step']:.3f}x, "
                f"forward {b['forward'] / a['forward']:.3f}x, host {b['host'] / a['host']:.3f}x, "
                f"python {b['python'] / a['python']:.3f}x; identical ids: {same}, "
                f"max |dlogprob| {delta:.3g}"
            )
            key = "" if new == "batched" else f"{new.replace('+', '_')}_"
            row[f"{key}same_ids"], row[f"{key}max_dlogprob"] = same, delta
        report["rows"].append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
