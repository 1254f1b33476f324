"""Generation throughput of any server that speaks SGLang's ``/generate`` (real SGLang, or
``agentrl serve``), on the same workload as ``engine_bench.py``'s throughput section: ``B`` random
prompts of ``--prompt`` tokens (the same seeded ids), exactly ``--new`` greedy tokens each
(``ignore_eos``), prefill included.

Two ways to send a batch, both measured:

- ``batch``: one ``/generate`` request whose ``input_ids`` is the list of ``B`` prompts;
- ``concurrent``: ``B`` requests in flight at once (how rollout workers call a server).

Standard library only, so it runs where nothing else of agentrl is installed (a GPU machine with
only the server's own bundle).

    python3 bench/server_bench.py --url http://127.0.0.1:30000 --batches 1 32 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def rand_ids(rng: random.Random, n: int) -> list[int]:
    """The prompt ids of ``engine_bench.py`` (same generator, same range)."""
    return [rng.randrange(3, 49152) for _ in range(n)]


def post(url: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(
        url.rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def sampling(new: int) -> dict:
    return {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}


def run_batch(url: str, prompts: list[list[int]], new: int) -> tuple[float, int]:
    started = time.perf_counter()
    out = post(url, "/generate", {"input_ids": prompts, "sampling_params": sampling(new)})
    wall = time.perf_counter() - started
    items = out if isinstance(out, list) else [out]
    return wall, sum(item["meta_info"]["completion_tokens"] for item in items)


def run_concurrent(url: str, prompts: list[list[int]], new: int) -> tuple[float, int]:
    def one(prompt: list[int]) -> int:
        out = post(url, "/generate", {"input_ids": prompt, "sampling_params": sampling(new)})
        return out["meta_info"]["completion_tokens"]

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        started = time.perf_counter()
        tokens = sum(pool.map(one, prompts))
        return time.perf_counter() - started, tokens


STEP_METRICS = ("steps", "prefill_steps", "prefill_step_seconds", "decode_step_seconds")


def step_metrics(url: str) -> dict[str, float] | None:
    """``agentrl serve``'s step counters from ``/metrics`` (``agentrl:engine_*``); None where
    the server exports none (real SGLang)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition("{")
        key = name.removeprefix("agentrl:engine_")
        if key != name and key in STEP_METRICS:
            found[key] = float(value.rpartition(" ")[2])
    return found if len(found) == len(STEP_METRICS) else None


def step_split(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """A timed round's wall time: prefill steps, decode-only steps, and the rest (HTTP,
    tokenizing, admission, handing results back). ``before``/``after``: the engine's
    ``STEP_METRICS`` counters (from ``/metrics``, or ``EngineStatistics`` in process)."""
    d = {k: after[k] - before[k] for k in STEP_METRICS}
    return {
        "prefill_ms": d["prefill_step_seconds"] * 1e3,
        "prefill_steps": int(d["prefill_steps"]),
        "decode_ms": d["decode_step_seconds"] * 1e3,
        "decode_steps": int(d["steps"] - d["prefill_steps"]),
        "other_ms": (wall - d["prefill_step_seconds"] - d["decode_step_seconds"]) * 1e3,
    }


def split_text(split: dict, digits: int = 1) -> str:
    """``step_split``'s result in one line, milliseconds with ``digits`` decimals."""
    return (
        f"{split['prefill_steps']} prefill steps {split['prefill_ms']:.{digits}f} ms, "
        f"{split['decode_steps']} decode steps {split['decode_ms']:.{digits}f} ms, "
        f"other {split['other_ms']:.{digits}f} ms"
    )


def wait_ready(url: str, timeout: float) -> float:
    """Seconds until ``/health`` answers 200 (``TimeoutError`` after ``timeout``)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 32, 128],
                   help="none: only wait for /health (with --wait)")  # fmt: skip
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["batch", "concurrent"])
    p.add_argument("--wait", type=float, default=0.0, help="wait this long for /health first")
    p.add_argument("--json", default=None)
    p.add_argument("--each", action="store_true", help="print every timed round's split too")
    args = p.parse_args(argv)
    report: dict = {"url": args.url, "prompt": args.prompt, "new": args.new}
    if args.wait:
        report["ready_after_s"] = wait_ready(args.url, args.wait)
    try:
        report["model_info"] = json.loads(
            urllib.request.urlopen(args.url.rstrip("/") + "/get_model_info", timeout=10).read()
        )
    except OSError as exc:
        report["model_info"] = f"unavailable: {exc}"
    runners = {"batch": run_batch, "concurrent": run_concurrent}
    rng = random.Random(0)
    for batch in args.batches:
        prompts = [rand_ids(rng, args.prompt) for _ in range(batch)]
        for mode in args.modes:
            runners[mode](args.url, prompts, args.new)  # warm-up on the real shapes
            walls, splits = [], []
            for _ in range(args.rounds):
                before = step_metrics(args.url)
                wall, tokens = runners[mode](args.url, prompts, args.new)
                after = step_metrics(args.url)
                if tokens != batch * args.new:
                    raise RuntimeError(
                        f"B={batch} {mode}: {tokens} tokens, want {batch * args.new}"
                    )
                walls.append(wall)
                splits.append(step_split(before, after, wall) if before and after else None)
                if args.each:
                    split = f" | {split_text(splits[-1])}" if splits[-1] else ""
                    print(f"  round {len(walls)}: {wall * 1e3:.1f} ms{split}", flush=True)
            best = min(range(len(walls)), key=walls.__getitem__)
            row = {"tok_s": batch * args.new / walls[best], "walls": walls}
            line = f"B={batch:4} {mode:10} {row['tok_s']:9.1f} tok/s"
            if split := splits[best]:
                row["split"] = split
                line += f" | {split_text(split)}"
            report[f"{mode}_B{batch}"] = row
            print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
