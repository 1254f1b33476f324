"""Kernel benchmarks: fused linear + log-prob + entropy against the naive path.

For each shape, forward + backward (``Σ logprob·g1 + entropy·g2`` with random upstream
gradients, so both outputs' gradients flow) of three paths, each in the same run:

- ``naive``: ``logits = h Wᵀ`` in the working dtype, ``log_softmax`` in fp32, gather, entropy —
  what a trainer without a fused kernel writes;
- ``chunked``: the torch fallback (``backend='torch'``, 1024 tokens per chunk);
- ``triton``: the Triton backend (``backend='triton'``, 1024 tokens per chunk): for bf16 its
  GEMM path (cuBLAS fp32-output GEMMs + Triton row kernels). On a GPU it is timed; on CPU,
  ``--interpreter`` runs it in Triton's interpreter for its *memory* only (the interpreter is no
  speed test);
- ``tiles`` (GPU): the all-Triton tile kernel (``FusedLogprobEntropy``, the backend's fp32 path)
  on the same bf16 inputs, for comparison.

Reported per path: peak memory *added* by the computation (CUDA: ``max_memory_allocated`` over
the inputs; CPU: the process's VmHWM after resetting it through ``/proc/self/clear_refs``, one
fresh process per path), median wall time of fwd+bwd (on CPU also the median CPU time of the
process, steadier on a shared machine), the ratios to ``naive``, and max |Δ logprob| against an
fp32 reference (the chunked path in fp32 on the same rounded inputs).
A path that runs out of memory reports ``OOM`` — that is its result.

    .venv/bin/python bench/kernels_bench.py                 # GPU: T=16384 and 8192, H=896, bf16
    .venv/bin/python bench/kernels_bench.py --tokens 2048 --hidden 576   # CPU-sized
    TRITON_INTERPRET=1 .venv/bin/python bench/kernels_bench.py --tokens 2048 --hidden 576 \
        --vocab 49152 --interpreter                                       # + kernel memory
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

VOCABS = (49_152, 151_936)


def _inputs(t: int, h: int, v: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(t, h, generator=g) * 2).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).to(device)
    targets = torch.randint(0, v, (t,), generator=g).to(device)
    g_lp = torch.randn(t, generator=g).to(device)
    g_ent = torch.randn(t, generator=g).to(device)
    return hidden, weight, targets, g_lp, g_ent


def naive(hidden, weight, targets):
    logits = hidden @ weight.T  # [T, V] in the working dtype
    log_p = torch.log_softmax(logits.float(), dim=-1)
    logprob = log_p.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logprob, entropy


def _path(name: str):
    from agentrl.kernels import fused_logprob_entropy

    if name == "naive":
        return naive
    if name == "tiles":
        from agentrl.kernels import FusedLogprobEntropy

        return lambda h, w, y: FusedLogprobEntropy.apply(h, w, y, 1.0)
    backend = {"chunked": "torch", "triton": "triton"}[name]
    return lambda h, w, y: fused_logprob_entropy(h, w, y, backend=backend, chunk_size=1024)


def _fwd_bwd(fn, hidden, weight, targets, g_lp, g_ent):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    lp, ent = fn(h, w, targets)
    (lp.float() * g_lp + ent.float() * g_ent).sum().backward()
    return lp.detach().float()


def _status_kib(field: str) -> int:
    """``VmHWM`` (peak resident) or ``VmRSS`` of this process, KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(name: str, t: int, h: int, v: int, dtype: torch.dtype, device: str, repeats: int):
    """One path at one shape: peak added memory (bytes), median seconds, logprobs (CPU fp32)."""
    fn = _path(name)
    # imports, Triton's compilation or interpreter set-up: not part of the computation's memory
    _fwd_bwd(fn, *_inputs(64, h, 256, dtype, device))
    inputs = _inputs(t, h, v, dtype, device)
    try:
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            lp = _fwd_bwd(fn, *inputs)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            from agentrl.engine._decode import cuda_median_ms

            seconds = cuda_median_ms(lambda: _fwd_bwd(fn, *inputs), 0, repeats) / 1000
        else:
            base = _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            lp = _fwd_bwd(fn, *inputs)  # the first call measures memory and warms up
            peak = (_status_kib("VmHWM") - base) * 1024
            times, cpu = [], []
            for _ in range(repeats if name != "triton" else 0):
                t0, c0 = time.perf_counter(), time.process_time()
                _fwd_bwd(fn, *inputs)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            if not times:  # the interpreter: memory only
                return peak, float("nan"), lp.cpu(), float("nan")
            return peak, statistics.median(times), lp.cpu(), statistics.median(cpu)
    except torch.OutOfMemoryError:
        return None
    return peak, seconds, lp.cpu(), float("nan")


def _reference(t, h, v, dtype, device):
    """fp32 logprobs of the same rounded inputs (the chunked path in fp32: bounded memory)."""
    from agentrl.kernels import fused_logprob_entropy

    hidden, weight, targets, _, _ = _inputs(t, h, v, dtype, device)
    with torch.no_grad():
        lp, _ = fused_logprob_entropy(
            hidden.float(), weight.float(), targets, backend="torch", chunk_size=512
        )
    return lp.cpu()


def _child(args: argparse.Namespace) -> None:
    """``--child NAME --lp-out FILE``: measure one CPU path in this fresh process; print JSON,
    save its logprobs to FILE (the parent compares them with its one reference)."""
    dtype = getattr(torch, args.dtype)
    out = measure(
        args.child, args.tokens[0], args.hidden, args.vocab[0], dtype, "cpu", args.repeats
    )
    if out is None:
        print(json.dumps({"oom": True}))
        return
    peak, secs, lp, cpu = out
    torch.save(lp, args.lp_out)
    print(json.dumps({"peak": peak, "secs": secs, "cpu": cpu}))


def _cpu_run(name, t, h, v, args) -> tuple[dict, torch.Tensor | None]:
    """One path measured in a fresh process: its numbers and its logprobs (None when OOM)."""
    with tempfile.TemporaryDirectory() as tmp:
        lp_file = os.path.join(tmp, "lp.pt")
        cmd = [sys.executable, __file__, "--child", name, "--tokens", str(t), "--hidden", str(h)]
        cmd += ["--vocab", str(v), "--dtype", args.dtype, "--repeats", str(args.repeats)]
        cmd += ["--lp-out", lp_file]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            if "MemoryError" in proc.stderr or proc.returncode in (-9, 137):
                return {"oom": True}, None
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-2000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        return row, (torch.load(lp_file) if not row.get("oom") else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--interpreter",
        action="store_true",
        help="CPU: also run the Triton kernel in the interpreter, for its memory (needs "
        "TRITON_INTERPRET=1)",
    )
    p.add_argument("--json", default=None, help="also write every row here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lp-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.repeats = args.repeats or (5 if cuda else 2)
    args.tokens = args.tokens or ([16_384, 8_192] if cuda else [2_048])
    if args.child:
        _child(args)
        return
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    if args.interpreter and not os.environ.get("TRITON_INTERPRET"):
        p.error("--interpreter needs TRITON_INTERPRET=1 in the environment")
    paths = ["naive", "chunked"] + (["triton"] if cuda or args.interpreter else [])
    paths += ["tiles"] if cuda else []
    card = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    print(f"# kernels_bench  {datetime.date.today()}  device={device} ({card})  dtype={args.dtype}")
    print(f"# torch {torch.__version__}  cores={os.cpu_count()}  hidden={args.hidden}")
    if not cuda:
        print("# no GPU: the Triton kernel is not timed (the interpreter is not a speed test);")
        print("# 'cpu ms' is this process's CPU time, steadier than wall time on a shared box")
    print(f"{'T':>6} {'V':>7} {'path':>8} {'peak MiB':>9} {'vs naive':>8} {'ms':>9} "
          f"{'vs naive':>8} {'cpu ms':>9} {'vs naive':>8} {'max|dlp|':>9}")  # fmt: skip
    table = []
    for t in args.tokens:
        for v in args.vocab:
            rows = {}
            ref = _reference(t, args.hidden, v, dtype, device)  # once per shape, every path
            for name in paths:
                if cuda:
                    out = measure(name, t, args.hidden, v, dtype, device, args.repeats)
                    row, lp = ({"oom": True}, None) if out is None else (
                        {"peak": out[0], "secs": out[1], "cpu": out[3]}, out[2]
                    )  # fmt: skip
                    torch.cuda.empty_cache()
                else:
                    row, lp = _cpu_run(name, t, args.hidden, v, args)
                if lp is not None:
                    row["dlp"] = float((lp - ref).abs().max())
                rows[name] = row
            base = rows["naive"]
            for name, r in rows.items():
                row = {"tokens": t, "vocab": v, "hidden": args.hidden, "path": name}
                table.append(row)
                if r.get("oom"):
                    row["oom"] = True
                    print(f"{t:>6} {v:>7} {name:>8} {'OOM':>9}")
                    continue
                row.update(peak_mib=r["peak"] / 2**20, ms=r["secs"] * 1000, dlp=r["dlp"])
                row.update(cpu_ms=r["cpu"] * 1000)
                mem_ratio = time_ratio = cpu_ratio = "-"
                if not base.get("oom"):
                    row["mem_ratio"] = r["peak"] / max(base["peak"], 1)
                    row["time_ratio"] = r["secs"] / base["secs"]
                    row["cpu_ratio"] = r["cpu"] / base["cpu"]
                    mem_ratio = f"{row['mem_ratio']:.3f}"
                    time_ratio = f"{row['time_ratio']:.2f}"
                    cpu_ratio = f"{row['cpu_ratio']:.2f}"
                print(f"{t:>6} {v:>7} {name:>8} {r['peak'] / 2**20:>9.1f} {mem_ratio:>8} "
                      f"{r['secs'] * 1000:>9.1f} {time_ratio:>8} {r['cpu'] * 1000:>9.1f} "
                      f"{cpu_ratio:>8} {r['dlp']:>9.2e}")  # fmt: skip
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": card, "dtype": args.dtype, "rows": table}, f, indent=2, default=str
            )


if __name__ == "__main__":
    main()
