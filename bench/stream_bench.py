"""What streaming costs on any server that speaks SGLang's ``/generate``: one prompt, exactly
``--new`` greedy tokens (``ignore_eos``), sent plain and with ``stream: true``, without and with
logprob lists (``return_logprob``, ``top_logprobs_num``, ``return_text_in_logprobs``). Prints
each wall time, the bytes received, and the ratio streamed / plain for the same request, both
measured in this run (the baseline is the plain request).

A chunk at ``n`` tokens carries ``n`` entries of every list in SGLang's default cumulative mode
(``--incremental-streaming-output`` sends only the new ones), so what a server does per chunk
shows here as the ratio growing with ``--new``.

Standard library only.

    python3 bench/stream_bench.py --url http://127.0.0.1:30000 --new 1000 --top 5
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]


def timed(url: str, body: dict) -> tuple[float, int]:
    """Seconds until the whole answer is read, and its size in bytes."""
    request = urllib.request.Request(
        url.rstrip("/") + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as response:
        size = 0
        while chunk := response.read(1 << 20):
            size += len(chunk)
    return time.perf_counter() - start, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--new", type=int, default=1000, help="tokens to generate")
    parser.add_argument("--top", type=int, default=5, help="top_logprobs_num of the lists run")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    params = {"max_new_tokens": args.new, "temperature": 0, "ignore_eos": True}
    lists = {"return_logprob": True, "top_logprobs_num": args.top, "return_text_in_logprobs": True}
    timed(args.url, {"input_ids": PROMPT, "sampling_params": {**params, "max_new_tokens": 4}})
    rows = []
    for name, extra in (("ids only", {}), ("logprob lists", lists)):
        body = {"input_ids": PROMPT, "sampling_params": params, **extra}
        plain_s, plain_bytes = timed(args.url, body)
        stream_s, stream_bytes = timed(args.url, {**body, "stream": True})
        rows.append(
            {
                "request": name,
                "plain_s": round(plain_s, 3),
                "stream_s": round(stream_s, 3),
                "stream_over_plain": round(stream_s / plain_s, 2),
                "plain_bytes": plain_bytes,
                "stream_bytes": stream_bytes,
            }
        )
        print(
            f"{name:14s} plain {plain_s:7.2f} s ({plain_bytes:,} B)  stream {stream_s:7.2f} s "
            f"({stream_bytes:,} B)  stream/plain {stream_s / plain_s:.2f}x",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"url": args.url, "new": args.new, "top": args.top, "rows": rows}, out)


if __name__ == "__main__":
    main()
