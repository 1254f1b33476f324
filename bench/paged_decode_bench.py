"""Paged decode attention benchmark: the Triton kernel against the engine's SDPA path.

One decode step of one layer, bf16, blocks of 16 tokens drawn from a shuffled pool, for each
head layout, batch size and context length, both paths timed in the same run:

- ``sdpa``: ``paged_attention(..., decode_kernel="sdpa")``, the engine's default decode path
  (``index_select`` of every row's blocks, then torch SDPA; a mask when lengths differ);
- ``triton``: ``paged_decode_attention`` with ``max_seq_len`` given, as the engine calls it
  (no host sync), blocks read in place through the block table;
- ``triton*``: the same through ``paged_attention(..., decode_kernel="triton")``, as the engine
  runs it (the step's metadata, ``seq_lens`` tensor included, already on the device).

Timing: CUDA events around single calls after ``--warmup`` calls, median of ``--repeats``.
``ratio`` is sdpa / triton (> 1: the kernel is faster). ``max|Δ|`` is against the float64
token-by-token reference (``agentrl.kernels.reference``) on the first ``--check-rows`` rows.
Small configurations fit in L2 (50 MiB on an H100) for both paths alike.

Without CUDA it says so and runs a tiny correctness check in Triton's interpreter (not a speed
measurement), exiting 0 when it passes::

    .venv/bin/python bench/paged_decode_bench.py                      # GPU: the full table
    .venv/bin/python bench/paged_decode_bench.py --ragged --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


from agentrl.engine._decode import cuda_median_ms  # noqa: E402
from agentrl.engine._kv import AttentionBatch, make_attention_batch, paged_attention  # noqa: E402
from agentrl.kernels import reference  # noqa: E402
from agentrl.kernels._paged_attention import paged_decode_attention  # noqa: E402

LAYOUTS = {  # (query heads, kv heads, head_dim)
    "qwen2-0.5b": (14, 2, 64),
    "smollm2-135m": (9, 3, 64),
}


def make_step(
    batch: int,
    context: int,
    layout: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    device: str,
    *,
    ragged: bool,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch, list[int]]:
    """q ``[B, H, D]``, one layer's K/V pool (a few spare blocks, order shuffled), the decode
    rows' ``AttentionBatch`` (tensors on ``device``) and the lengths."""
    heads, kv_heads, dim = layout
    gen = torch.Generator().manual_seed(seed)
    if ragged:  # lengths in [context / 2, context], the first row the longest
        lens = torch.randint(context // 2, context + 1, (batch,), generator=gen).tolist()
        lens[0] = context
    else:
        lens = [context] * batch
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 8
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(order[used : used + count])
        used += count
    shape = (num_blocks, block_size, kv_heads, dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype).to(device)
    step = make_attention_batch(tables, lens, [1] * batch, block_size, device)
    return q, k, v, step, lens


def max_error(
    out: torch.Tensor, q, k, v, step: AttentionBatch, lens: list[int], rows: int
) -> float:
    rows = min(rows, len(lens))
    want = reference.paged_decode_attention(
        q[:rows].cpu(),
        k.cpu(),
        v.cpu(),
        step.block_tables[:rows].cpu(),
        lens[:rows],
        q.shape[-1] ** -0.5,
    )
    return (out[:rows].double().cpu() - want.double()).abs().max().item()


def run_config(name: str, batch: int, context: int, args: argparse.Namespace) -> dict:
    q, k, v, step, lens = make_step(
        batch, context, LAYOUTS[name], args.block_size, torch.bfloat16, "cuda", ragged=args.ragged
    )
    scale = q.shape[-1] ** -0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    longest = max(lens)

    def sdpa() -> torch.Tensor:
        return paged_attention(q, k, v, step, scale, decode_kernel="sdpa")

    def kernel() -> torch.Tensor:
        return paged_decode_attention(
            q, k, v, step.block_tables, seq_lens, scale, max_seq_len=longest
        )

    def via_engine_path() -> torch.Tensor:
        return paged_attention(q, k, v, step, scale, decode_kernel="triton")

    times = {
        "sdpa": cuda_median_ms(sdpa, args.warmup, args.repeats),
        "triton": cuda_median_ms(kernel, args.warmup, args.repeats),
        "triton*": cuda_median_ms(via_engine_path, args.warmup, args.repeats),
    }
    return {
        "layout": name,
        "batch": batch,
        "context": context,
        "ms": times,
        "ratio": times["sdpa"] / times["triton"],
        "ratio_engine_path": times["sdpa"] / times["triton*"],
        "max_err_sdpa": max_error(sdpa(), q, k, v, step, lens, args.check_rows),
        "max_err_triton": max_error(kernel(), q, k, v, step, lens, args.check_rows),
    }


def interpreter_check() -> int:
    """No GPU: a few tiny steps in Triton's interpreter against the reference; 0 when all pass."""
    print("# no CUDA device: nothing is timed. Correctness only, in Triton's CPU interpreter.")
    failures = 0
    print(f"{'layout':>13} {'B':>3} {'ctx':>5} {'dtype':>9} {'|Δ| sdpa':>9} {'|Δ| triton':>10}")
    for name, layout in LAYOUTS.items():
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for batch, context in ((1, 17), (3, 40)):
                q, k, v, step, lens = make_step(
                    batch, context, layout, 16, dtype, "cpu", ragged=True
                )
                scale = q.shape[-1] ** -0.5
                sdpa = paged_attention(q, k, v, step, scale, decode_kernel="sdpa")
                kernel = paged_decode_attention(
                    q, k, v, step.block_tables, torch.tensor(lens), scale, num_splits=2
                )
                errors = [max_error(out, q, k, v, step, lens, batch) for out in (sdpa, kernel)]
                failures += any(e > tol for e in errors)
                print(
                    f"{name:>13} {batch:>3} {context:>5} {str(dtype)[6:]:>9} "
                    f"{errors[0]:>9.2e} {errors[1]:>10.2e}"
                )
    print("# all within tolerance" if not failures else f"# {failures} configurations FAILED")
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--ragged", action="store_true", help="lengths in [ctx/2, ctx]")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--check-rows", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    print(
        f"# paged_decode_bench  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.node()}  "
        f"{card or platform.machine()}  torch {torch.__version__}  triton {triton_version}"
    )
    if triton_version is None:
        print("# triton is not installed (pip install 'agentrl[kernels]'): nothing to run")
        return
    if not torch.cuda.is_available():
        sys.exit(interpreter_check())
    lengths = "ragged: lengths in [ctx/2, ctx]" if args.ragged else "every row at ctx"
    print(f"# bf16, block_size {args.block_size}, shuffled block tables, {lengths}")
    print(f"# median of {args.repeats} after {args.warmup} warm-up calls (CUDA events)")
    print(
        f"{'layout':>13} {'B':>3} {'ctx':>5} {'sdpa ms':>8} {'triton ms':>9} {'ratio':>6} "
        f"{'triton* ms':>10} {'ratio*':>6} {'|Δ| sdpa':>9} {'|Δ| triton':>10}"
    )
    rows = []
    for name in args.layouts:
        for batch in args.batches:
            for context in args.contexts:
                r = run_config(name, batch, context, args)
                rows.append(r)
                ms = r["ms"]
                print(
                    f"{name:>13} {batch:>3} {context:>5} {ms['sdpa']:>8.3f} "
                    f"{ms['triton']:>9.3f} {r['ratio']:>6.2f} {ms['triton*']:>10.3f} "
                    f"{r['ratio_engine_path']:>6.2f} {r['max_err_sdpa']:>9.2e} "
                    f"{r['max_err_triton']:>10.2e}",
                    flush=True,
                )
                torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": card, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
