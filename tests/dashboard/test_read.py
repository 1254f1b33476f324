"""The dashboard's data extraction from run files: what each panel plots, the quantiles
against numpy's, unreadable lines skipped and counted, and the page's safety and self-
containment (no network at view time, no markup from the data)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from agentrl.cli import main
from agentrl.dashboard import build_panels, load_run, render, write_dashboard
from agentrl.dashboard._panels import lag_histogram, plotly_text, reward_quantiles

KMSG = "/proc/kmsg"


def _write(path: Path, lines: list[str | bytes]) -> None:
    with path.open("wb") as fh:
        for line in lines:
            fh.write((line if isinstance(line, bytes) else line.encode()) + b"\n")


def _trajectory(step: int, reward: float | None, fate: str = "trained") -> str:
    return json.dumps(
        {
            "id": f"t{step}",
            "reward": reward,
            "termination_reason": "stop",
            "token_ids": list(range(50)),
            "info": {"fate": fate, "step": str(step)},
        }
    )


def make_run(root: Path, rng, steps: int = 4) -> tuple[Path, dict[int, list[float]]]:
    run = root / "run"
    run.mkdir()
    ledger, trajectories, rewards = [], [], {}
    for step in range(1, steps + 1):
        ledger.append(
            json.dumps(
                {
                    "step": step,
                    "step_s": 1.0 + step,
                    "rollout_s": 0.5,
                    "update_s": 0.4,
                    "reward_mean": 0.1 * step,
                    "reward/format": 0.5,
                    "kl": float("nan") if step == 2 else 0.01 * step,  # NaN: written by json
                    "termination": {"stop": 3, "max_tokens": step},
                    "version_lag_hist": {"0": 2, "1": step},
                    "tool_calls_per_trajectory": 2.0,
                    "tool_errors_per_trajectory": 0.5,
                }
            )
        )
        rewards[step] = [rng.random() for _ in range(rng.randrange(1, 9))]
        trajectories += [_trajectory(step, r) for r in rewards[step]]
    trajectories.append(_trajectory(1, None, fate="failed"))  # no reward: counted as a fate
    ledger.insert(0, json.dumps({"step": 0, "eval_reward_mean": 0.25}))
    _write(run / "ledger.jsonl", [*ledger, "[1, 2]", '{"step": 9, "torn'])
    _write(run / "trajectories.jsonl", [*trajectories, b"\xff\xfe not utf-8"])
    _write(
        run / "runtime.jsonl",
        [json.dumps({"time_s": t, "buffer_backlog": t % 3, "generated_tokens": 10}) for t in (2, 1)]
        + ["", "not json"],
    )
    return run, rewards


def test_reads_the_run_and_counts_the_unreadable_lines(tmp_path, rng):
    run, rewards = make_run(tmp_path, rng)
    data = load_run(run)
    assert data.skipped == {"ledger.jsonl": 2, "runtime.jsonl": 1, "trajectories.jsonl": 1}
    assert [r["time_s"] for r in data.runtime] == [1, 2]  # in time order
    assert data.ledger[2]["kl"] is None  # NaN from the file is no number on the page
    assert data.steps[1].fates == {"trained": len(rewards[1]), "failed": 1}
    quantiles = reward_quantiles(data)
    for q, (steps, values) in quantiles.items():
        assert steps == sorted(rewards)
        expect = [np.percentile(np.asarray(rewards[s], np.float64), 100 * q) for s in steps]
        assert values == pytest.approx(expect, rel=1e-12, abs=1e-15)  # float64 both sides
    assert lag_histogram(data) == {0: 8.0, 1: 10.0}


def test_each_panel_plots_its_fields_and_says_when_a_run_has_none(tmp_path, rng):
    run, _ = make_run(tmp_path, rng)
    panels = {p.id: p for p in build_panels([load_run(run)])}
    kl = next(t for t in panels["kl_entropy"].traces if t["name"] == "kl")
    assert kl["x"] == [1, 3, 4] and kl["y"] == pytest.approx([0.01, 0.03, 0.04])
    valid = next(t for t in panels["tools"].traces if t["name"].startswith("valid"))
    assert valid["y"] == [0.75] * 4
    stop = next(t for t in panels["termination"].traces if t["name"] == "max_tokens")
    assert stop["y"] == [1, 2, 3, 4] and stop["stackgroup"] == "run0"
    assert [t["name"] for t in panels["eval"].traces] == ["reward_mean"]
    for empty in ("sandbox_latency", "sandbox_failures", "publish", "mismatch", "clip"):
        assert not panels[empty].traces
        assert panels[empty].missing.startswith("No data in this run")
    for full in ("reward", "reward_breakdown", "backlog", "tokens_interval", "step_time"):
        assert panels[full].traces and panels[full].missing is None
    page = render([load_run(run)])
    assert page.count('data-has-data="false"') == sum(1 for p in panels.values() if p.missing)
    assert page.count('class="plot"') == sum(1 for p in panels.values() if not p.missing)


def test_the_backlog_axis_says_steps_when_a_run_has_no_interval_records(tmp_path, rng):
    """A run without interval records (killed before its first one, or logging.interval_s 0):
    its backlog comes from the ledger, by step, and the axis says so (not "seconds since
    start")."""
    (tmp_path / "timed").mkdir()
    (tmp_path / "short").mkdir()
    timed, _ = make_run(tmp_path / "timed", rng)
    short, _ = make_run(tmp_path / "short", rng)
    ledger = [json.loads(x) for x in (short / "ledger.jsonl").read_text().splitlines()[:5]]
    for record in ledger:
        record["buffer_backlog"] = 1
    _write(short / "ledger.jsonl", [json.dumps(r) for r in ledger])
    _write(short / "runtime.jsonl", [])

    def backlog(*runs):
        return next(
            p for p in build_panels([load_run(r, r.parent.name) for r in runs]) if p.id == "backlog"
        )

    alone = backlog(short)
    assert alone.layout["xaxis"]["title"]["text"] == "step" and "xaxis2" not in alone.layout
    assert all("xaxis" not in t for t in alone.traces) and alone.traces[0]["x"] == [0, 1, 2, 3, 4]
    assert backlog(timed).layout["xaxis"]["title"]["text"] == "seconds since start"
    both = backlog(timed, short)
    assert both.layout["xaxis"]["title"]["text"] == "seconds since start"
    assert both.layout["xaxis2"]["title"]["text"].startswith("step")
    assert {t["name"].split(" · ")[1]: t.get("xaxis", "x") for t in both.traces} == {
        "timed": "x",
        "short": "x2",
    }
    interval = next(p for p in build_panels([load_run(short)]) if p.id == "tokens_interval")
    assert "interval records in runtime.jsonl" in interval.missing


def test_compare_overlays_runs_with_their_names_and_dashes(tmp_path, rng):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one, _ = make_run(tmp_path / "a", rng)
    two, _ = make_run(tmp_path / "b", rng, steps=2)
    panels = {p.id: p for p in build_panels([load_run(one, "a"), load_run(two, "b")])}
    names = [t["name"] for t in panels["step_time"].traces]
    assert "update · a" in names and "update · b" in names
    groups = {t["stackgroup"] for t in panels["step_time"].traces if "stackgroup" in t}
    assert groups == {"run0", "run1"}  # each run stacks its own split
    dashes = {t["name"]: t["line"]["dash"] for t in panels["reward"].traces}
    assert dashes["mean · a"] != dashes["mean · b"]
    out = tmp_path / "cmp.html"
    assert main(["dashboard", str(one), "--compare", str(two), "--out", str(out)]) == 0
    assert "run (1) vs run (2)" in out.read_text()  # both folders are 'run': numbered


def test_the_page_is_self_contained_and_data_cannot_inject_markup(tmp_path, rng):
    run, _ = make_run(tmp_path, rng)
    hostile = '</script><script>alert("x")</script><!--'
    with (run / "ledger.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 5, "step_s": 1.0, f"reward/{hostile}": 1.0}) + "\n")
    path = write_dashboard(run)
    assert path == run / "dashboard.html"
    page = path.read_text()
    assert hostile not in page and "alert(" not in page.replace('alert(\\"x\\")', "")
    data = page.split('id="dashboard-data">', 1)[1].split("</script>", 1)[0]
    names = [t["name"] for p in json.loads(data)["panels"] for t in p["traces"]]
    assert plotly_text(hostile) in names  # intact once parsed, plotly then draws it as text
    head, library = page.split("<script>/* plotly.js v", 1)
    library, rest = library.split("</script>", 1)
    assert len(library) > 1_000_000  # plotly.js is inline, nothing is loaded at view time
    assert "src=" not in head + rest and "http" not in head + rest
    assert not list(run.glob(".dashboard-*"))  # the atomic write left no temporary file


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("x"), "is not a folder"),
        (lambda p: p.mkdir(), "holds none of ledger.jsonl"),
    ],
)
def test_a_run_folder_that_is_not_one_is_named(tmp_path, capsys, make, message):
    path = tmp_path / "missing-run"
    make(path)
    assert main(["dashboard", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err


def test_values_that_are_not_numbers_are_left_out(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "entropy": "high"}, {"step": 2, "entropy": True}, {"step": 3, "entropy": 2}]
    _write(run / "ledger.jsonl", [json.dumps(r) for r in rows])
    panel = next(p for p in build_panels([load_run(run)]) if p.id == "kl_entropy")
    assert [(t["x"], t["y"]) for t in panel.traces] == [([3], [2])]
    assert math.isfinite(panel.traces[0]["y"][0])


def test_finite_values_whose_arithmetic_overflows_are_gaps(tmp_path):
    """±1.7e308 are finite and valid in a run file, but a quantile between them or a lag
    histogram's sum is not: the page is still written, with gaps there (it was a traceback)."""
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "trajectories.jsonl", [_trajectory(1, -1.7e308), _trajectory(1, 1.7e308)])
    rows = [{"step": s, "step_s": 1, "version_lag_hist": {"0": 1.7e308}} for s in (1, 2)]
    _write(run / "ledger.jsonl", [json.dumps(r) for r in rows])
    page = write_dashboard(run).read_text()  # (plotly.js itself holds the word Infinity)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")


def test_without_plotly_the_command_names_the_extra(tmp_path, rng, monkeypatch, capsys):
    run, _ = make_run(tmp_path, rng)
    monkeypatch.setitem(sys.modules, "plotly", None)  # import of plotly fails
    assert main(["dashboard", str(run)]) == 2
    assert "pip install 'agentrl[dashboard]'" in capsys.readouterr().err


def test_the_page_never_replaces_a_file_it_did_not_write(tmp_path, rng, capsys):
    run, _ = make_run(tmp_path, rng)
    ledger = (run / "ledger.jsonl").read_bytes()
    assert main(["dashboard", str(run), "--out", str(run / "ledger.jsonl")]) == 2
    assert "exists and is not a page agentrl wrote" in capsys.readouterr().err
    assert (run / "ledger.jsonl").read_bytes() == ledger
    assert main(["dashboard", str(run), "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / "dashboard.html").symlink_to(victim)  # the default page's name
    assert main(["dashboard", str(run)]) == 2
    assert "dashboard.html is a symlink" in capsys.readouterr().err
    assert victim.read_text() == "precious\n"
    (run / "dashboard.html").unlink()
    assert main(["dashboard", str(run)]) == main(["dashboard", str(run)]) == 0  # its own page


# -- a run folder someone else made ---------------------------------------------------------------


def test_names_from_the_run_are_text_to_plotly_everywhere(tmp_path, rng):
    """plotly.js reads trace names (legends, hover labels) as HTML: ledger keys, termination
    reasons and run names reach it with ``<``, ``>`` and ``&`` as entities, in every panel."""
    link = '<a href="https://evil.example">x</a>&amp;'
    run, _ = make_run(tmp_path, rng)
    row = {
        "step": 5,
        "step_s": 1.0,
        f"reward/{link}": 1.0,
        f"eval_reward/{link}": 1.0,
        "termination": {f"<span style='font-size:90px'>{link}": 2},
    }
    with (run / "ledger.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    other = tmp_path / "b" / "<i>other&"
    other.parent.mkdir()
    os.rename(make_run(tmp_path / "b", rng)[0], other)
    for runs in ([load_run(run)], [load_run(run), load_run(other)]):
        names = [t["name"] for p in build_panels(runs) for t in p.traces]
        assert not [n for n in names if "<" in n or ">" in n], names
        assert any(plotly_text(link) in n for n in names)
    assert any(n.endswith(" · &lt;i&gt;other&amp;") for n in names)
    assert plotly_text("a<b>&c") == "a&lt;b&gt;&amp;c"


def test_json_too_deep_or_too_large_is_skipped_or_a_gap(tmp_path):
    """Valid JSON a parser cannot hold: nested past the recursion limit (skipped and counted),
    nested just under it (kept), integers too large for a float (gaps)."""
    run = tmp_path / "run"
    run.mkdir()
    huge = 10**400
    rows = [
        '{"step": 1, "kl": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"step": 2, "step_s": 1, "deep": ' + "[" * 900 + "]" * 900 + "}",
        json.dumps({"step": 3, "step_s": 1, "kl": huge, "entropy": 1.0}),
        json.dumps({"step": 4, "step_s": 1, "termination": {"stop": huge}}),
        json.dumps({"step": 5, "step_s": 1, "version_lag_hist": {"0": huge, "1": 2}}),
    ]
    _write(run / "ledger.jsonl", rows)
    _write(run / "runtime.jsonl", [json.dumps({"time_s": huge, "buffer_backlog": huge})])
    deep = '{"reward": 1, "info": {"step": "1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    _write(run / "trajectories.jsonl", [deep, _trajectory(1, 0.5)])
    data = load_run(run)
    assert data.skipped == {"ledger.jsonl": 1, "trajectories.jsonl": 1}
    assert len(data.ledger) == 4 and data.steps[1].rewards == [0.5]
    panels = {p.id: p for p in build_panels([data])}
    entropy = next(t for t in panels["kl_entropy"].traces if t["name"] == "entropy")
    assert entropy["x"] == [3] and not [t for t in panels["kl_entropy"].traces if t["name"] == "kl"]
    assert lag_histogram(data) == {0: 0.0, 1: 2.0}
    assert write_dashboard(run).read_text().rstrip().endswith("</html>")


@pytest.mark.parametrize("kind", ["fifo", "kmsg", "denied"])
def test_a_run_file_that_cannot_be_read_is_one_line(tmp_path, rng, capsys, monkeypatch, kind):
    """A FIFO or ``/proc/kmsg`` under a run file's name (both block a plain read: the
    command hung) or a file it may not read: one line naming it, exit 2, no page."""
    run, _ = make_run(tmp_path, rng)
    target = run / "runtime.jsonl"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
        needle = "runtime.jsonl is not a regular file"
    elif kind == "kmsg":
        if not os.access(KMSG, os.R_OK):
            pytest.skip("needs a readable /proc/kmsg (root)")
        target.symlink_to(KMSG)
        needle = "runtime.jsonl is a file of the kernel's /proc, not a run file"
    else:
        target.write_text("{}\n")
        real_open = os.open

        def denied(file, flags, *args):  # root may read anything: as a user who may not
            if os.fspath(file) == os.fspath(target):
                raise PermissionError(13, "Permission denied")
            return real_open(file, flags, *args)

        monkeypatch.setattr(os, "open", denied)
        needle = "runtime.jsonl: cannot read it (Permission denied)"
    assert main(["dashboard", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert not (run / "dashboard.html").exists()


def test_a_folder_name_that_is_not_utf8_or_holds_escapes(tmp_path, rng, capsys):
    """The page shows U+FFFD for the bytes that are not UTF-8 (writing it failed); the
    terminal line shows them so too, and escape sequences as text."""
    run, _ = make_run(tmp_path, rng)
    odd = tmp_path / os.fsdecode(b"bad\xffname\x1b]0;PWNED\x07")
    os.rename(run, odd)
    assert main(["dashboard", str(odd)]) == 0
    out = capsys.readouterr().out
    assert "bad\ufffdname\\x1b]0;PWNED\\x07" in out and "\x1b" not in out, out
    page = (odd / "dashboard.html").read_text("utf-8")
    assert "bad\ufffdname" in page


def test_a_boolean_step_is_no_step_count(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "ledger.jsonl", [json.dumps({"step": True, "step_s": 1.0, "kl": 0.1})])
    page = render([load_run(run)])
    assert "True steps" not in page and "no training step yet" in page


@pytest.mark.parametrize(("lags", "ticks"), [(("0", "3"), 1), (("0", "1000000000000000"), None)])
def test_the_lag_axis_ticks_every_version_only_over_a_short_range(tmp_path, lags, ticks):
    """A histogram spanning 1e15 versions with a tick per version took the page 40 s."""
    run = tmp_path / "run"
    run.mkdir()
    _write(
        run / "ledger.jsonl", [json.dumps({"step": 1, "version_lag_hist": dict.fromkeys(lags, 1)})]
    )
    panel = next(p for p in build_panels([load_run(run)]) if p.id == "version_lag")
    assert panel.layout["xaxis"].get("dtick") == ticks
    assert panel.traces[0]["x"] == [int(lag) for lag in lags]


def test_steps_past_what_a_browser_holds_are_left_out(tmp_path):
    """A run file someone else made, with a step of 400 digits (or 2**70): JSON carried it as
    an integer the browser read as Infinity ("Expected number, NaN" from every path drawn
    with it), and the header counted it as the run's steps."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "step_s": 1.0, "kl": 0.1}, {"step": int("9" * 400), "step_s": 1.0},
            {"step": 2**70, "step_s": 1.0, "kl": 0.2}]  # fmt: skip
    _write(run / "ledger.jsonl", [json.dumps(r) for r in rows])
    huge = json.loads(_trajectory(1, 0.5))
    huge["info"]["step"] = "9" * 400
    _write(run / "trajectories.jsonl", [_trajectory(1, 0.5), json.dumps(huge)])
    loaded = load_run(run)
    assert [r["step"] for r in loaded.ledger] == [1, None, None]
    assert set(loaded.steps) == {1}
    page = render([loaded])
    assert "9" * 40 not in page and str(2**70) not in page
    assert "1 steps" in page


def test_keys_a_run_names_itself_are_read_in_one_pass_and_capped(tmp_path, monkeypatch):
    """A reward-breakdown key (or termination reason) per task: a scan of the ledger per key
    was quadratic (8,000 rows: 25 s; a 47 MB page for 2,000 reasons). The keys with the most
    points are drawn, at most MAX_KEYED_TRACES; a line past MAX_RECORD_BYTES is skipped and
    counted, and lists in a record are not kept."""
    import agentrl.dashboard._read as read
    from agentrl.dashboard._panels import MAX_KEYED_TRACES

    run = tmp_path / "run"
    run.mkdir()
    rows = [
        json.dumps({"step": s, "step_s": 1, "reward/common": 0.5, f"reward/task{s}": 1.0,
                    "termination": {"stop": 1, f"cut{s}": 2}, "task_ids": ["t"] * 50})
        for s in range(1, 101)
    ]  # fmt: skip
    monkeypatch.setattr(read, "MAX_RECORD_BYTES", 2000)
    rows.append(json.dumps({"step": 101, "step_s": 1, "junk": "x" * 3000}))
    _write(run / "ledger.jsonl", rows)
    data = load_run(run)
    assert data.skipped == {"ledger.jsonl": 1} and len(data.ledger) == 100
    assert "task_ids" not in data.ledger[0]
    panels = {p.id: p for p in build_panels([data])}
    names = [t["name"] for t in panels["reward_breakdown"].traces]
    assert len(names) == MAX_KEYED_TRACES and "common" in names
    common = next(t for t in panels["reward_breakdown"].traces if t["name"] == "common")
    assert common["x"] == list(range(1, 101))
    reasons = {t["name"]: t for t in panels["termination"].traces}
    assert len(reasons) == MAX_KEYED_TRACES and reasons["stop"]["y"] == [1] * 100
    cut = next(t for name, t in reasons.items() if name.startswith("cut"))
    assert cut["x"] == list(range(1, 101)) and sorted(cut["y"]) == [0] * 99 + [2]
