"""Every user command end to end, as a subprocess, the way a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl import read_trajectories

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "120"}


def agentrl(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("run") / "x"
    proc = agentrl(
        "rollout",
        "--env", "calc-v0",
        "--model", "tiny-random",
        "-n", "2",
        "--group", "2",
        "--max-turns", "2",
        "--max-new-tokens", "24",
        "--out", str(out),
        "--dry-run",
        "--check",
    )  # fmt: skip
    return proc, out


def test_rollout_dry_run_check(tiny_run):
    proc, out = tiny_run
    assert proc.returncode == 0, proc.stderr + proc.stdout
    trajectories = read_trajectories(str(out / "trajectories.jsonl"))
    assert len(trajectories) == 4
    assert len({t.group_id for t in trajectories}) == 2
    for t in trajectories:
        t.validate()
        assert t.model == "tiny-random" and t.tokenizer_fingerprint
        assert t.sampling.seed is not None and t.sampling.temperature == 1.0
    assert "boundary check: all 4 trajectories match the re-render" in proc.stdout
    assert "rollout summary" in proc.stdout and "legend" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["env"] == "calc-v0" and config["rollout"]["group_size"] == 2
    assert (out / "report.html").stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories"] == 4
    assert summary["model_tokens"] == sum(sum(t.loss_mask) for t in trajectories)


def test_inspect_rerenders_and_checks(tiny_run, tmp_path):
    _, out = tiny_run
    html = tmp_path / "again.html"
    proc = agentrl("inspect", str(out / "trajectories.jsonl"), "--html", str(html), "--check")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert html.is_file() and "boundary check: all 4" in proc.stdout


def test_inspect_check_fails_on_a_tampered_trajectory(tiny_run, tmp_path):
    _, out = tiny_run
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    template = next(s for s in first["spans"] if s["source"] == "template")
    first["token_ids"][template["start"]] = 11  # corrupt one template token
    bad = tmp_path / "trajectories.jsonl"
    bad.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    proc = agentrl("inspect", str(bad), "--model", "tiny-random", "--check")
    assert proc.returncode == 1
    assert f"first divergence at token {template['start']}" in proc.stdout


def test_envs_list_and_show():
    listing = agentrl("envs", "list")
    assert listing.returncode == 0 and "calc-v0" in listing.stdout
    shown = agentrl("envs", "show", "calc-v0")
    assert shown.returncode == 0 and "calculator" in shown.stdout and "eval" in shown.stdout
    missing = agentrl("envs", "show", "cals-v0")
    assert missing.returncode == 2 and "Did you mean: calc" in missing.stderr


def test_models_list_and_doctor(tiny_model_path):
    models = agentrl("models", "list")
    assert models.returncode == 0 and "tiny-random" in models.stdout
    doctor = agentrl("doctor")
    assert (
        doctor.returncode == 0 and "torch" in doctor.stdout and "model tiny-random" in doctor.stdout
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--env-kwargs", "{bad"], "--env-kwargs is not valid JSON"),
        (["--top-k", "0"], "top_k"),
        (["--env", "nope-v0"], "no environment named 'nope'"),
        (["--model", "/does/not/exist"], "'/does/not/exist' is neither a registered model"),
        (["--env-kwargs", '{"levels": [9]}'], "levels must be a non-empty subset"),
    ],
)
def test_bad_input_gets_a_clear_error(args, needle, tmp_path):
    base = {"--env": "calc-v0", "--model": "tiny-random", "-n": "1", "--out": str(tmp_path)}
    for key, value in zip(args[::2], args[1::2], strict=True):
        base[key] = value
    flat = [x for kv in base.items() for x in kv]
    proc = agentrl("rollout", *flat)
    # a broken env constructor is data (an error trajectory), everything else exits 2
    text = proc.stderr + proc.stdout
    assert needle in text, text
    assert proc.returncode in (0, 2)
    if proc.returncode == 0:
        (traj,) = read_trajectories(str(tmp_path / "trajectories.jsonl"))
        assert traj.status == "error" and needle in traj.error.message


def test_readme_example_runs_as_is(tiny_model_path):
    proc = subprocess.run(
        [sys.executable, "examples/echo_env.py"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("echo-v0/") == 4


def test_module_prefixed_env_id_from_the_command_line(tmp_path, tiny_model_path):
    proc = agentrl(
        "rollout",
        "--env", "examples.echo_env:echo-v0",
        "--model", "tiny-random",
        "-n", "1",
        "--out", str(tmp_path),
        "--check",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert len(read_trajectories(str(tmp_path / "trajectories.jsonl"))) == 1


@pytest.mark.slow
def test_rollout_on_smollm2(tmp_path):
    proc = agentrl(
        "rollout",
        "--env", "calc-v0",
        "--model", "smollm2-135m",
        "-n", "2",
        "--group", "2",
        "--max-turns", "2",
        "--max-new-tokens", "48",
        "--out", str(tmp_path),
        "--dry-run",
        "--check",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    trajectories = read_trajectories(str(tmp_path / "trajectories.jsonl"))
    assert len(trajectories) == 4
    assert all(t.status != "error" for t in trajectories)
    assert all(sum(t.loss_mask) > 0 for t in trajectories)


@pytest.mark.parametrize("env_id", ["python-math-v0", "code-tests-v0"])
def test_rollout_with_a_local_sandbox(env_id, tmp_path, tiny_model_path):
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is not installed (scripts/services start installs it)")
    proc = agentrl(
        "rollout",
        "--env", env_id,
        "--model", "tiny-random",
        "-n", "1",
        "--group", "2",
        "--max-turns", "2",
        "--max-new-tokens", "16",
        "--sandbox", "local",
        "--out", str(tmp_path),
        "--check",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    trajectories = read_trajectories(str(tmp_path / "trajectories.jsonl"))
    assert len(trajectories) == 2 and all(t.status != "error" for t in trajectories)


def test_bad_sandbox_spec_is_a_clear_error(tmp_path, tiny_model_path):
    proc = agentrl(
        "rollout",
        "--env", "python-math-v0",
        "--model", "tiny-random",
        "-n", "1",
        "--sandbox", "nonsense",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "nonsense" in proc.stderr


@pytest.mark.parametrize(
    ("engine", "needle", "code"),
    [
        ({"max_batch_size": 2, "device": "cpu"}, None, 0),
        ({"device": "tpu"}, "device must be", 2),
        ({"max_batch": 2}, "engine.max_batch: Extra inputs are not permitted", 2),
    ],
)
def test_rollout_reads_the_engine_section_of_the_config(engine, needle, code, tmp_path):
    """``agentrl rollout --config F`` opens the embedded engine with F's ``engine`` section
    (the same section ``agentrl train`` reads): a bad device or field is named."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"rollout": {"max_new_tokens": 8}, "engine": engine}))
    proc = agentrl("rollout", "--env", "calc-v0", "--model", "tiny-random", "-n", "1",
                   "--config", str(config), "--out", str(tmp_path / "run"))  # fmt: skip
    text = proc.stderr + proc.stdout
    assert proc.returncode == code, text
    if needle:
        assert needle in text, text
    else:
        assert len(read_trajectories(str(tmp_path / "run" / "trajectories.jsonl"))) >= 1
