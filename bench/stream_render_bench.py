"""What rendering a stream's chunks costs on the host, without a model: one answer of ``--new``
tokens of ordinary text (English and code, from SmolLM2's tokenizer), rendered as ``agentrl
serve`` renders a stream with a chunk per token, text only and with top-5 logprob lists.

Two ways, in the same run: the chunk's text decoded from all its ids (the baseline, what a
tokenizer that does not join its tokens' bytes gets) and from the ids since the text last ended
a character (``RenderMemo.text``, byte-level BPE tokenizers). Prints seconds per stream and the
ratio baseline / incremental; the whole text of each way is checked equal chunk by chunk.

    .venv/bin/python bench/stream_render_bench.py --new 2000 8000
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from transformers import AutoTokenizer

from agentrl._models import resolve_model
from agentrl._types import GenerateResult, SamplingParams
from agentrl.engine._server_generate import Item, ModelFacts, RenderMemo, render_result

TEXT = (
    "The function below reads a file of numbers, one per line, and returns their mean. "
    "It skips blank lines and raises ValueError for anything else.\n\n"
    "def mean_of(path: str) -> float:\n    values = []\n    with open(path) as f:\n"
    "        for line in f:\n            if line.strip():\n"
    "                values.append(float(line))\n    return sum(values) / len(values)\n\n"
)


def stream(facts: ModelFacts, ids: list[int], logprobs: bool) -> tuple[float, list[str]]:
    item = Item([1, 2, 3], SamplingParams(max_new_tokens=len(ids)), "r", logprobs, -1,
                logprobs, False, True, None, top_logprobs_num=5 if logprobs else 0)  # fmt: skip
    lps = [-0.5] * len(ids)
    memo, texts = RenderMemo(), []
    start = time.perf_counter()
    for n in range(1, len(ids) + 1):
        partial = GenerateResult(ids[:n], lps[:n], "abort", prompt_tokens=0)
        texts.append(render_result(item, [1, 2, 3], partial, facts, 0.0, memo).text)
    return time.perf_counter() - start, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--model", default="tiny-random", help="whose tokenizer (SmolLM2's)")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    joined = ModelFacts.read(folder, tokenizer, 1 << 20)
    assert joined.joins_bytes, "this tokenizer decodes whole at every chunk anyway"
    whole = dataclasses.replace(joined, joins_bytes=False)
    base = tokenizer(TEXT)["input_ids"]
    for n in args.new:
        ids = (base * (n // len(base) + 1))[:n]
        for logprobs in (False, True):
            t_whole, a = stream(whole, ids, logprobs)
            t_incr, b = stream(joined, ids, logprobs)
            assert [x.rstrip("\ufffd") for x in a] == [x.rstrip("\ufffd") for x in b]
            what = "text + top-5 lists" if logprobs else "text"
            print(f"{n:6d} tokens, {what:18s}  whole decode {t_whole:7.2f} s  incremental "
                  f"{t_incr:6.2f} s  ratio {t_whole / t_incr:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
