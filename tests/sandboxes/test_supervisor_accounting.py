"""The supervisor's cgroup accounting against control files laid out as the kernel's are: the
per-request limit and the reported high-water mark must rest on the same baseline."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

SUPERVISOR = Path(__file__).resolve().parents[2] / "sandboxes" / "_supervisor.py"
MB = 1 << 20


@pytest.fixture(scope="module")
def sup() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("agentrl_supervisor_under_test", SUPERVISOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _set(path: Path, value: int) -> None:
    path.write_text(f"{value}\n")


def _v1_group(root: Path, usage: int) -> Path:
    """A v1 memory group of the program's own (the supervisor is not in its cgroup.procs)."""
    group = root / "memory"
    group.mkdir()
    for name, value in (
        ("memory.usage_in_bytes", usage),
        ("memory.limit_in_bytes", 0),  # the supervisor writes without truncating
        ("memory.max_usage_in_bytes", usage),
        ("memory.force_empty", 0),
    ):
        _set(group / name, value)
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (group / "cgroup.procs").write_text("")
    return group


def _meter(sup: types.ModuleType, group: Path):
    cg = sup.Cgroups([str(group)])
    run = types.SimpleNamespace(cgroups=cg, cpu_s=0.0, uid=None)
    return cg, sup.CgroupMeter(run)


@pytest.mark.parametrize("drained_pages", [0, 1, 64, 128])
def test_an_oom_kill_at_the_limit_reports_memory_mb_at_most(sup, tmp_path, drained_pages):
    """The limit is memory_mb over what the group held; if the usage falls before the meter
    starts (per-CPU charge caches drained: up to 64 pages per CPU), a program stopped at the
    limit still reports exactly memory_mb, not memory_mb plus what was drained."""
    held = 10 * MB + 12_288
    group = _v1_group(tmp_path, held)
    cg, meter = _meter(sup, group)
    cg.prepare(64 * MB, 8)
    limit = int((group / "memory.limit_in_bytes").read_text())
    assert limit == held + 64 * MB
    _set(group / "memory.usage_in_bytes", held - drained_pages * 4096)
    meter.start()
    _set(group / "memory.max_usage_in_bytes", limit)  # the OOM kill at the limit
    assert meter.peak_bytes() == 64 * MB


def test_v2_without_a_resettable_peak_reports_no_earlier_requests_mark(sup, tmp_path, monkeypatch):
    """A v2 group's memory.peak that cannot be reset (Linux before 6.12) is the mark of the
    group's whole life: an earlier request's high is not this request's peak."""
    group = tmp_path / "slot"
    group.mkdir()
    _set(group / "memory.current", 20 * MB)
    _set(group / "memory.max", 1 << 62)
    (group / "memory.events").write_text("oom 0\noom_kill 0\n")
    (group / "cgroup.procs").write_text("")
    peak = group / "memory.peak"
    _set(peak, 90 * MB)  # an earlier request's high
    peak.chmod(0o444)
    cg, meter = _meter(sup, group)
    real_open = open

    def refuse_writes(path, mode="r", *args, **kwargs):
        if str(path) == str(peak) and mode != "r":
            raise PermissionError(13, "read-only", str(path))
        return real_open(path, mode, *args, **kwargs)

    # the module's own open: root would write a 0444 file anyway
    monkeypatch.setattr(sup, "open", refuse_writes, raising=False)
    cg.prepare(64 * MB, 8)
    assert cg.peak_file is None and not cg.peak_is_fresh
    meter.start()
    assert meter.peak_bytes() is None  # no mark of this request (the maxrss decides)
    _set(peak, 100 * MB)  # a new high of the group: this request's
    assert meter.peak_bytes() == 80 * MB


def test_v2_peak_is_read_through_the_descriptor_that_reset_it(sup, tmp_path):
    group = tmp_path / "slot"
    group.mkdir()
    _set(group / "memory.current", 20 * MB)
    _set(group / "memory.max", 1 << 62)
    (group / "cgroup.procs").write_text("")
    _set(group / "memory.peak", 90 * MB)
    cg, meter = _meter(sup, group)
    cg.prepare(64 * MB, 8)
    assert cg.peak_file is not None and cg.peak_is_fresh
    assert (group / "memory.peak").read_bytes().startswith(b"reset\n")  # the write reached it
    meter.start()
    cg.peak_file.seek(0)
    cg.peak_file.write(b"%d\n" % (50 * MB))  # the kernel's answer on that descriptor
    assert meter.peak_bytes() == 30 * MB
    cg.close_peak()
    assert cg.peak_file is None
