"""The dashboard of a real (tiny) training run, drawn by Debian's headless Chromium: every
panel with data has its plot, the others say why not, no console errors, nothing fetched
from the network, and a screenshot of the page in the test's folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from browser import visit

from agentrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
PANELS = """window.agentrlDashboard.then(() => Array.from(
  document.querySelectorAll("section.panel")).map(s => ({
    id: s.dataset.panel, data: s.dataset.hasData === "true", drawn: s.dataset.drawn === "true",
    traces: s.querySelectorAll(".plot g.trace").length,
    svg: s.querySelectorAll(".plot svg.main-svg").length,
    empty: (s.querySelector(".no-data") || {}).textContent || null})))"""
# what an async run of vowels-v0 writes (a plain float reward, no tool runs, no sandbox)
WITH_DATA = {
    "reward", "eval", "kl_entropy", "clip", "mismatch", "tokens_interval", "tokens_step",
    "backlog", "version_lag", "discarded", "step_time", "publish", "tools", "termination", "idle",
}  # fmt: skip
WITHOUT_DATA = {"reward_breakdown", "sandbox_latency", "sandbox_failures"}


@pytest.fixture(scope="module")
def trained_run(tiny_async_run) -> Path:
    """A 4-step async run that rewrote its dashboard every 2 steps (``tiny_async_run``)."""
    return tiny_async_run


def _check_page(chromium: str, page: Path, shot: Path) -> list[dict]:
    seen = visit(chromium, page, PANELS, screenshot=shot)
    print(f"dashboard screenshot: {seen.screenshot}")
    assert seen.errors == []
    assert all(url.startswith(("file:", "data:", "blob:")) for url in seen.requests), seen.requests
    assert shot.stat().st_size > 50_000  # a page of plots, not a blank one
    for panel in seen.value:
        if panel["data"]:
            assert panel["drawn"] and panel["svg"] >= 1 and panel["traces"] >= 1, panel
        else:
            assert panel["empty"].startswith("No data in this run"), panel
            assert panel["svg"] == 0, panel
    return seen.value


@pytest.mark.slow
def test_the_trainer_writes_a_dashboard_chromium_draws(
    trained_run, chromium, tmp_path, record_property
):
    page = trained_run / "dashboard.html"
    assert "4 steps" in page.read_text()  # rewritten after the last step
    shot = tmp_path / "dashboard.png"
    record_property("screenshot", str(shot))
    panels = {p["id"]: p for p in _check_page(chromium, page, shot)}
    drawn = {k for k, p in panels.items() if p["data"]}
    assert drawn == WITH_DATA and set(panels) - drawn == WITHOUT_DATA


def test_the_browser_harness_reports_console_errors_and_exceptions(chromium, tmp_path):
    page = tmp_path / "bad.html"
    page.write_text(
        "<!DOCTYPE html><html><body><script>console.error('drawn badly');"
        "window.agentrlDashboard = Promise.resolve(1); null.x;</script></body></html>"
    )
    seen = visit(chromium, page, "window.agentrlDashboard")
    assert seen.value == 1
    assert seen.errors[0] == "console: drawn badly" and "TypeError" in seen.errors[1]


@pytest.mark.slow
def test_compare_overlays_two_runs_in_chromium(trained_run, chromium, tmp_path, record_property):
    other = tmp_path / "shorter"
    shutil.copytree(trained_run, other)
    lines = (other / "ledger.jsonl").read_text().splitlines()
    (other / "ledger.jsonl").write_text("\n".join(lines[:2]) + '\n{"step": 3, "to')  # torn
    out = tmp_path / "compare.html"
    argv = ["dashboard", str(trained_run), "--compare", str(other), "--out", str(out)]
    assert main(argv) == 0
    assert "shorter/ledger.jsonl: 1 unreadable line skipped" in out.read_text()
    shot = tmp_path / "compare.png"
    record_property("screenshot", str(shot))
    panels = {p["id"]: p for p in _check_page(chromium, out, shot)}
    assert panels["step_time"]["traces"] > 8  # both runs' splits


LEGENDS = """window.agentrlDashboard.then(() => ({
  links: document.querySelectorAll("section.panel .plot a").length,
  styled: document.querySelectorAll("section.panel .plot .legendtext tspan[style]").length,
  legends: Array.from(document.querySelectorAll("section.panel .plot .legendtext"))
    .map(e => e.textContent)}))"""


def test_names_from_the_run_are_drawn_as_text_in_chromium(chromium, tmp_path):
    """plotly.js draws trace names as its HTML subset: a ledger key or a termination reason
    written as a link or a styled span became a live link and 60px text in the legend."""
    import json

    link = '<a href="https://evil.example">verify</a>&amp;'
    span = '<span style="font-size:60px">BIG</span>'
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": s, "step_s": 1.0, f"reward/{link}": 0.5, "reward/format": 1.0,
         f"eval_reward/{span}": 0.1, "eval_reward_mean": 0.2,
         "termination": {span: s, "stop": 1}, "version_lag_hist": {"0": 1, "1000000000000000": 1}}
        for s in (1, 2)
    ]  # fmt: skip
    (run / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "page.html"
    assert main(["dashboard", str(run), "--out", str(out)]) == 0
    seen = visit(chromium, out, LEGENDS)
    assert seen.errors == []
    assert seen.value["links"] == 0 and seen.value["styled"] == 0, seen.value
    legends = seen.value["legends"]
    assert link in legends and span in legends and f"reward/{span}" in legends, legends
