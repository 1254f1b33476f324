"""``bench/sandbox_bench.py`` runs (smoke test on the local backend, tiny counts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "sandbox_bench.py"


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--backends", "local,nope", "--concurrency", "1,2", "-n", "4", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "| local | trivial | 1 | 4 |" in proc.stdout and "# nope: skipped" in proc.stdout
    data = json.loads(out.read_text())
    assert {(r["program"], r["concurrency"]) for r in data["rows"]} == {
        ("trivial", 1),
        ("trivial", 2),
        ("100ms", 1),
        ("100ms", 2),
    }
    assert all(not r["failures"] for r in data["rows"])
