"""Every user command end to end, as a subprocess, the way a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from agentrl import read_trajectories

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "120"}
# faulty_envs (slow-v0, broken-reward-v0) lives next to the trainer tests
FAULTY = {**ENV, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "trainer"),
                                                  os.environ.get("PYTHONPATH", "")])}  # fmt: skip


def agentrl(
    *args: str, cwd: Path = REPO, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *args],
        cwd=cwd,
        env=env or ENV,
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


def test_inspect_html_never_replaces_a_file_it_did_not_write(tiny_run, tmp_path):
    _, out = tiny_run
    copy = tmp_path / "trajectories.jsonl"
    copy.write_bytes((out / "trajectories.jsonl").read_bytes())
    proc = agentrl("inspect", str(copy), "--html", str(copy))
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert f"{copy} exists and is not a page agentrl wrote" in proc.stderr
    assert copy.read_bytes() == (out / "trajectories.jsonl").read_bytes()


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


def test_the_working_directory_is_searched_last(tmp_path):
    """The installed ``agentrl`` command (not ``python -m``, which puts the working directory
    first itself) imports an env module from the working directory, but a file there named
    like a library agentrl imports (a planted ``rich.py`` in a downloaded run folder) never
    runs in its place."""
    command = Path(sys.executable).with_name("agentrl")
    assert command.exists(), command
    for name in ("rich", "yaml", "torch", "transformers", "numpy", "msgspec", "pydantic"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('planted module ran')\n")
    (tmp_path / "my_local_env.py").write_text(
        "from examples.echo_env import *  # noqa: F403  (registers echo-v0 on import)\n"
    )
    env = {**ENV, "PYTHONPATH": str(REPO)}
    for args in (["envs", "list"], ["envs", "show", "my_local_env:echo-v0"]):
        proc = subprocess.run(
            [str(command), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0 and "planted" not in proc.stdout + proc.stderr, proc


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
        (["--task-offset", "-5"], "task_offset must be an integer >= 0, got -5"),
        (["--show", "-1"], "--show must be >= 0, got -1"),
    ],
)
def test_bad_input_gets_a_clear_error(args, needle, tmp_path):
    base = {"--env": "calc-v0", "--model": "tiny-random", "-n": "1", "--out": str(tmp_path)}
    for key, value in zip(args[::2], args[1::2], strict=True):
        base[key] = value
    flat = [x for kv in base.items() for x in kv]
    proc = subprocess.run(
        [sys.executable, "-c", _REPORTS_TORCH, "rollout", *flat],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # every one exits 2 before the engine (torch) is even imported and writes nothing: the
    # env's arguments too are checked before a model is fetched or loaded
    text = proc.stderr + proc.stdout
    assert needle in text, text
    assert proc.returncode == 2, text
    assert "torch imported: False" in proc.stderr, text
    assert not (tmp_path / "trajectories.jsonl").exists()


# ``agentrl ARGS...``, then whether torch was imported on the way out (on stderr)
_REPORTS_TORCH = """
import runpy, sys
sys.argv = ["agentrl", *sys.argv[1:]]
try:
    runpy.run_module("agentrl.cli", run_name="__main__")
finally:
    print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


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
    ("config", "flag", "needle"),
    [
        (None, None, "python-math-v0 runs code in a sandbox and none is configured: set "
                     "`sandbox:`"),
        ({"sandbox": "nonsense"}, None, "sandbox: unknown sandbox 'nonsense'"),
        ({"sandbox": {"size": 0}}, None, "sandbox.size"),
        ({"sandbox": "local"}, "bogus", "--sandbox: unknown sandbox 'bogus'"),  # the flag wins
    ],
)  # fmt: skip
def test_the_rollout_sandbox_comes_from_the_flag_or_the_config(tmp_path, config, flag, needle):
    """Refused before the model is loaded (the model named does not exist)."""
    args = ["rollout", "--env", "python-math-v0", "--model", "no-such-model", "-n", "1"]
    if config is not None:
        (tmp_path / "run.yaml").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "run.yaml")]
    if flag is not None:
        args += ["--sandbox", flag]
    proc = agentrl(*args, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert needle in proc.stderr, proc.stderr


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


# -- run directories are never overwritten by accident ------------------------------------------


def _rollout(out: Path, *extra: str, n: int = 1) -> subprocess.CompletedProcess:
    return agentrl("rollout", "--env", "calc-v0", "--model", "tiny-random", "-n", str(n),
                   "--group", "2", "--max-turns", "1", "--max-new-tokens", "6",
                   "--out", str(out), *extra)  # fmt: skip


def test_rollout_refuses_a_run_directory_unless_told_to_overwrite_or_append(
    tmp_path, tiny_model_path
):
    out = tmp_path / "run"
    assert _rollout(out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    again = _rollout(out)
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"--out {out} already holds a rollout" in again.stderr
    assert "--overwrite" in again.stderr and "--append" in again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "a refused run wrote"

    # --append: one more task and the first task's group grows; ids stay unique and the
    # summary covers every trajectory in the directory
    appended = _rollout(out, "--append", "--concurrency", "3", n=2)
    assert appended.returncode == 0, appended.stdout + appended.stderr
    trajs = read_trajectories(str(out / "trajectories.jsonl"))
    ids = [t.id for t in trajs]
    assert len(ids) == 6 == len(set(ids)), ids
    first_task = trajs[0].group_id
    assert sorted(t.sample_index for t in trajs if t.group_id == first_task) == [0, 1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories"] == 6
    assert summary["model_tokens"] == sum(sum(t.loss_mask) for t in trajs)
    config = json.loads((out / "config.json").read_text())
    assert config["n"] == 1 and [a["n"] for a in config["appended"]] == [2]

    # an append that would sample differently is refused, naming what differs
    other = _rollout(out, "--append", "--temperature", "0.5")
    assert other.returncode == 2
    assert "rollout.temperature: 1.0 → 0.5" in other.stderr, other.stderr
    assert len(read_trajectories(str(out / "trajectories.jsonl"))) == 6

    # --overwrite replaces the rollout
    fresh = _rollout(out, "--overwrite")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert len(read_trajectories(str(out / "trajectories.jsonl"))) == 2
    assert "appended" not in json.loads((out / "config.json").read_text())
    assert json.loads((out / "summary.json").read_text())["trajectories"] == 2

    both = _rollout(out, "--overwrite", "--append")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_a_rollout_from_before_a_field_existed_takes_appends_that_sample_as_it_did(
    tmp_path, tiny_model_path
):
    """A rollout written before ``rollout.max_tool_output_chars`` existed ran without the cap:
    an append with the new default is refused naming both values, one that sets the field to
    null (no cap, as it ran) goes on."""
    out = tmp_path / "run"
    assert _rollout(out).returncode == 0
    config = json.loads((out / "config.json").read_text())
    del config["rollout"]["max_tool_output_chars"]  # as an older agentrl wrote it
    (out / "config.json").write_text(json.dumps(config))

    refused = _rollout(out, "--append")
    assert refused.returncode == 2
    assert "rollout.max_tool_output_chars: null → 1048576" in refused.stderr, refused.stderr
    uncapped = tmp_path / "uncapped.yaml"
    uncapped.write_text("rollout:\n  max_tool_output_chars: null\n")
    appended = _rollout(out, "--append", "--config", str(uncapped))
    assert appended.returncode == 0, appended.stdout + appended.stderr
    assert len(read_trajectories(str(out / "trajectories.jsonl"))) == 4
    written = json.loads((out / "config.json").read_text())
    assert "max_tool_output_chars" not in written["rollout"] and len(written["appended"]) == 1


@pytest.mark.parametrize(
    ("marker", "text", "named"),
    [
        ("ledger.jsonl", '{"step": 1}\n', "ledger.jsonl"),
        ("config.json", '{"env": "calc-v0", "train": true}', "config.json of a training run"),
    ],
)
def test_rollout_never_writes_into_a_training_run(marker, text, named, tmp_path):
    run = tmp_path / "train"
    run.mkdir()
    (run / marker).write_text(text)
    for flag in ([], ["--overwrite"], ["--append"]):
        proc = _rollout(run, *flag)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"holds a training run ({named})" in proc.stderr
    assert [p.name for p in run.iterdir()] == [marker]
    assert (run / marker).read_text() == text


def test_a_config_file_next_to_the_run_is_not_a_run(tmp_path, tiny_model_path):
    """``--config DIR/config.yaml --out DIR``: a rollout config is not a training run."""
    (tmp_path / "config.yaml").write_text("rollout: {max_new_tokens: 4}\n")
    proc = _rollout(tmp_path, "--config", str(tmp_path / "config.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(read_trajectories(str(tmp_path / "trajectories.jsonl"))) == 2


# -- Ctrl-C and failures are reported, not buried ------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "sig"),
    [("trio", signal.SIGINT), ("asyncio", signal.SIGINT), ("trio", signal.SIGTERM)],
    ids=["trio", "asyncio", "SIGTERM"],
)
def test_ctrl_c_during_a_rollout_saves_what_finished(backend, sig, tmp_path, tiny_model_path):
    """SIGINT to a real ``agentrl rollout``: a one-line notice (no exception group), the
    finished trajectories kept, the summary written, exit 130. SIGTERM (a scheduler's
    preemption) takes the same path and exits 143."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "rollout", "--env", "faulty_envs:slow-v0",
         "--model", "tiny-random", "-n", "300", "--concurrency", "4", "--out", str(out),
         "--backend", backend],
        cwd=REPO, env=FAULTY, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    file = out / "trajectories.jsonl"
    deadline = time.monotonic() + 300
    while not (file.exists() and file.read_text().count("\n") >= 5):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no trajectory finished in time"
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stdout[-3000:] + stderr[-3000:]
    name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert f"stopping ({name}): cancelling the trajectories in flight" in stdout, stdout[-3000:]
    saved = read_trajectories(str(file))
    assert 5 <= len(saved) < 300
    assert f"interrupted: {len(saved)}/300 trajectories saved" in stdout
    assert "Traceback" not in stderr and "ExceptionGroup" not in stderr, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories"] == len(saved) == sum(summary["statuses"].values())
    assert "error" not in summary["statuses"]  # cancelled trajectories are not written


def test_a_rollout_where_every_trajectory_fails_exits_nonzero(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    proc = agentrl("rollout", "--env", "faulty_envs:broken-reward-v0", "--model", "tiny-random",
                   "-n", "2", "--out", str(out), env=FAULTY)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "every trajectory failed (2)" in proc.stdout
    assert "in score" in proc.stdout and "KeyError" in proc.stdout  # the traceback is shown
    (first, *_) = read_trajectories(str(out / "trajectories.jsonl"))
    assert first.error.where == "reward" and "in score" in first.error.traceback


# -- every command's help, and what a missing optional dependency says --------------------------


def _command_paths() -> list[list[str]]:
    """Every command and sub-command of ``agentrl``: the top-level commands from its parser,
    then, recursively, the sub-commands each one's help lists (``{a,b} ...`` in its usage), so
    commands whose options live in their own package are walked too."""
    import argparse
    import re

    from agentrl import cli

    (commands,) = [a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    paths: list[list[str]] = []
    pending = [[name] for name in commands.choices]
    while pending:
        path = pending.pop(0)
        paths.append(path)
        usage = _help(path).split("\n\n")[0]
        choices = re.search(r"\{([\w,-]+)\}\s+\.\.\.", usage)  # a sub-command, then its args
        pending += [[*path, child] for child in (choices[1].split(",") if choices else [])]
    return paths


def _help(path: list[str]) -> str:
    import contextlib
    import io

    from agentrl import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.main([*path, "--help"])
    assert exit_info.value.code == 0, f"agentrl {' '.join(path)} --help exited {exit_info.value}"
    return out.getvalue()


def test_every_command_and_subcommand_has_help():
    paths = _command_paths()  # runs each one's --help (exit 0)
    names = {" ".join(p) for p in paths}
    assert {"rollout", "envs show", "sandbox", "sandbox image build", "sandbox serve", "serve",
            "train", "models pull"} <= names, names  # fmt: skip
    for path in paths:
        text = _help(path)
        assert text.startswith(f"usage: agentrl {' '.join(path)}"), (path, text[:200])


def test_sandbox_help_as_a_user_runs_it():
    proc = agentrl("sandbox", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: agentrl sandbox") and "image" in proc.stdout


_BLOCK = """
import os, sys
for name in os.environ.get("AGENTRL_TEST_MISSING", "").split(","):
    if name:
        sys.modules[name] = None  # `import name` now raises ModuleNotFoundError
"""


@pytest.mark.parametrize(
    ("missing", "args", "needle"),
    [
        ("aiohttp", ["serve", "--model", "tiny-random"], "pip install 'agentrl[serve]'"),
        ("aiohttp", ["sandbox", "serve", "--backend", "local"], "pip install 'agentrl[sandbox]'"),
        ("deepspeed", ["train", "--model", "tiny-random", "--max-steps", "1", "--out", "OUT",
                       "--set", "rollout.group_size=2"], "pip install 'agentrl[train]'"),
        ("docker", ["rollout", "--env", "python-math-v0", "--model", "tiny-random", "-n", "1",
                    "--sandbox", "docker", "--out", "OUT"], "pip install 'agentrl[sandbox]'"),
    ],
)  # fmt: skip
def test_a_missing_optional_dependency_names_the_extra(missing, args, needle, tmp_path):
    """The module is made unimportable in the child (a sitecustomize puts None in
    ``sys.modules``), as if its extra had not been installed."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCK)
    env = {**ENV, "PYTHONPATH": str(tmp_path), "AGENTRL_TEST_MISSING": missing}
    args = [str(tmp_path / a) if a == "OUT" else a for a in args]
    proc = agentrl(*args, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"agentrl: error: agentrl {args[0]} needs {missing!r}")
    assert needle in proc.stderr, proc.stderr


def test_a_missing_core_dependency_or_an_unknown_module():
    from agentrl._extras import missing_dependency_message

    core = missing_dependency_message(ModuleNotFoundError("x", name="msgspec"), "rollout")
    assert core == (
        "agentrl rollout needs 'msgspec' (a dependency of agentrl), which is not installed: "
        "reinstall agentrl (pip install agentrl)"
    )
    yaml = missing_dependency_message(ModuleNotFoundError("x", name="yaml"), "train")
    assert yaml is not None and "'yaml' (a dependency of agentrl)" in yaml  # PyYAML
    # in several extras: the command's own extra wins
    assert "agentrl[serve]" in missing_dependency_message(
        ModuleNotFoundError("x", name="aiohttp.web"), "serve"
    )
    assert "agentrl[sandbox]" in missing_dependency_message(
        ModuleNotFoundError("x", name="aiohttp"), "sandbox"
    )
    # a module agentrl does not declare is a bug, not a missing extra: no advice
    assert missing_dependency_message(ModuleNotFoundError("x", name="nope_mod"), "rollout") is None
    assert missing_dependency_message(ModuleNotFoundError("x", name="agentrl.x"), "rollout") is None


# -- inspect: a run directory, or a clear error ---------------------------------------------------


def test_inspect_accepts_a_run_directory(tiny_run):
    _, out = tiny_run
    proc = agentrl("inspect", str(out), "--check")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "boundary check: all 4 trajectories match the re-render" in proc.stdout


def test_a_run_folders_config_json_that_is_not_an_object_is_one_line(tiny_run, tmp_path):
    """``inspect`` reads the model from the folder's config.json, ``rollout --append`` the
    sampling settings: garbage, a list, a non-string model path or bytes that are not UTF-8
    there are one line naming the file, exit 2 (each was a traceback)."""
    _, out = tiny_run
    for name, raw, needle in (
        ("garbage", b"garbage", "cannot read"),
        ("list", b"[1]", "is not a JSON object (got list)"),
        ("number-path", b'{"model_path": 5}', "model_path must be a string, got 5"),
        ("not-utf8", b'{"model_path": "\xff"}', "cannot read"),
    ):
        run = tmp_path / name
        run.mkdir()
        (run / "trajectories.jsonl").write_bytes((out / "trajectories.jsonl").read_bytes())
        (run / "config.json").write_bytes(raw)
        proc = agentrl("inspect", str(run))
        assert proc.returncode == 2, (name, proc.stdout + proc.stderr)
        assert proc.stderr.count("\n") == 1, (name, proc.stderr)
        assert "inspect: " in proc.stderr and "config.json" in proc.stderr, (name, proc.stderr)
        assert needle in proc.stderr, (name, proc.stderr)
    appended = agentrl(
        "rollout", "--env", "calc-v0", "--model", "tiny-random", "-n", "1", "--out",
        str(tmp_path / "list"), "--append",
    )  # fmt: skip
    assert appended.returncode == 2 and appended.stderr.count("\n") == 1, appended.stderr
    assert "--append: " in appended.stderr and "is not a JSON object" in appended.stderr


@pytest.mark.parametrize("what", ["ledger", "missing", "not-jsonl", "empty", "empty-dir", "binary"])
def test_inspect_gives_one_line_for_what_it_cannot_read(what, tmp_path):
    path = tmp_path / "x.jsonl"
    if what == "ledger":
        path = tmp_path / "ledger.jsonl"
        path.write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "reward_mean": 0.6}\n')
        needle = "is a training ledger (one record per step), not trajectories"
    elif what == "missing":
        needle = "no such file or directory"
    elif what == "not-jsonl":
        path.write_text("model: tiny-random\nenv: calc-v0\n")
        needle = "is not JSON lines"
    elif what == "empty":
        path.write_text("\n")
        needle = "holds no trajectories"
    elif what == "empty-dir":
        path = tmp_path
        needle = "is a directory without trajectories.jsonl"
    else:
        path.write_bytes(b'{"id": "x", "env": 3}\n\xff\xfe\n')
        needle = "cannot inspect"
    proc = agentrl("inspect", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr


# -- inspect: a trajectories file someone else made ------------------------------------------------


def _written(path: Path, trajectories) -> Path:
    from agentrl._types import TrajectoryWriter

    with TrajectoryWriter(str(path)) as writer:
        for trajectory in trajectories:
            writer.write(trajectory)
    return path


def test_inspect_prints_run_text_as_text_never_markup_or_escapes(
    tmp_path, tiny_model_path, capsys, monkeypatch
):
    """Ids, error types and tool error kinds reach the terminal through ``terminal_safe`` and
    never as Rich markup: ``x[/]`` crashed --check, ``[link=...]`` became a hyperlink, an OSC
    sequence set the terminal's title."""
    from trajectories import trajectory_from_pieces

    from agentrl._types import ToolCallRecord, TrajectoryError
    from agentrl.cli import main

    monkeypatch.setenv("COLUMNS", "400")
    ids = ["x[/]", "[link=https://evil.example]L[/link]\x1b]0;PWNED\x07\x9b31m"]
    trajectories = []
    for id_ in ids:
        trajectory = trajectory_from_pieces(
            [("prompt", [1, 2], 0), ("model", [3], 0)],
            id=id_,
            status="error",
            error=TrajectoryError(type="\x1b[2JBoom", message="m", where="env\x1b]0;T\x07"),
            tool_calls=[
                ToolCallRecord(0, "t", "{}", ok=False, output="", error_kind="\x1b[31mkind")
            ],
        )
        trajectory.loss_mask[0] = 1  # invalid: --check quotes the id
        trajectories.append(trajectory)
    path = _written(tmp_path / "trajectories.jsonl", trajectories)
    assert main(["inspect", str(path), "--model", "tiny-random", "--check", "--show", "2"]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out, out
    assert "invalid trajectory x[/]: loss_mask[0]=1" in out
    assert "invalid trajectory [link=https://evil.example]L[/link]\\x1b]0;PWNED\\x07\\x9b31m" in out
    assert "env\\x1b]0;T\\x07:\\x1b[2JBoom=2" in out and "\\x1b[31mkind=2" in out


def test_inspect_check_skips_trajectories_without_messages(tiny_run, tmp_path):
    """An error trajectory whose reset() raised has no messages: the chat template refused to
    render it and the whole --check ended with exit 2; now it is counted as not checked and
    every other trajectory is still checked."""
    from agentrl._types import TrajectoryError

    _, out = tiny_run
    trajectories = read_trajectories(str(out / "trajectories.jsonl"))
    failed = msgspec.structs.replace(
        trajectories[0],
        id="reset-raised",
        status="error",
        termination_reason="error",
        messages=[],
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        token_versions=[],
        spans=[],
        tool_calls=[],
        error=TrajectoryError(type="RuntimeError", message="boom", where="reset"),
    )
    path = _written(tmp_path / "trajectories.jsonl", [failed, *trajectories])
    proc = agentrl("inspect", str(path), "--check", "--show", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not checked: 1 trajectory without messages" in proc.stdout
    assert f"boundary check: all {len(trajectories)} trajectories match" in proc.stdout


@pytest.mark.parametrize("what", ["deep-first", "deep-later", "fifo", "kmsg", "span-past-ids"])
def test_inspect_refuses_odd_files_in_one_line(what, tmp_path, tiny_model_path, capsys):
    """JSON nested past the parser's depth, a FIFO or /proc/kmsg (a read that blocks, or eats
    the kernel's log: the command hung) under the file's name: one line, exit 2. A span that
    ends past the ids is an invalid trajectory (it was an IndexError)."""
    from trajectories import trajectory_from_pieces

    from agentrl.cli import main

    path = tmp_path / "trajectories.jsonl"
    deep = b'{"id": "x", "unknown": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    if what == "deep-first":
        path.write_bytes(deep)
        needle = "is not JSON lines"
    elif what == "deep-later":
        good = trajectory_from_pieces([("prompt", [1], 0), ("model", [2], 0)])
        _written(path, [good])
        with path.open("ab") as fh:
            fh.write(deep)
        needle = "trajectories.jsonl:2: not a trajectory: nested too deep"
    elif what == "fifo":
        os.mkfifo(path)
        needle = "trajectories.jsonl is not a file"
    elif what == "kmsg":
        if not os.access("/proc/kmsg", os.R_OK):
            pytest.skip("needs a readable /proc/kmsg (root)")
        path.symlink_to("/proc/kmsg")
        needle = "is a file of the kernel's /proc, not a run file"
    else:
        bad = trajectory_from_pieces([("prompt", [1], 0), ("model", [2], 0)])
        bad.spans[-1] = msgspec.structs.replace(bad.spans[-1], end=5)
        _written(path, [bad])
        args = ["inspect", str(path), "--model", "tiny-random", "--check", "--show", "1"]
        assert main(args) == 1
        assert "span Span(start=1, end=5" in capsys.readouterr().out
        return
    assert main(["inspect", str(path), "--model", "tiny-random"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`agentrl plan memory … | head`: the pipe's reader closed, so the output cannot be
    written; the command ends as one killed by SIGPIPE would report (141), with no traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "plan", "memory", "--model", "7B",
             "--gpus", "8", "--gpu-memory", "80GiB"],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr


def test_a_misspelt_setting_of_a_rollout_config_file_is_named_as_the_file_spells_it(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("rollout:\n  tempreature: 1.0\n")
    proc = agentrl("rollout", "--env", "calc-v0", "--model", "tiny-random", "-n", "1",
                   "--config", str(config), "--out", str(tmp_path / "run"))  # fmt: skip
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "rollout.tempreature: Extra inputs are not permitted" in proc.stderr, proc.stderr
    assert "did you mean 'temperature'?" in proc.stderr, proc.stderr


_TWIN = '''
import agentrl
from agentrl.envs.calc import CalcEnv


@agentrl.env("calc-twin-v0", max_turns=1)
class {name}(CalcEnv):
    """calc's tasks under another module's id: two modules may register one id."""
'''


def test_an_append_never_mixes_two_environments_of_one_id(tmp_path, tiny_model_path):
    """Two modules that register the same id (in two processes): an append of the second to
    the first's rollout merged their samples into the same groups; config.json names the
    entry point now, and an append from another one is refused naming both. A rollout
    recorded before the field still takes appends."""
    for module, name in (("twin_a", "TwinA"), ("twin_b", "TwinB")):
        (tmp_path / f"{module}.py").write_text(_TWIN.format(name=name))
    out = tmp_path / "run"

    def rollout(module: str, *extra: str) -> subprocess.CompletedProcess:
        return agentrl("rollout", "--env", f"{module}:calc-twin-v0", "--model", "tiny-random",
                       "-n", "1", "--max-new-tokens", "4", "--out", str(out), *extra,
                       cwd=tmp_path)  # fmt: skip

    first = rollout("twin_a")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["env_entry_point"] == "twin_a.TwinA"
    refused = rollout("twin_b", "--append")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert 'env_entry_point: "twin_a.TwinA" → "twin_b.TwinB"' in refused.stderr, refused.stderr
    assert rollout("twin_a", "--append").returncode == 0
    config = json.loads((out / "config.json").read_text())
    del config["env_entry_point"]  # as an older agentrl wrote it
    (out / "config.json").write_text(json.dumps(config))
    assert rollout("twin_b", "--append").returncode == 0


def test_a_rollout_config_with_a_section_no_run_config_has_is_refused(tmp_path):
    """``rolout: {temperature: 0.1}`` (a typo) ran at the defaults without a word; a training
    config's other sections (train, algorithm, …) stay allowed."""
    config = tmp_path / "c.yaml"
    config.write_text("env: calc-v0\nrolout:\n  temperature: 0.1\n")
    proc = agentrl("rollout", "--env", "calc-v0", "--model", "tiny-random", "-n", "1",
                   "--config", str(config), "--out", str(tmp_path / "out"))  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{config}: 'rolout' is not a section of a run config (did you mean 'rollout'?)" in (
        proc.stderr
    )
    assert not (tmp_path / "out").exists()


def test_a_rollout_file_name_taken_by_a_folder_is_refused(tmp_path):
    """``--overwrite`` with ``report.html`` a folder raised IsADirectoryError (a traceback)."""
    out = tmp_path / "run"
    (out / "report.html").mkdir(parents=True)
    (out / "trajectories.jsonl").write_text("")
    proc = _rollout(out, "--overwrite")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "report.html is not a regular file (a folder or a link)" in proc.stderr
    assert (out / "report.html").is_dir()


def test_a_dry_run_of_a_training_config_rolls_out_as_training_would(tmp_path, tiny_model_path):
    """``rollout --config TRAIN.yaml`` took only the rollout section: it ran smollm2-135m where
    the config said tiny-random, and without the context cap and group size training derives
    (a dry run showed 8 trained tokens where training cut the episode at 4)."""
    from agentrl.loop._config import TRAIN_GROUP_SIZE

    config = tmp_path / "train.yaml"
    config.write_text(
        "model: tiny-random\nenv: calc-v0\nalgorithm: {name: grpo}\n"
        "train: {micro_batch_tokens: 512}\nrollout: {max_turns: 1, max_new_tokens: 4}\n"
    )
    out = tmp_path / "run"
    proc = agentrl("rollout", "-n", "1", "--config", str(config), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recorded = json.loads((out / "config.json").read_text())
    assert (recorded["env"], recorded["model"]) == ("calc-v0", "tiny-random")
    rollout = recorded["rollout"]
    assert rollout["group_size"] == TRAIN_GROUP_SIZE and rollout["max_context_tokens"] == 512
    assert len(read_trajectories(str(out / "trajectories.jsonl"))) == TRAIN_GROUP_SIZE
    # a flag still wins, and says so
    flags = ["--env", "calc-v0", "--model", str(tiny_model_path), "--group", "1"]
    again = agentrl("rollout", "-n", "1", "--config", str(config), "--out", str(tmp_path / "b"),
                    *flags)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    said = " ".join(again.stdout.split())  # the console wraps long lines
    assert f"--model {tiny_model_path} overrides {config}'s model: tiny-random" in said
    nothing = tmp_path / "empty.yaml"
    nothing.write_text("rollout: {max_turns: 1}\n")
    refused = agentrl("rollout", "--config", str(nothing), "--out", str(tmp_path / "c"))
    assert refused.returncode == 2 and "--env is required" in refused.stderr, refused.stderr


def test_inspect_shows_ids_as_written_and_checks_ids_outside_the_vocabulary(
    tmp_path, tiny_model_path, capsys, monkeypatch
):
    """Rich turned ``:x:`` in an id into an emoji, U+202E reversed the rest of the line, a
    newline in an id printed a line of its own; ``--check`` of an id past the tokenizer's
    vocabulary (or negative) ended in an OverflowError traceback."""
    from trajectories import trajectory_from_pieces

    from agentrl.cli import main

    monkeypatch.setenv("COLUMNS", "400")
    spoof = "t:x:0\u202e/0\n  [9/9] forged: done/stop reward=1.0"
    trajectories = []
    from agentrl import Message

    messages = [Message("user", "hi"), Message("assistant", "x")]
    for id_, token in ((spoof, 3), ("huge", 2**40), ("negative", -1)):
        pieces = [("prompt", [1, 2], 0), ("model", [token], 0)]
        trajectory = trajectory_from_pieces(pieces, id=id_, messages=messages, prompt_messages=1)
        trajectories.append(trajectory)
    path = _written(tmp_path / "trajectories.jsonl", trajectories)
    assert main(["inspect", str(path), "--model", "tiny-random", "--check", "--show", "0"]) == 1
    out = capsys.readouterr().out
    assert "\u202e" not in out and "\u274c" not in out, out  # ❌
    assert "t:x:0\\u202e/0\\n  [9/9] forged" in out, out
    assert "trajectory huge: token id 1099511627776 at position 2 is not in the tokenizer's" in out
    assert "trajectory negative: token id -1 at position 2 is not in the tokenizer's" in out


@pytest.mark.parametrize(
    "summary", [b"[" * 200_000, b'{"elapsed_s": 1' + b"0" * 400 + b"}", b'{"elapsed_s": true}']
)
def test_previous_elapsed_time_of_any_summary_is_a_number_or_unknown(tmp_path, summary):
    """``--append`` reads the earlier summary's elapsed time: a summary nested 200,000 deep
    ended the append in a RecursionError traceback after the new trajectories were written."""
    from agentrl.cli import _previous_elapsed

    (tmp_path / "summary.json").write_bytes(summary)
    assert _previous_elapsed(tmp_path, 2.0) is None
    (tmp_path / "summary.json").write_text('{"elapsed_s": 1.5}')
    assert _previous_elapsed(tmp_path, 2.0) == 3.5
