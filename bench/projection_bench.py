"""The CPU cost of a step's projections (every layer's q/k/v, o, gate/up and down GEMMs, and the
LM head) by number of rows, in three ways, in the same run:

- ``x @ W_in_out``: the weights stored transposed, ``[in, out]`` contiguous (the baseline: the
  layout the embedded engine uses on a GPU);
- ``F.linear``: ``x @ W.T`` on HF's ``[out, in]`` weights (what transformers runs);
- ``project``: ``CausalLM.project`` on ``[out, in]`` weights, the embedded engine's CPU path
  (``(W @ x.T).T`` up to ``SKINNY_ROWS`` rows, one row run as two; ``F.linear`` above).

The weights are random, of a model's real shapes (``config.json`` of ``--model``; every layer its
own matrices, so each step streams the whole model from memory as a decode step does). Prints
the best of ``--repeats`` per way in ms and the ratios baseline / ``project`` and ``F.linear`` /
``project``; each way's output is checked against the others.

    .venv/bin/python bench/projection_bench.py --rows 1 2 4 16 64 256
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from agentrl._models import resolve_model
from agentrl.engine._model import SKINNY_ROWS, CausalLM, ModelConfig


def shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of one layer's fused projections, and the LM head."""
    c = config
    return {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "head": (c.vocab_size, c.hidden_size),
    }


def elapsed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="whose shapes (config.json)")
    parser.add_argument("--layers", type=int, default=0, help="0: the model's own count")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig.from_folder(resolve_model(args.model))
    layers = args.layers or config.num_layers
    generator = torch.Generator().manual_seed(0)
    mats = shapes(config)
    weights = [  # (name, [out, in], [in, out]) for every projection a step runs
        (name, w, w.t().contiguous())
        for index in range(layers)
        for name, (out, inp) in mats.items()
        if name != "head" or index == 0
        for w in [torch.randn(out, inp, generator=generator) / inp**0.5]
    ]
    mib = sum(w.numel() * 4 for _, w, _ in weights) / 2**20
    engine = CausalLM.__new__(CausalLM)  # only ``project`` runs: no weights of its own
    engine.rows_out = True
    print(f"{args.model} shapes, {layers} layers + head: {mib:.0f} MiB of fp32 weights per step, "
          f"{torch.get_num_threads()} threads, SKINNY_ROWS {SKINNY_ROWS}")  # fmt: skip
    results = {}
    for rows in args.rows:
        xs = {n: torch.randn(rows, w.shape[1], generator=generator) for n, w, _ in weights}
        ways: dict[str, Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]] = {
            "x @ W_in_out": lambda n, w, wt, xs=xs: xs[n] @ wt,
            "F.linear": lambda n, w, wt, xs=xs: F.linear(xs[n], w),
            "project": lambda n, w, wt, xs=xs: engine.project(xs[n], w, None),
        }
        u = torch.finfo(torch.float32).eps / 2
        for n, w, wt in weights[-5:]:  # the same products: fp32 sums in different orders,
            k = w.shape[1]  # each within gamma_k |x| |W|^T of the exact one (Higham 3.5)
            bound = 2 * (k * u / (1 - k * u)) * (xs[n].abs() @ w.abs().t())
            want = ways["x @ W_in_out"](n, w, wt)
            for way in ways.values():
                assert ((way(n, w, wt) - want).abs() <= bound).all(), n
        steps = {k: lambda f=f: [f(n, w, wt) for n, w, wt in weights] for k, f in ways.items()}
        for step in steps.values():
            step()  # warm-up
        ms = {k: float("inf") for k in ways}
        for _ in range(args.repeats):  # the ways alternate: drift on the box hits each alike
            for k, step in steps.items():
                ms[k] = min(ms[k], elapsed_ms(step))
        base, linear, ours = ms["x @ W_in_out"], ms["F.linear"], ms["project"]
        results[rows] = {
            **ms,
            "baseline_over_project": base / ours,
            "linear_over_project": linear / ours,
        }
        print(f"rows {rows:4d}  x @ W_in_out {base:8.1f} ms  F.linear {linear:8.1f} ms  "
              f"project {ours:8.1f} ms  |  baseline/project {base / ours:5.2f}x  "
              f"F.linear/project {linear / ours:5.2f}x", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
