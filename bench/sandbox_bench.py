"""Sandbox latency and throughput per backend, and warm-pool exec vs a cold ``docker run --rm``.

    python bench/sandbox_bench.py                 # every available backend, full counts
    python bench/sandbox_bench.py --quick         # smaller counts (about a minute)
    python bench/sandbox_bench.py --backends local --concurrency 1,4

For each backend (local, docker, gvisor; one skipped with its reason when the host cannot give
it) one pool is opened with ``size`` = the largest concurrency, then for two programs — a trivial
one (``print(1)``) and a 100 ms one (``time.sleep(0.1)``: wall time, so the numbers measure the
sandbox, not CPU contention on a small host) — ``n`` requests run at concurrency 1, 4 and 16.
Each row: latency p50 / p99 as the caller sees it (``pool.run`` round trip) and executions per
second. Then ``docker run --rm IMAGE python3 -c 'print(1)'`` per request (runc, and runsc when
registered) gives the cold baseline, and the ratios cold p50 / warm p50 are printed in the same
run (goal: >= 10x); a bare SDK ``exec_run`` in one running container shows what one ``docker
exec`` per request would cost at least on this host (no supervisor, limits or checks): the
container backends avoid it by keeping one serving exec per container. The local backend's p50
for the trivial program is checked against 30 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any

import anyio

from agentrl.sandboxes import BackendUnavailable, PoolConfig, RunRequest, open_sandbox_pool
from agentrl.sandboxes._config import DEFAULT_IMAGE, docker_host_from_env

PROGRAMS = {
    "trivial": "print(1)",
    "100ms": "import time\ntime.sleep(0.1)\nprint(1)",
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def measure(pool: Any, code: str, n: int, concurrency: int) -> dict[str, Any]:
    """``n`` runs of ``code`` with ``concurrency`` in flight; latency per run, runs/s."""
    request = RunRequest(language="python", code=code, timeout_s=10.0)
    latencies: list[float] = []
    failures: dict[str, int] = {}
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < n:
            next_index += 1
            start = time.perf_counter()
            result = await pool.run(request)
            latencies.append(time.perf_counter() - start)
            if result.status != "ok":
                failures[result.status] = failures.get(result.status, 0) + 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    elapsed = time.perf_counter() - started
    return {
        "n": len(latencies),
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "execs_per_s": len(latencies) / elapsed,
        "failures": failures,
    }


async def bench_backend(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    levels = [int(c) for c in args.concurrency.split(",")]
    config = PoolConfig(
        backend={"type": name},
        size=args.pool_size or max(levels),
        max_queue=1024,
        queue_timeout_s=120,
        recycle_after=args.recycle_after,
    )
    rows = []
    started = time.perf_counter()
    async with open_sandbox_pool(config) as pool:
        print(
            f"# {name}: pool of {config.size} ready in {time.perf_counter() - started:.2f} s",
            flush=True,
        )
        for program, code in PROGRAMS.items():
            await measure(pool, code, min(args.n, 2 * config.size), config.size)  # warm-up
            for concurrency in levels:
                n = args.n if program == "trivial" else max(args.n // 2, concurrency)
                row = await measure(pool, code, n, concurrency)
                row.update(backend=name, program=program, concurrency=concurrency)
                rows.append(row)
                print(_row(row), flush=True)
    return rows


def _row(row: dict[str, Any]) -> str:
    failed = ", ".join(f"{k}={v}" for k, v in row["failures"].items()) or "-"
    return (
        f"| {row['backend']} | {row['program']} | {row['concurrency']} | {row['n']} | "
        f"{row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['execs_per_s']:.1f} | {failed} |"
    )


def cold_docker(runtime: str | None, n: int, image: str) -> dict[str, Any] | str:
    """p50/p99 of ``docker run --rm`` per request (the cold baseline), or why not measured."""
    docker = shutil.which("docker")
    if docker is None:
        return "docker CLI not found"
    host = docker_host_from_env()
    cmd = [docker, "-H", host, "run", "--rm", "--network", "none"]
    if runtime:
        cmd += ["--runtime", runtime]
    cmd += [image, "python3", "-c", "print(1)"]
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        latencies.append(time.perf_counter() - start)
        if proc.returncode != 0 or proc.stdout.strip() != "1":
            return f"docker run failed: {proc.stderr.strip()[:300]}"
    return {
        "n": n,
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
    }


def raw_exec(runtime: str | None, n: int, image: str) -> dict[str, Any] | str:
    """p50/p99 of a bare SDK ``exec_run`` of ``python3 -c 'print(1)'`` in one running container:
    the least one exec per request would cost (no supervisor, no limits, no checks)."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed"
    client = docker.DockerClient(base_url=docker_host_from_env(), timeout=60)
    kwargs: dict[str, Any] = {"runtime": runtime} if runtime else {}
    container = client.containers.run(
        image,
        ["sleep", "infinity"],
        detach=True,
        network_mode="none",
        labels={"agentrl.bench": "1"},
        **kwargs,
    )
    try:
        latencies = []
        for _ in range(n):
            start = time.perf_counter()
            code, output = container.exec_run(["python3", "-c", "print(1)"])
            latencies.append(time.perf_counter() - start)
            if code != 0:
                return f"exec failed: {output[:200]!r}"
    finally:
        container.remove(force=True)
        client.close()
    return {
        "n": n,
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="local,docker,gvisor")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("-n", type=int, default=200, help="runs per row (trivial program)")
    parser.add_argument("--cold", type=int, default=20, help="cold docker runs")
    parser.add_argument("--quick", action="store_true", help="n=48, cold=6")
    parser.add_argument("--pool-size", type=int, default=None, help="default: max concurrency")
    parser.add_argument("--recycle-after", type=int, default=1000)
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.cold = 48, 6
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')} {platform.node()} {platform.machine()} "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print("| backend | program | concurrency | runs | p50 ms | p99 ms | execs/s | failures |")
    print("|---|---|---|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in args.backends.split(","):
        try:
            rows += anyio.run(bench_backend, name, args, backend="trio")
        except BackendUnavailable as exc:
            skipped[name] = str(exc)
        except BaseExceptionGroup as group:
            unavailable = group.subgroup(lambda e: isinstance(e, BackendUnavailable))
            if unavailable is None:
                raise
            skipped[name] = str(unavailable.exceptions[0])
        except Exception as exc:  # e.g. the docker SDK missing: report, go on
            skipped[name] = f"{type(exc).__name__}: {exc}"
    for name, reason in skipped.items():
        print(f"# {name}: skipped ({reason})")

    cold: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    ran = {r["backend"] for r in rows}
    for name, runtime in (("docker", None), ("gvisor", "runsc")):
        if name in ran:
            cold[name] = cold_docker(runtime, args.cold, args.image)
            raw[name] = raw_exec(runtime, args.cold, args.image)
    print()
    print("| cold baseline | runs | p50 ms | p99 ms | warm p50 ms (trivial, c=1) | ratio |")
    print("|---|---|---|---|---|---|")
    for name, result in cold.items():
        warm = next(
            r for r in rows if r["backend"] == name and r["program"] == "trivial"
        )  # the c=1 row comes first
        if isinstance(result, str):
            print(f"| docker run --rm ({name}) | - | - | - | {warm['p50_ms']:.1f} | {result} |")
            continue
        ratio = result["p50_ms"] / warm["p50_ms"]
        result["ratio"] = ratio
        verdict = "meets" if ratio >= 10 else "misses"
        print(
            f"| docker run --rm ({name}) | {result['n']} | {result['p50_ms']:.1f} | "
            f"{result['p99_ms']:.1f} | {warm['p50_ms']:.1f} | {ratio:.1f}x ({verdict} 10x) |"
        )
    for name, result in raw.items():
        if isinstance(result, str):
            print(f"# bare exec_run ({name}): not measured ({result})")
        else:
            print(
                f"# bare SDK exec_run in a running container ({name}, the least one exec per "
                f"request costs): p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms"
            )
    local = [r for r in rows if r["backend"] == "local" and r["program"] == "trivial"]
    if local:
        p50 = local[0]["p50_ms"]
        verdict = "met" if p50 <= 30 else "missed"
        print(f"# local trivial p50 at c=1: {p50:.1f} ms (goal <= 30 ms: {verdict})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cold": cold, "raw": raw, "skipped": skipped}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
