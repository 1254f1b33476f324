"""Embedded engine benchmark, every ratio measured in the same run, on the CPU or
(``--device cuda``) on a GPU: the engine with ``EngineOptions(device=...)`` and HF ``generate``
with the model on the same device.

Sections (``--sections``, default all):

- ``throughput``: tokens/s against HF ``generate`` on the same model, batch and lengths (greedy,
  random prompts of ``--prompt`` tokens, ``--new`` new tokens each, HF with
  ``min_new_tokens`` so both produce the same count). Prefill included.
- ``tools``: an 8-turn tool workload (4 trajectories at once; each turn samples 24 tokens and
  appends a 45-token tool message), run with no reuse, radix cache only, sessions + radix.
- ``group``: GRPO-style groups (G=8 samples of each of 4 prompts, temperature 1, seeded),
  no reuse vs radix cache.
- ``long``: one trajectory at >= 4k context (a synthetic 4,096-token prompt, 4 turns), re-prefill
  every turn vs sessions + radix: rollout wall time.

Reuse is reported as prefill tokens computed and ``cached_tokens`` against the ideal (turn k+1
reuses turn k's prompt + completion - 1; a group sibling reuses the prompt - 1). Outputs of all
configurations are compared id for id. Timing on a shared CPU is noisy: sections alternate their
configurations for ``--rounds`` rounds and report the best round of each; per-round ratios (wall
and process CPU time) are printed too. On a shared 2-core box, 2 OpenMP threads per process make
HF ``generate`` collapse whenever another tenant takes a core (its many small ops each wait at a
barrier for a descheduled thread): ``--threads 1`` gives the comparable numbers.

On CUDA every timing synchronizes the device before it starts and before it stops, and the
throughput section first runs each side once untimed on the same inputs (CUDA context, cuBLAS
handles, Triton compiles and the engine's ``decode_attention="auto"`` choices happen there).
Usage::

    .venv/bin/python bench/engine_bench.py [--model smollm2-135m] [--threads 2] [--rounds 2]
    .venv/bin/python bench/engine_bench.py --device cuda --dtype bfloat16 --batches 1 8 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from agentrl._models import resolve_model  # noqa: E402
from agentrl._types import GenerateResult, SamplingParams  # noqa: E402
from agentrl.engine import EmbeddedEngine, EngineOptions, EngineStatistics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import STEP_METRICS, split_text, step_split  # noqa: E402

NO_REUSE = {"radix_cache": False}
RADIX = {"radix_cache": True}


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread that ends afterwards: each torch thread owns an OpenMP team, and a
    second live team slows the other ~1.7x on 2 cores, so nothing outlives its measurement."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def with_engine(folder: Path, args: argparse.Namespace, options: dict, body) -> Any:  # noqa: ANN001
    """Start a fresh engine, run ``await body(engine)`` and close it; returns (value, stats)."""

    async def main() -> Any:
        engine = EmbeddedEngine.from_pretrained(
            folder,
            EngineOptions(
                num_threads=args.threads, dtype=args.dtype, device=args.device, **options
            ),
        )
        try:
            value = await body(engine)
            return value, engine.statistics()
        finally:
            await engine.aclose()

    return anyio.run(main)


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU), so a timer brackets all of it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: str = "cpu") -> tuple[Any, float, float]:
    """(value, wall seconds, process CPU seconds); on CUDA the device is synchronized before
    the clocks start and before they stop."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    synchronize(device)
    return value, time.perf_counter() - wall, time.process_time() - cpu


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


async def gather(engine: EmbeddedEngine, calls: list[Callable[[], Any]]) -> list[Any]:
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(calls))]


# --- throughput ---------------------------------------------------------------------------------


def throughput(folder: Path, args: argparse.Namespace, report: dict) -> None:
    rng = random.Random(0)
    for batch in args.batches:
        prompts = [rand_ids(rng, args.prompt) for _ in range(batch)]
        total = batch * args.new
        rows = []
        for round_ in range(args.rounds):
            base_ids, base_wall, base_cpu = in_thread(
                lambda p=prompts: hf_generate(folder, args, p)
            )
            options = {**NO_REUSE, "max_batch_size": batch}
            (ids, wall, cpu, split), stats = in_thread(
                lambda p=prompts, o=options: with_engine(
                    folder, args, o, engine_run(p, args.new, args.device)
                )
            )
            same = sum(a == b for a, b in zip(ids, base_ids, strict=True))
            rows.append((base_wall, wall, base_cpu, cpu, same, stats.graph_steps, split))
            print(
                f"  B={batch} round {round_}: HF generate {total / base_wall:7.1f} tok/s | "
                f"engine {total / wall:7.1f} tok/s | wall ratio {base_wall / wall:.2f}x | "
                f"CPU-time ratio {base_cpu / cpu:.2f}x | ids equal {same}/{batch} | "
                f"decode steps from CUDA graphs {stats.graph_steps}/{stats.decode_steps} | "
                f"{split_text(split)}",
                flush=True,
            )
        best_hf, best_engine = min(r[0] for r in rows), min(r[1] for r in rows)
        report[f"throughput_B{batch}"] = {
            "hf_tok_s": total / best_hf,
            "engine_tok_s": total / best_engine,
            "ratio_best": best_hf / best_engine,
            "ratios": [r[0] / r[1] for r in rows],
            "cpu_ratios": [r[2] / r[3] for r in rows],
            "ids_equal": f"{min(r[4] for r in rows)}/{batch}",
            "graph_steps": rows[-1][5],
            "split": min(rows, key=lambda r: r[1])[6],  # of the fastest round
        }
        print(
            f"B={batch}, prompt {args.prompt}, {args.new} new: best HF {total / best_hf:.1f} "
            f"tok/s, best engine {total / best_engine:.1f} tok/s -> {best_hf / best_engine:.2f}x",
            flush=True,
        )


def hf_generate(
    folder: Path, args: argparse.Namespace, prompts: list[list[int]]
) -> tuple[list[list[int]], float, float]:
    """HF ``generate``, greedy, exactly ``args.new`` tokens per row (no padding: equal lengths),
    the model and inputs on ``args.device``."""
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    ids = torch.tensor(prompts, device=args.device)

    def run() -> torch.Tensor:
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            do_sample=False,
            pad_token_id=2,
        )

    if torch.device(args.device).type == "cuda":
        run()  # warm-up on the real shapes
    else:
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=2)  # warm-up
    out, wall, cpu = timed(run, args.device)
    return out[:, len(prompts[0]) :].tolist(), wall, cpu


def engine_run(prompts: list[list[int]], new: int, device: str = "cpu"):  # noqa: ANN201
    """The engine's side of ``throughput`` (radix cache off: the warm-up reuses nothing)."""
    params = SamplingParams(max_new_tokens=new, temperature=0)

    async def run(engine: EmbeddedEngine) -> tuple[list[list[int]], float, float]:
        calls = [lambda p=p: engine.generate(p, params) for p in prompts]
        if torch.device(device).type == "cuda":
            await gather(engine, calls)  # warm-up on the real shapes
        else:
            await engine.generate(prompts[0][:8], SamplingParams(max_new_tokens=2))  # warm-up
        synchronize(device)
        before = counters(engine.statistics())
        wall, cpu = time.perf_counter(), time.process_time()
        results = await gather(engine, calls)
        synchronize(device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        split = step_split(before, counters(engine.statistics()), wall)
        return [r.token_ids for r in results], wall, cpu, split

    return run


def counters(stats: EngineStatistics) -> dict[str, float]:
    """The step counters ``server_bench.step_split`` reads, from in-process statistics."""
    return {name: getattr(stats, name) for name in STEP_METRICS}


# --- multi-turn and group workloads -------------------------------------------------------------


async def tool_trajectory(
    engine: EmbeddedEngine,
    prompt: list[int],
    turns: int,
    new: int,
    tool_tokens: int,
    seed: int,
    session: bool,
) -> tuple[list[GenerateResult], int]:
    """Returns the turn results and the ideal cached tokens (sum over turns k+1 of turn k's
    prompt + completion - 1)."""
    rng = random.Random(seed)
    context, results, ideal, previous = list(prompt), [], 0, 0
    sid = await engine.open_session() if session else None
    for _ in range(turns):
        result = await engine.generate(context, greedy(new), session=sid)
        results.append(result)
        ideal += previous
        previous = len(context) + len(result.token_ids) - 1
        # <|im_end|>\n<|im_start|>tool\n ... <|im_end|>\n<|im_start|>assistant\n
        tool = [2, 198, 1, 19324, 198, *rand_ids(rng, tool_tokens), 2, 198, 1, 520, 9531, 198]
        context = context + result.token_ids + tool
    if sid is not None:
        await engine.close_session(sid)
    return results, ideal


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def reuse_section(
    name: str,
    folder: Path,
    args: argparse.Namespace,
    report: dict,
    configs: dict[str, tuple[dict, bool]],
    workload: Callable[[EmbeddedEngine, bool], Any],
) -> None:
    """Run ``workload`` under every config for ``--rounds`` rounds; print reuse and time."""
    best: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds):
        for label, (options, session) in configs.items():

            async def body(engine: EmbeddedEngine, session: bool = session) -> Any:
                return await workload(engine, session)

            ((results, ideal), stats), wall, _ = in_thread(
                lambda options=options, body=body: timed(
                    lambda: with_engine(folder, args, options, body), args.device
                )
            )
            cached = sum(r.cached_tokens for r in results)
            outputs[label] = [r.token_ids for r in results]
            row = {
                "wall_s": wall,
                "prefill_tokens": stats.prefill_tokens,
                "cached_tokens": cached,
                "ideal_cached": ideal,
                "cached_over_ideal": cached / ideal if ideal else 0.0,
            }
            if label not in best or wall < best[label]["wall_s"]:
                best[label] = row
            print(
                f"  {name} round {round_} {label:>15}: {wall:7.2f} s | prefill computed "
                f"{stats.prefill_tokens:7d} | cached {cached:7d} / ideal {ideal:7d} "
                f"({row['cached_over_ideal']:.3f})",
                flush=True,
            )
    base_label = next(iter(configs))
    base = best[base_label]
    for label, row in best.items():
        row["speedup"] = base["wall_s"] / row["wall_s"]
        row["prefill_vs_no_reuse"] = row["prefill_tokens"] / base["prefill_tokens"]
        row["same_ids_as_no_reuse"] = outputs[label] == outputs[base_label]
        print(
            f"{name} {label:>15}: best {row['wall_s']:.2f} s ({row['speedup']:.2f}x vs "
            f"{base_label}) | prefill computed {row['prefill_vs_no_reuse']:.3f} of {base_label}"
            f" | cached/ideal {row['cached_over_ideal']:.3f} | same ids "
            f"{row['same_ids_as_no_reuse']}",
            flush=True,
        )
    report[name] = best


def tools(folder: Path, args: argparse.Namespace, report: dict) -> None:
    rng = random.Random(1)
    prompts = [rand_ids(rng, 200) for _ in range(4)]

    async def workload(engine: EmbeddedEngine, session: bool) -> Any:
        calls = [
            lambda i=i: tool_trajectory(engine, prompts[i], 8, 24, 30, seed=i, session=session)
            for i in range(4)
        ]
        done = await gather(engine, calls)
        return [r for results, _ in done for r in results], sum(ideal for _, ideal in done)

    configs = {
        "no reuse": (NO_REUSE, False),
        "radix": (RADIX, False),
        "sessions+radix": (RADIX, True),
    }
    reuse_section("tools", folder, args, report, configs, workload)


def group(folder: Path, args: argparse.Namespace, report: dict) -> None:
    rng = random.Random(2)
    prompts = [rand_ids(rng, 300) for _ in range(4)]

    async def workload(engine: EmbeddedEngine, session: bool) -> Any:
        calls = [
            lambda p=p, s=s: engine.generate(p, SamplingParams(max_new_tokens=32, seed=s))
            for p in prompts
            for s in range(8)
        ]
        results = await gather(engine, calls)
        return results, sum(7 * (len(p) - 1) for p in prompts)

    reuse_section(
        "group",
        folder,
        args,
        report,
        {"no reuse": (NO_REUSE, False), "radix": (RADIX, False)},
        workload,
    )


def long_context(folder: Path, args: argparse.Namespace, report: dict) -> None:
    prompt = rand_ids(random.Random(3), args.long_prompt)

    async def workload(engine: EmbeddedEngine, session: bool) -> Any:
        return await tool_trajectory(engine, prompt, 4, 16, 48, seed=9, session=session)

    configs = {"re-prefill": (NO_REUSE, False), "sessions+radix": (RADIX, True)}
    reuse_section("long", folder, args, report, configs, workload)


# --- page size ----------------------------------------------------------------------------------


def page_size(folder: Path, args: argparse.Namespace, report: dict) -> None:
    """The KV page size's cost: decode throughput at each batch (``--prompt`` + ``--new``) and
    one ``--long-prompt`` prefill, page 1 (SGLang's default) against page 16, same run."""
    rng = random.Random(1)
    long_prompt = [rand_ids(rng, args.long_prompt)]
    for batch in args.batches:
        prompts = [rand_ids(rng, args.prompt) for _ in range(batch)]
        best: dict[int, float] = {}
        for round_ in range(args.rounds):
            for page in (16, 1):
                options = {**NO_REUSE, "max_batch_size": batch, "block_size": page}
                (_, wall, _, _), _ = in_thread(
                    lambda p=prompts, o=options: with_engine(
                        folder, args, o, engine_run(p, args.new, args.device)
                    )
                )
                best[page] = min(best.get(page, wall), wall)
                print(f"  B={batch} round {round_} page {page}: {wall:.3f} s", flush=True)
        print(f"  B={batch}: page 1 / page 16 time {best[1] / best[16]:.3f}x", flush=True)
        report[f"page_size_B{batch}"] = {"page16_s": best[16], "page1_s": best[1]}
    best = {}
    for round_ in range(args.rounds):
        for page in (16, 1):
            options = {**NO_REUSE, "max_batch_size": 1, "block_size": page}
            (_, wall, _, _), _ = in_thread(
                lambda o=options: with_engine(
                    folder, args, o, engine_run(long_prompt, 1, args.device)
                )
            )
            best[page] = min(best.get(page, wall), wall)
            print(f"  prefill {args.long_prompt} round {round_} page {page}: {wall:.3f} s")
    print(f"  prefill {args.long_prompt}: page 1 / page 16 time {best[1] / best[16]:.3f}x")
    report["page_size_prefill"] = {"page16_s": best[16], "page1_s": best[1]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype of both the engine and HF generate (bfloat16: GPUs, AMX/AVX512-BF16 "
        "CPUs)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N: where the engine (EngineOptions.device) and HF generate run",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=4096)
    parser.add_argument("--sections", nargs="+", default=["throughput", "tools", "group", "long"])
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: CUDA is not available here")
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = "cpu"
    print(
        f"model {args.model} ({args.dtype}) on {args.device} ({device_name}), {args.threads} "
        f"threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    report: dict[str, Any] = {
        "model": args.model,
        "threads": args.threads,
        "device": args.device,
        "device_name": device_name,
        "dtype": args.dtype,
    }
    sections = {
        "throughput": throughput,
        "tools": tools,
        "group": group,
        "long": long_context,
        "page_size": page_size,
    }
    for name in args.sections:
        print(f"== {name}", flush=True)
        sections[name](folder, args, report)
    report["load_average_end"] = os.getloadavg()[0]
    print(f"load average at the end {report['load_average_end']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
