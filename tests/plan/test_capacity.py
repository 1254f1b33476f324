"""``agentrl plan capacity``: the simulated schedule against closed-form cases of the runtime's
rules, the actor search, and calibration from a real training run's folder."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from agentrl.cli import main
from agentrl.plan._capacity import CapacitySettings, plan_capacity, simulate

BASE = dict(
    actor_tokens_per_s=1000.0,
    learner_tokens_per_s=4000.0,
    gen_tokens=200.0,
    learner_tokens=400.0,
    group_size=4,
    tasks_per_step=8,
    publish_s=0.25,
    concurrency=64,
    steps=30,
)
GEN_S = 8 * 4 * 200 / 1000  # one actor generates a step in 6.4 s
LEARN_S = 8 * 4 * 400 / 4000 + 0.25  # the learner trains and publishes one in 3.45 s


def settings(**kw) -> CapacitySettings:
    return CapacitySettings(**{**BASE, "max_version_lag": 1, **kw})


def test_sync_is_generation_then_training():
    r = simulate(settings(max_version_lag=0), actors=1)
    assert r.step_s == pytest.approx(GEN_S + LEARN_S, rel=1e-9)
    assert r.learner_idle_fraction == pytest.approx(GEN_S / (GEN_S + LEARN_S), rel=1e-9)
    assert r.actor_idle_fraction == pytest.approx(LEARN_S / (GEN_S + LEARN_S), rel=1e-9)
    assert r.lag_hist == {0: 1.0}


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_async_with_slow_actors_overlaps_training(lag):
    r = simulate(settings(max_version_lag=lag), actors=1)
    assert r.step_s == pytest.approx(GEN_S, rel=1e-9)  # the learner hides behind generation
    assert r.actor_idle_fraction == pytest.approx(0.0, abs=1e-9)
    assert r.learner_idle_fraction == pytest.approx(1 - LEARN_S / GEN_S, rel=1e-9)


@pytest.mark.parametrize("lag", [1, 2])
def test_with_many_actors_the_learner_is_the_bottleneck_and_lag_hits_the_bound(lag):
    r = simulate(settings(max_version_lag=lag), actors=16)
    assert r.step_s == pytest.approx(LEARN_S, rel=1e-9)
    assert r.learner_idle_fraction == pytest.approx(0.0, abs=1e-9)
    assert r.bottleneck == "learner"
    assert r.lag_hist == {lag: 1.0}  # actors run the whole bound ahead
    assert r.backlog_max == lag * 8  # k steps of groups wait, never more


def test_limited_concurrency_delays_starts_and_lowers_the_lag():
    wide = simulate(settings(max_version_lag=2), actors=1)
    narrow = simulate(settings(max_version_lag=2, concurrency=8), actors=1)
    assert narrow.lag_mean < wide.lag_mean


def test_the_plan_is_the_fewest_actors_that_keep_the_learner_busy():
    s = settings(max_version_lag=1)
    best, tried = plan_capacity(s)
    assert simulate(s, best).learner_idle_fraction <= 0.05
    assert simulate(s, best - 1).learner_idle_fraction > 0.05
    assert best in [r.actors for r in tried]


def test_the_command_prints_the_plan_as_json(capsys):
    argv = ["plan", "capacity", "--json", "--max-version-lag", "1", "--actors", "3"]
    for key, value in BASE.items():
        if key != "steps":
            argv += ["--" + key.replace("_", "-"), str(value)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended_actors"] == plan_capacity(settings())[0]
    assert out["evaluated"]["actors"] == 3
    assert out["evaluated"]["step_s"] == pytest.approx(LEARN_S, rel=1e-9)


RATES = ["--actor-tokens-per-s", "100", "--learner-tokens-per-s", "100", "--gen-tokens", "10",
         "--learner-tokens", "20", "--group-size", "2", "--tasks-per-step", "2"]  # fmt: skip


def test_a_run_config_that_is_not_utf8_is_named(tmp_path, capsys):
    (tmp_path / "config.yaml").write_bytes(b"train: {}\nmodel: \xff\n")
    assert main(["plan", "capacity", "--from-run", str(tmp_path)]) == 2
    assert "config.yaml: line 2: not UTF-8 text" in capsys.readouterr().err


def test_run_files_that_are_not_regular_or_not_utf8(tmp_path, capsys):
    """A ledger that is a device (it was read until memory ran out) or a FIFO (it would block)
    is refused before it is opened; a line that is not UTF-8 is skipped like a torn one (it was
    a traceback). A model config that is a device is refused the same way."""
    (tmp_path / "config.yaml").write_text("train: {}\n")
    (tmp_path / "ledger.jsonl").symlink_to("/dev/zero")
    assert main(["plan", "capacity", "--from-run", str(tmp_path)]) == 2
    assert "ledger.jsonl is not a regular file" in capsys.readouterr().err
    (tmp_path / "ledger.jsonl").unlink()
    (tmp_path / "ledger.jsonl").write_bytes(b'{"step": 1, \xff}\n')
    assert main(["plan", "capacity", "--from-run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert main(["plan", "memory", "--model", "/dev/zero"]) == 2
    assert "/dev/zero: not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"--actor-tokens-per-s": "1e-300", "--learner-tokens-per-s": "1e300"},
         "a group takes group_size × gen_tokens / actor_tokens_per_s = 2 × 10 / 1e-300 = 2e+301 s"),
        ({"--gen-tokens": "1e308"}, "= 2 × 1e+308 / 100 = inf s on one actor"),
        ({"--actor-tokens-per-s": "1e-310"}, "/ 1e-310 = inf s on one actor"),
        ({"--learner-tokens-per-s": "1e-320"}, "a step trains tasks_per_step × group_size × "),
        ({"--learner-tokens-per-s": "1e300"}, "= 4 × 20 / 1e+300 = 8e-299 s: must be"),
        ({"--publish-s": "1e308"}, "publish_s 1e+308 s: must be between 1e-09 and 1e+09 s"),
    ],
)  # fmt: skip
def test_rates_beyond_any_run_are_refused_naming_the_time_they_make(capsys, changed, message):
    """Finite rates whose times overflow (or vanish) left the simulated clock stuck on NaN: the
    plan never returned, or printed NaN rows and a recommendation. Refused at once."""
    flags = dict(zip(RATES[::2], RATES[1::2], strict=True)) | changed
    began = time.monotonic()
    assert main(["plan", "capacity", *[x for kv in flags.items() for x in kv]]) == 2
    assert time.monotonic() - began < 10
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_target_no_actor_count_meets_is_said_so(capsys):
    """Actors far too slow for the learner: even the most actors tried leave the learner idle,
    and the plan says so (with the count the rates call for) instead of recommending them."""
    rates = ["--actor-tokens-per-s", "1", "--gen-tokens", "1000", "--learner-tokens-per-s",
             "100000", "--learner-tokens", "1000", "--group-size", "8", "--tasks-per-step", "4",
             "--max-version-lag", "0"]  # fmt: skip
    assert main(["plan", "capacity", *rates]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "recommended:" not in out
    assert "no count up to 256 actors keeps the learner idle at most 5% of the time (with " \
           "256: 100%); the rates call for about 1e+05 actors" in out  # fmt: skip
    assert main(["plan", "capacity", *rates, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target_met"] is False and plan["recommended_actors"] == 256


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gen-tokens", "10"], "needs --actor-tokens-per-s, --learner-tokens-per-s"),
        (["--from-run", "/nonexistent/run"], "cannot read config.yaml"),
        ([*RATES[:1], "inf", *RATES[2:]], "actor_tokens_per_s inf: must be a finite number"),
        ([*RATES, "--publish-s", "nan"], "publish_s nan: must be a finite number"),
        ([*RATES, "--steps", "100000000"], "steps 100000000: at most 10000"),
        ([*RATES, "--max-version-lag", "1000000000"], "max_version_lag 1000000000: at most"),
    ],
)
def test_missing_rates_and_bad_runs_are_named(capsys, argv, message):
    assert main(["plan", "capacity", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_calibrates_from_a_real_async_run(tiny_async_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_async_run, run)
    with (run / "ledger.jsonl").open("a") as f:
        f.write('{"step": 9, "torn')  # a killed run's last line: skipped, not fatal
    assert main(["plan", "capacity", "--from-run", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["settings"]
    assert (s["group_size"], s["tasks_per_step"], s["max_version_lag"]) == (2, 2, 1)
    assert s["concurrency"] == 8 and s["gen_tokens"] <= 8
    assert out["measured"]["steps"] == 2  # steps 2 and 3: start-up and drain left out
    assert out["evaluated"]["actors"] == 1
    assert set(out["measured"]["lag_hist"]) <= {"0", "1"}
    # the page rewritten after step 2 (dashboard_every_steps: 2) is on step 3's record
    ledger = [
        json.loads(line) for line in (tiny_async_run / "ledger.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in ledger if r.get("dashboard_s", 0) > 0] == [3], ledger


# -- a run folder someone else made: every value checked, the work bounded -------------------------

CONFIG = (
    "rollout:\n  group_size: 2\ntrain:\n  tasks_per_step: 2\n  mode: async\n  max_version_lag: 1\n"
)


def _step(number: int, **kw) -> dict:
    row = {"step": number, "step_s": 2.0, "update_s": 1.0, "trajectories": 4,
           "trajectories_trained": 4, "gen_tokens": 40, "learner_tokens": 80,
           "actor_idle_fraction": 0.5, "version_lag_hist": {"0": 2}}  # fmt: skip
    return {**row, **kw}


def _run(tmp_path, config: str = CONFIG, bad: dict | None = None, runtime: list | None = None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config)
    rows = [_step(1), _step(2, **(bad or {})), _step(3), _step(4)]
    (run / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if runtime is not None:
        (run / "runtime.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runtime))
    return run


def test_a_well_formed_run_calibrates(tmp_path, capsys):
    run = _run(tmp_path, runtime=[{"step": 2, "buffer_backlog": 3}])
    assert main(["plan", "capacity", "--from-run", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["group_size"] == 2 and out["measured"]["backlog_mean"] == 3


@pytest.mark.parametrize(
    ("config", "bad", "runtime", "needle"),
    [
        (
            None,
            {"gen_tokens": "abc"},
            None,
            "ledger.jsonl: line 2: gen_tokens: 'abc': expected a number",
        ),
        (None, {"step_s": None}, None, "ledger.jsonl: line 2: step_s: missing"),
        (
            None,
            {"step_s": float("nan")},
            None,
            "line 2: step_s: nan: expected a finite number >= 0",
        ),
        (None, {"step_s": True}, None, "line 2: step_s: True: expected a number"),
        (None, {"gen_tokens": 10**400}, None, "line 2: gen_tokens: "),
        (None, {"gen_tokens": 1e307}, None, "gen_tokens: 1e+307: expected a number up to 1e+15"),
        (None, {"step_s": 1e300}, None, "line 2: step_s: 1e+300: expected a number up to 1e+15"),
        (None, {"step": None}, [], "ledger.jsonl: line 2: step: missing"),
        (None, {"version_lag_hist": {"x": 1}}, None, "version_lag_hist: 'x': expected lags"),
        (None, {"version_lag_hist": {" 1_0 ": 1}}, None, "version_lag_hist: ' 1_0 ': expected"),
        (None, {"version_lag_hist": [1, 2]}, None, "version_lag_hist: [1, 2]: expected a mapping"),
        (
            None,
            {"version_lag_hist": {"0": "x"}},
            None,
            "version_lag_hist.0: 'x': expected a number",
        ),
        (None, {"actor_idle_fraction": "x"}, None, "actor_idle_fraction: 'x': expected a number"),
        (None, None, [{"step": "1"}], "runtime.jsonl: line 1: step: '1': expected an integer"),
        (None, None, [{"step": 2, "buffer_backlog": []}], "runtime.jsonl: line 1: buffer_backlog"),
        ("rollout:\n  group_size: eight\n", None, None, "config.yaml: rollout.group_size: 'eight'"),
        ("rollout:\n  group_size: true\n", None, None, "rollout.group_size: True: expected an"),
        # 4,000 digits each: their product overflowed the 4,300-digit text limit (a traceback)
        (
            "rollout:\n  group_size: "
            + "9" * 4000
            + "\ntrain:\n  tasks_per_step: "
            + "9" * 4000
            + "\n",
            None,
            None,
            "rollout.group_size: 9999",
        ),
        ("rollout:\n  group_size: 0\n", None, None, "expected an integer from 1 to 1000000000"),
        ("train: [1]\n", None, None, "config.yaml: train: [1]: expected a mapping"),
        ("server:\n  urls: http://x\n", None, None, "server.urls: 'http://x': expected a list"),
    ],
)
def test_a_malformed_run_value_is_one_line_naming_it(
    tmp_path, capsys, config, bad, runtime, needle
):
    run = _run(tmp_path, config or CONFIG, bad, runtime)
    assert main(["plan", "capacity", "--from-run", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "config",
    [
        "rollout:\n  group_size: 1\ntrain:\n  tasks_per_step: 1000000\n",
        "rollout:\n  group_size: 1000\ntrain:\n  tasks_per_step: 1000\n  mode: async\n"
        "  max_version_lag: 10000\n",
    ],
)
def test_the_simulated_work_is_bounded(tmp_path, capsys, config):
    """A run's config sized the simulation: tasks_per_step 1e6 ran for minutes, a lag of 1e4
    over 1000 tasks took gigabytes. Refused at once with the bound."""
    run = _run(tmp_path, config)
    began = time.monotonic()
    assert main(["plan", "capacity", "--from-run", str(run)]) == 2
    assert time.monotonic() - began < 10
    err = capsys.readouterr().err
    assert "groups to simulate: at most 200000" in err and err.count("\n") == 1, err


def test_a_large_simulation_within_the_bound_takes_seconds():
    """Every event used to scan every group finished so far (quadratic): at the bound with
    many actors a plan took far longer than it was worth."""
    s = settings(tasks_per_step=4000, group_size=1, max_version_lag=8, steps=40)
    began = time.monotonic()
    simulate(s, actors=64)
    assert time.monotonic() - began < 20


@pytest.mark.skipif(not os.access("/proc/kmsg", os.R_OK), reason="needs a readable /proc/kmsg")
@pytest.mark.parametrize("name", ["ledger.jsonl", "runtime.jsonl", "config.yaml"])
def test_a_run_file_that_would_block_is_refused(tmp_path, capsys, name):
    run = _run(tmp_path, runtime=[])
    (run / name).unlink()
    (run / name).symlink_to("/proc/kmsg")
    assert main(["plan", "capacity", "--from-run", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{name} is a file of the kernel's /proc, not a run file" in err, err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-version-lag", "-1", "max_version_lag -1: must be >= 0"),
        ("--publish-s", "-0.5", "publish_s -0.5: must be >= 0"),
    ],
)
def test_a_negative_setting_is_named_with_its_value(capsys, flag, value, message):
    rates = ["--actor-tokens-per-s", "500", "--learner-tokens-per-s", "2000", "--gen-tokens", "100"]
    rates += ["--learner-tokens", "300", "--group-size", "8", "--tasks-per-step", "4"]
    assert main(["plan", "capacity", *rates, flag, value]) == 2
    assert message in capsys.readouterr().err
