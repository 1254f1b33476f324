"""One prefill step of many prompts through the embedded engine's forward, on the CPU or a GPU:
prefill rows attended in padded groups (the engine's default, ``PREFILL_PAD``) against one
attention call per row (``prefill_pad=0``), in the same process.

A step packs ``B`` fresh prompts (``--prompt`` tokens each, or lengths drawn uniformly from
``--prompt``..``--prompt-max``) into one ``ForwardBatch``, as the scheduler does when
``max_step_tokens`` admits them all. Timed: building the batch (host) and the model's forward
(the device synchronized around it), median over ``--repeats`` after one warm-up, best of
``--rounds`` rounds of the two configurations alternating. Both must give the same logits for
each prompt's last token up to rounding: the bench prints the largest difference next to the
ratios grouped / per-row.

``--cached K``: each prompt's first ``K`` tokens are already in the KV pool (a chunk after a
cached prefix, as a session's next turn or a chunked prompt's later chunk): only the rest is fed.
Several values (``--cached 0 112``) run one after the other in the same process.
``--causal``: instead, one prompt at a time alone in its group, attended as a *causal row* (no
mask tensor: ``make_attention_batch(causal_rows=True)``) against the folded, masked call
(``causal_rows=False``); ratios causal / masked.
``--triton``: instead, the engine's SDPA prefill path (padded groups, causal rows where the
engine picks them) against the Triton paged-prefill kernel (``prefill_attention="triton"``:
every row in one launch per layer); ratios triton / sdpa. Needs a CUDA device, or
``TRITON_INTERPRET=1`` on the CPU (which checks the bench; its times mean nothing).

Usage::

    .venv/bin/python bench/prefill_bench.py --batches 8 32 128 [--model tiny-random]
    .venv/bin/python bench/prefill_bench.py --causal --batches 1 --prompt 512 [--cached 480]
    python bench/prefill_bench.py --device cuda --dtype bfloat16 --model FOLDER:random \
        --batches 32 128 --prompt 64 --prompt-max 256
    python bench/prefill_bench.py --device cuda --dtype bfloat16 --model FOLDER:random \
        --triton --batches 128 --prompt 128 --cached 112   # a batch over radix-cached prompts
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_step_bench import add_model_arguments, model_from_args, synchronize  # noqa: E402

from agentrl.engine._batch import Row, build_forward_batch  # noqa: E402
from agentrl.engine._decode import AttentionKernelChooser  # noqa: E402
from agentrl.engine._kv import PREFILL_PAD, KVPool  # noqa: E402
from agentrl.engine._model import CausalLM  # noqa: E402

BLOCK = 16


def make_rows(batch: int, args: argparse.Namespace, vocab: int, cached: int) -> list[Row]:
    rng = random.Random(0)
    rows, next_block = [], 0
    for _ in range(batch):
        n = rng.randint(args.prompt, max(args.prompt, args.prompt_max))
        blocks = list(range(next_block, next_block + -(-n // BLOCK)))
        next_block += len(blocks)
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        fed_from = min(cached, n - 1)
        rows.append(Row(ids, fed_from, n - fed_from, blocks, True))
    return rows


def run_once(
    model: CausalLM,
    rows: list[Row],
    pad: float,
    repeats: int,
    causal: bool | None = None,
    prefill: str = "sdpa",
) -> dict[str, Any]:
    config, device = model.config, model.device
    attention = AttentionKernelChooser("sdpa", device, model.dtype, prefill)
    pool = KVPool(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_blocks=sum(len(r.blocks) for r in rows) + 1,
        block_size=BLOCK,
        dtype=model.dtype,
        device=device,
    )
    build, forward = [], []
    logits = None
    with torch.inference_mode():
        for i in range(repeats + 1):
            synchronize(device)
            start = time.perf_counter()
            batch = build_forward_batch(rows, BLOCK, device, prefill_pad=pad, causal_rows=causal)
            built = time.perf_counter()
            logits = model.forward(batch, pool, attention)
            synchronize(device)
            end = time.perf_counter()
            if i:  # the first is a warm-up
                build.append(built - start)
                forward.append(end - built)
    groups = len(batch.attention.prefill_groups)
    return {
        "build": statistics.median(build) * 1e3,
        "forward": statistics.median(forward) * 1e3,
        "groups": groups,
        "logits": logits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=0, help="lengths drawn up to this")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cached", type=int, nargs="+", default=[0], help="tokens already in the KV pool"
    )
    parser.add_argument(
        "--causal", action="store_true", help="compare causal rows with masked ones instead"
    )
    parser.add_argument(
        "--triton", action="store_true", help="compare the Triton prefill kernel with SDPA instead"
    )
    args = parser.parse_args()
    model = model_from_args(args)
    lengths = f"{args.prompt}" + (f"..{args.prompt_max}" if args.prompt_max > args.prompt else "")
    if args.cached != [0]:
        lengths += f" ({' / '.join(map(str, args.cached))} of them cached)"
    print(
        f"model {args.model} on {model.device} ({args.dtype}), prompts of {lengths} tokens, "
        f"one prefill step (median ms of {args.repeats}, best of {args.rounds} rounds)"
    )
    configs: list[tuple[str, float, bool | None, str]] = [
        ("per-row", 0.0, False, "sdpa"),
        ("grouped", PREFILL_PAD, False, "sdpa"),
    ]
    if args.causal:  # every row alone: masked against causal
        configs = [("masked", 0.0, False, "sdpa"), ("causal", 0.0, True, "sdpa")]
    if args.triton:  # the engine's SDPA path against the kernel
        configs = [("sdpa", PREFILL_PAD, None, "sdpa"), ("triton", PREFILL_PAD, None, "triton")]
    report: dict[str, Any] = {"args": vars(args), "rows": []}
    for cached, batch in ((c, b) for c in args.cached for b in args.batches):
        rows = make_rows(batch, args, model.config.vocab_size, cached)
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for name, pad, causal, prefill in configs:
                result = run_once(model, rows, pad, args.repeats, causal, prefill)
                if name not in best or result["forward"] < best[name]["forward"]:
                    best[name] = result
        (base_name, *_), (new_name, *_) = configs
        base, new = best[base_name], best[new_name]
        delta = (base.pop("logits") - new.pop("logits")).abs().max().item()
        at = f"cached {cached:4d} " if len(args.cached) > 1 else ""
        for name, row in best.items():
            print(
                f"{at}B={batch:4d} {name:8s} groups {row['groups']:4d}  "
                f"build {row['build']:8.2f}  forward {row['forward']:9.2f}"
            )
        print(
            f"{at}B={batch:4d} {new_name} / {base_name}: "
            f"forward {new['forward'] / base['forward']:.3f}x, "
            f"build {new['build'] / base['build']:.3f}x; max |dlogit| {delta:.3g}"
        )
        report["rows"].append({"batch": batch, "cached": cached, **best, "max_dlogit": delta})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
