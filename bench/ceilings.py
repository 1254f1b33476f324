"""The two ceilings every other device number is read against: a large bf16 (GPU) or fp32 (CPU)
matrix product through torch, in FLOP/s, and a large device-to-device copy, in bytes/s counting
bytes read plus bytes written. Random inputs (never zeros), warm-up first, median of timed
repeats (CUDA events on a GPU).

    .venv/bin/python bench/ceilings.py [--device cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _median_seconds(fn, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm-up: handles, kernel selection
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_seconds(n: int, dtype, device, g, repeats: int) -> float:  # noqa: ANN001
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return _median_seconds(lambda: torch.mm(a, b, out=out), device, repeats)


def _copy_seconds(n: int, device, g, repeats: int) -> float:  # noqa: ANN001
    src = torch.randn(n, device=device, generator=g)
    dst = torch.empty_like(src)
    return _median_seconds(lambda: dst.copy_(src), device, repeats)


def measure(device: torch.device, matmul_n: int, copy_bytes: int, repeats: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    mm_s = _matmul_seconds(matmul_n, dtype, device, g, repeats)
    n = copy_bytes // 4
    copy_s = _copy_seconds(n, device, g, repeats)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_n": matmul_n,
        "matmul_flop_s": 2 * matmul_n**3 / mm_s,
        "copy_bytes": n * 4,
        "copy_bytes_s": 2 * n * 4 / copy_s,  # read + written
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--matmul-n", type=int, default=None, help="8192 on a GPU, 1024 on CPU")
    p.add_argument("--copy-mib", type=int, default=None, help="4096 on a GPU, 256 on CPU")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    matmul_n = args.matmul_n or (8192 if gpu else 1024)
    copy_mib = args.copy_mib or (4096 if gpu else 256)
    result = measure(device, matmul_n, copy_mib * 2**20, args.repeats)
    print(
        f"{result['device']}: {result['matmul_dtype']} matmul {matmul_n}^3 "
        f"{result['matmul_flop_s'] / 1e12:.1f} TFLOP/s; copy {copy_mib} MiB "
        f"{result['copy_bytes_s'] / 1e9:.0f} GB/s (read + written)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
