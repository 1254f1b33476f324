"""Embedded engine throughput on CPU: batch 1 and batch 8, ~100-token prompts, 64 new tokens.

Compares against a plain transformers greedy loop (KV cache, no engine) measured in the same run.
Tokens/s counts generated tokens over wall time, prefill included. Usage (repo root):

    .venv/bin/python bench/engine_v1_bench.py [--model smollm2-135m] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import anyio  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from agentrl._models import resolve_model  # noqa: E402
from agentrl._types import SamplingParams  # noqa: E402
from agentrl.engine import EmbeddedEngine  # noqa: E402

NEW_TOKENS = 64
TOPICS = ["rivers", "volcanoes", "bread", "chess", "bees", "glaciers", "comets", "violins"]


def make_prompts(tokenizer: object, count: int) -> list[list[int]]:
    prompts = []
    for topic in TOPICS[:count]:
        text = (
            f"Write a short, friendly paragraph about {topic} for a curious ten-year-old. "
            "Mention one surprising fact, one everyday connection, and end with a question "
            "that invites them to look around and notice something new. Keep it simple, "
            "avoid lists, and do not use any difficult words without explaining them."
        )
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": text}], add_generation_prompt=True
        )["input_ids"]
        prompts.append(list(ids))
    return prompts


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """Plain batched greedy loop: left padding, explicit mask and positions, DynamicCache."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = [[] for _ in prompts]
    logits = model(ids, attention_mask=mask, position_ids=positions, cache=cache).logits[:, -1]
    for _ in range(NEW_TOKENS):
        nxt = logits.argmax(-1)
        for row, token in zip(out, nxt.tolist(), strict=True):
            row.append(token)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
        positions = positions[:, -1:] + 1
        logits = model(
            nxt.view(-1, 1), attention_mask=mask, position_ids=positions, cache=cache
        ).logits[:, -1]
    return out


async def engine_run(engine: EmbeddedEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        results[i] = (await engine.generate(prompts[i], params)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


def timed(fn, *args):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def in_thread(fn, *args):  # type: ignore[no-untyped-def]
    """Run ``fn`` in a thread that ends afterwards.

    Each thread that runs torch ops gets its own OpenMP team; on a 2-core box a second live team
    (even idle) slows the other by ~1.7x (measured: 32 -> 55 ms per decode step). The baseline
    therefore runs in a thread that is gone before the engine's worker starts.
    """
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batches = {batch: make_prompts(tokenizer, batch) for batch in (1, 8)}
    print(f"model {args.model}, {args.threads} threads, torch {torch.__version__}")

    def baseline() -> dict[int, tuple[list[list[int]], float]]:
        torch.set_num_threads(args.threads)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        hf_greedy(model, batches[1])  # warm-up
        return {batch: timed(hf_greedy, model, prompts) for batch, prompts in batches.items()}

    base = in_thread(baseline)
    engine = EmbeddedEngine.from_pretrained(folder, max_batch_size=8, num_threads=args.threads)
    anyio.run(engine_run, engine, batches[1])  # warm-up
    for batch, prompts in batches.items():
        lengths = sorted(map(len, prompts))
        total = batch * NEW_TOKENS
        base_ids, base_s = base[batch]
        eng_ids, eng_s = timed(anyio.run, engine_run, engine, prompts)
        same = sum(a == b for a, b in zip(base_ids, eng_ids, strict=True))
        print(
            f"batch {batch}: prompts {lengths[0]}-{lengths[-1]} tokens, {NEW_TOKENS} new each | "
            f"HF greedy loop {total / base_s:6.1f} tok/s ({base_s:.2f} s) | "
            f"engine {total / eng_s:6.1f} tok/s ({eng_s:.2f} s) | "
            f"greedy ids equal to HF loop: {same}/{batch}"
        )
    print(engine.statistics())
    anyio.run(engine.aclose)


if __name__ == "__main__":
    main()
