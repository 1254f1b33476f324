"""``agentrl doctor`` names every isolation gap of every sandbox backend on this host.

The gaps are what each backend's ``guarantees()`` does not give here (``docs/sandboxes.md`` says
what each backend guarantees); a backend that cannot run here is a gap of its own, with the
reason. The CLI is run as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from agentrl.sandboxes._report import gaps, host_report

# gaps the design has on any host (said in docs/sandboxes.md, "Gaps that remain")
ALWAYS = {
    "local": {"kernel_isolation"},
    "docker": {"memory_hard_limit", "kernel_isolation"},
    "gvisor": {"memory_hard_limit", "tmpfs_inodes", "posix_mqueue", "cpu_time_per_request"},
}


def test_every_guarantee_not_given_is_a_named_gap():
    rows = host_report()
    assert [row[0] for row in rows] == ["local", "docker", "gvisor"]
    named_gaps = gaps(rows)
    for backend, available, detail, guarantees in rows:
        named = {(what, why) for b, what, why in named_gaps if b == backend}
        if not available:
            assert named == {("unavailable", detail)}, (backend, named)
            continue
        missing = {(g.name, g.detail) for g in guarantees if not g.available}
        assert named == missing, backend
        assert ALWAYS[backend] <= {what for what, _ in named}, (backend, named)
        assert all(why.strip() for _, why in named), named  # each says why


def test_doctor_prints_the_gaps_per_backend():
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"}
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.split("sandbox gaps on this host", 1)[1]
    lines = [line for line in text.splitlines() if "│" in line or "|" in line]
    for backend, what, _ in gaps(host_report()):
        assert any(backend in line and what in line for line in lines), (backend, what, text)
