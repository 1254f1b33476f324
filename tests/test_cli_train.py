"""``agentrl train / eval / export`` as a user runs them (subprocesses), and exact resume:
N steps straight == k steps, SIGKILL, ``--resume``, N − k steps (same tasks in the same order,
same policy versions, the same sampled tokens, losses equal within fp32 tolerance)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from disks import small_tmpfs
from numerics import gamma, unit_roundoff

from agentrl import read_trajectories

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_AFTER = 4, 2
CONFIG = {
    "model": "tiny-random",
    "env": "vowels_env:vowels-v0",
    "rollout": {"max_new_tokens": 8, "concurrency": 8, "group_size": 4},
    "algorithm": {"name": "grpo", "kl_coef": 0.05},
    "optimizer": {"lr": 1e-3},
    "train": {"max_steps": STEPS, "tasks_per_step": 2, "micro_batch_tokens": 256},
    "checkpoint": {"every_steps": 1, "keep": 5},
    "eval": {"every_steps": 2, "num_tasks": 2},
    "logging": {"trackers": []},
}


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests" / "trainer"), os.environ.get("PYTHONPATH", "")])
    # a learner started in this pytest process exported its process group's address: a child
    # must make its own
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in dist}, "PYTHONPATH": path}


def _agentrl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _ledger(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A straight; run B killed (SIGKILL) once checkpoint KILL_AFTER exists, resumed."""
    tmp = tmp_path_factory.mktemp("cli-train")
    config = tmp / "config.yaml"
    config.write_text(json.dumps(CONFIG))
    straight, killed = tmp / "A", tmp / "B"
    _agentrl("train", "--config", str(config), "--out", str(straight))
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", "--config", str(config), "--out",
         str(killed)],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    marker = killed / "checkpoints" / f"step-{KILL_AFTER:08d}" / "state.json"
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lines_at_kill = len(_ledger(killed))
    resumed = _agentrl("train", "--resume", str(killed))
    return config, straight, killed, lines_at_kill, resumed


def test_resume_after_sigkill_equals_the_straight_run(runs):
    _, straight, killed, lines_at_kill, _ = runs
    assert lines_at_kill >= KILL_AFTER, "killed before the checkpoint's step was logged"
    _assert_same_training(straight, killed)


def _assert_same_training(straight: Path, other: Path) -> None:
    """``other`` (stopped and resumed) recorded what the uninterrupted run ``straight`` did."""
    a, b = _ledger(straight), _ledger(other)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1)), "steps lost or repeated"
    for ra, rb in zip(a, b, strict=True):
        assert ra["task_ids"] == rb["task_ids"], f"data order differs at step {ra['step']}"
        assert ra["data_cursor"] == rb["data_cursor"]
        assert (ra["policy_version"], ra["rollout_version"]) == (
            rb["policy_version"],
            rb["rollout_version"],
        )
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6, rel=1e-3), ra["step"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3), ra["step"]
    # per-trajectory seeds: the post-resume samples are the uninterrupted run's
    ta = read_trajectories(str(straight / "trajectories.jsonl"))
    tb = read_trajectories(str(other / "trajectories.jsonl"))
    assert len(ta) == len(tb) == STEPS * 2 * 4, "in-flight trajectories were not discarded"
    key = lambda t: (t.policy_version, t.task_id, t.sample_index)  # noqa: E731
    for x, y in zip(sorted(ta, key=key), sorted(tb, key=key), strict=True):
        assert key(x) == key(y)
        assert x.token_ids == y.token_ids, f"samples differ for {key(x)}"
        assert x.reward == y.reward
    eval_a = sorted(read_trajectories(str(straight / "eval_trajectories.jsonl")), key=key)
    eval_b = sorted(read_trajectories(str(other / "eval_trajectories.jsonl")), key=key)
    assert [t.token_ids for t in eval_a] == [t.token_ids for t in eval_b]


def test_resume_with_another_tokenizer_is_refused(runs, tmp_path, tiny_model_path):
    _, _, killed, _, _ = runs
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_path, other)
    tok_config = json.loads((other / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{{ messages[0]['content'] }}"
    (other / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    proc = _agentrl("train", "--resume", str(copy), "--model", str(other), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tokenizer fingerprint mismatch" in proc.stderr
    assert _ledger(copy) == _ledger(killed)  # nothing was touched


def test_export_and_eval_commands(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    config, _, killed, _, _ = runs
    out = tmp_path / "hf"
    exported = _agentrl("export", str(killed), "--step", "2", "--out", str(out))
    assert f"exported {killed} step 2 → {out}" in exported.stdout, exported.stdout
    AutoModelForCausalLM.from_pretrained(str(out))
    proc = _agentrl("eval", "--config", str(config), "--checkpoint", str(killed))
    metrics = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert metrics["policy_version"] == STEPS and metrics["num_tasks"] == 2
    bad = _agentrl("train", "--config", str(config), "--set", "train.max_step=3", check=False)
    assert bad.returncode == 2 and "train.max_step" in bad.stderr


def _eval(config: Path, checkpoint: Path, *more: str) -> subprocess.CompletedProcess:
    return _agentrl("eval", "--config", str(config), "--checkpoint", str(checkpoint), *more,
                    check=False)  # fmt: skip


def _refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and all(n in err for n in needles), proc.stderr[-3000:]


def test_eval_and_export_check_what_they_load(runs, tmp_path, tiny_model_path):
    """``eval`` verifies a checkpoint as ``export`` and ``--resume`` do (a damaged one was
    evaluated); a run folder's checkpoints are found under its own ``checkpoint.dir`` (the run
    folder was taken for a model: a traceback); a model folder that is no longer where the
    checkpoint recorded it is named, and ``--model`` gives it, checked against the run's
    tokenizer; an export copies the model's config and tokenizer files, nothing else."""
    import yaml

    from agentrl.trainer import list_checkpoints
    from agentrl.trainer._manifest import write_manifest

    config, straight, _, _, _ = runs
    damaged = tmp_path / "damaged"
    shutil.copytree(list_checkpoints(straight / "checkpoints")[-1], damaged)
    victim = max(
        (p for p in damaged.rglob("*.pt") if "optim" in p.name), key=lambda p: p.stat().st_size
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    _refused(_eval(config, damaged), f"{victim}: its contents changed since it was saved")

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(straight, run)
    shutil.move(run / "checkpoints", elsewhere)
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    recorded["checkpoint"]["dir"] = str(elsewhere)
    (run / "config.yaml").write_text(yaml.safe_dump(recorded))
    proc = _eval(config, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert metrics["policy_version"] == STEPS
    assert metrics["checkpoint"] == str(elsewhere / f"step-{STEPS:08d}")
    recorded["checkpoint"]["dir"] = str(tmp_path / "empty")
    (run / "config.yaml").write_text(yaml.safe_dump(recorded))
    _refused(_eval(config, run), f"{run} is a training run with no complete checkpoint under")

    moved = elsewhere / f"step-{STEPS:08d}"
    state = json.loads((moved / "state.json").read_text())
    state["model_path"] = str(tmp_path / "gone" / "tiny-random")
    (moved / "state.json").write_text(json.dumps(state))
    write_manifest(moved)  # as if the run came from another machine
    recorded["checkpoint"]["dir"] = str(elsewhere)
    (run / "config.yaml").write_text(yaml.safe_dump(recorded))
    hint = "(state.json model_path) has no config.json (a run copied from another machine?)"
    _refused(_eval(config, run), hint)
    _refused(_agentrl("export", str(run), "--out", str(tmp_path / "x"), check=False), hint)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    (model / "id_rsa").write_text("not for an export")
    (model / "notes.md").write_text("nor this")
    out = tmp_path / "hf"
    _agentrl("export", str(run), "--out", str(out), "--model", str(model))
    copied = {p.name for p in out.iterdir()} - {"model.safetensors", "agentrl_export.json"}
    assert copied and copied <= {p.name for p in tiny_model_path.iterdir()}, copied
    assert "id_rsa" not in copied and "notes.md" not in copied and "config.json" in copied
    proc = _eval(config, run, "--model", str(model))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{{ messages[0]['content'] }}"
    (model / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    _refused(
        _eval(config, run, "--model", str(model)),
        f"--model {model}: its tokenizer",
        "is not the one checkpoint",
    )
    _refused(_eval(config, tiny_model_path, "--model", str(model)), "only for a checkpoint")


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    """A config file that is not UTF-8 (``--config``, or the run's own config.yaml on
    ``--resume``), an eval split no environment serves (in ``train``, with evaluation off, and
    in ``eval``): one line naming the file or the field, exit 2, and no run folder (each was a
    traceback)."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"model: tiny-random\n\xff\xfe: 1\n")
    run = tmp_path / "old-run"
    run.mkdir()
    (run / "config.yaml").write_bytes(b"env: calc-v0\nmodel: \xe9\n")
    out = tmp_path / "out"
    cases = [
        (["train", "--config", str(bad), "--out", str(out)], f"{bad}: line 2: not UTF-8 text"),
        (["train", "--resume", str(run)], f"{run / 'config.yaml'}: line 2: not UTF-8 text"),
        (["train", "--model", "tiny-random", "--set", "eval.split=validation", "--out", str(out)],
         "eval.split: Input should be 'train' or 'eval' (got 'validation')"),
        (["eval", "--checkpoint", "tiny-random", "--set", "eval.split=validation", "--out",
          str(out)], "eval.split: Input should be 'train' or 'eval'"),
    ]  # fmt: skip
    for args, needle in cases:
        proc = _agentrl(*args, check=False)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert proc.stderr.count("\n") == 1 and needle in proc.stderr, (args, proc.stderr)
        assert not out.exists() and sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_a_corrupt_trackers_file_is_refused_before_the_model_loads(tmp_path):
    """``--resume`` reads ``trackers.json`` (the tracker runs to continue) before any model or
    DeepSpeed engine is built: a file that is not a JSON object of objects is one line."""
    for name, raw, needle in (
        ("garbage", "{garbage", "cannot read"),
        ("list", "[1]", "must be a JSON object of tracker runs"),
    ):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(json.dumps(CONFIG))
        (run / "trackers.json").write_text(raw)
        proc = _agentrl("train", "--resume", str(run), check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert f"{run / 'trackers.json'}" in proc.stderr and needle in proc.stderr


def test_a_folder_no_training_run_wrote_is_never_overwritten(tmp_path):
    """``--out`` at a rollout's folder, or at a user's folder holding a file under a run
    file's name: refused before anything is written (it was emptied and overwritten)."""
    rollout = tmp_path / "rollout"
    rollout.mkdir()
    (rollout / "config.json").write_text(json.dumps({"env": "calc-v0", "model": "tiny-random"}))
    (rollout / "trajectories.jsonl").write_text('{"id": "kept"}\n')
    (rollout / "summary.json").write_text("{}")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("# my notes\n")

    def contents() -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = contents()
    for out, named in ((rollout, "config.json, trajectories.jsonl"), (mine, "config.yaml")):
        proc = _agentrl(
            "train", "--model", "tiny-random", "--set", "train.max_steps=1", "--out", str(out),
            check=False,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"--out {out} holds {named}, which a training run would replace" in proc.stderr
    assert contents() == before


def test_export_never_replaces_the_run_or_a_folder_holding_it(runs):
    _, _, killed, _, _ = runs
    before = sorted(p.relative_to(killed.parent) for p in killed.parent.rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "export", ".", "--out", ".."],
        cwd=killed, env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr == (
        f"agentrl: error: --out {killed.parent} holds the run folder {killed}; export would "
        "replace it\n"
    )
    assert sorted(p.relative_to(killed.parent) for p in killed.parent.rglob("*")) == before


def test_the_example_config_runs(tmp_path):
    """examples/train_calc_grpo.yaml as-is, shrunk to one step of tiny-random."""
    proc = _agentrl(
        "train", "--config", str(ROOT / "examples" / "train_calc_grpo.yaml"),
        "--model", "tiny-random", "--max-steps", "1", "--out", str(tmp_path / "run"),
        "--set", "train.tasks_per_step=1", "--set", "rollout.group_size=2",
        "--set", "eval.num_tasks=1", "--set", "rollout.max_new_tokens=8",
    )  # fmt: skip
    assert [r["step"] for r in _ledger(tmp_path / "run")] == [0, 1]  # eval.at_start: step 0
    lines = proc.stdout.splitlines()  # step 0's evaluation is shown before step 1
    at_start = [
        i
        for i, line in enumerate(lines)
        if re.match(r"step 0 v0 eval \d\.\d{3} pass \d+% \(", line)
    ]
    assert at_start and at_start[0] < min(
        i for i, line in enumerate(lines) if line.startswith("step 1 ")
    ), proc.stdout


def _torchrun(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``agentrl`` under torchrun with two CPU ranks (gloo)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "agentrl.cli", *args],
        env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def test_a_busy_run_folder_is_refused_on_every_rank(tmp_path):
    """Two ranks (torchrun) into a run folder another process holds: rank 0 cannot lock it,
    and every rank stops with the same one-line error naming the holder (none is left waiting
    in a collective); nothing but the lock file is in the folder."""
    from agentrl.loop._runlock import RunLock

    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(CONFIG))
    out = tmp_path / "run"
    lock = RunLock.acquire(out)  # this process: the run already training there
    try:
        proc = _torchrun("train", "--config", str(config), "--out", str(out), check=False)
    finally:
        lock.release()
    assert proc.returncode != 0, proc.stdout[-3000:]
    refusal = f"{out} is in use: another agentrl run (pid {os.getpid()} on"
    assert proc.stderr.count(refusal) == 2, proc.stderr[-4000:]  # both ranks
    assert [p.name for p in out.iterdir()] == [".agentrl.lock"]


def test_two_ranks_train_and_resume_like_one_process(runs, tmp_path):
    """``torchrun --nproc_per_node 2``: the ranks split each step's tasks, train data-parallel
    and rank 0 writes the run; steps 1-2, then a resume (every rank restores its RNG states)
    for steps 3-4, equal the one-process run: same tasks and samples, same gradient norms,
    losses within fp32 tolerance."""
    config, straight, _, _, _ = runs
    two = tmp_path / "two-ranks"
    first = _torchrun("train", "--config", str(config), "--out", str(two), "--max-steps", "2")
    assert first.stdout.count("done: 2 steps") == 1, "only rank 0 reports"
    _torchrun("train", "--resume", str(two), "--max-steps", str(STEPS))
    _assert_like_one_process(straight, two)


def _assert_like_one_process(straight: Path, two: Path) -> None:
    """The two-rank run ``two`` recorded what the one-process run ``straight`` did."""
    a, b = _ledger(straight), _ledger(two)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b, strict=True):
        assert ra["task_ids"] == rb["task_ids"] and ra["policy_version"] == rb["policy_version"]
        assert rb["learner_tokens"] == ra["learner_tokens"], "a rank's tokens were lost"
        assert rb["loss_tokens"] == ra["loss_tokens"]
        # the same rewards (shares in [0, 1]; the samples are equal, checked below), averaged
        # in another order: float64 sums of 8 values, γ_8 each
        bound = 2 * gamma(8, unit_roundoff(torch.float64))
        assert rb["reward_mean"] == pytest.approx(ra["reward_mean"], abs=bound), ra["step"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4), ra["step"]
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6, rel=1e-3), ra["step"]
        assert rb["entropy"] == pytest.approx(ra["entropy"], rel=1e-5), ra["step"]
    ta = read_trajectories(str(straight / "trajectories.jsonl"))
    tb = read_trajectories(str(two / "trajectories.jsonl"))
    key = lambda t: (t.policy_version, t.task_id, t.sample_index)  # noqa: E731
    assert len(ta) == len(tb) == STEPS * 2 * 4
    for x, y in zip(sorted(ta, key=key), sorted(tb, key=key), strict=True):
        assert key(x) == key(y) and x.token_ids == y.token_ids, f"samples differ for {key(x)}"
    assert len(read_trajectories(str(two / "eval_trajectories.jsonl"))) == 2 * 2  # steps 2, 4


def _start_torchrun(config: Path, run: Path) -> subprocess.Popen:
    """Two CPU ranks training into ``run`` (torchrun in its own session, output to one pipe)."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "agentrl.cli", "train", "--config", str(config), "--out", str(run)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _rank_pid(agent: int, rank: int) -> int:
    """The pid of torchrun ``agent``'s worker of ``rank`` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if parent == agent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} under torchrun {agent}")


def _stopped_two_ranks(tmp_path: Path, signal_to) -> tuple[Path, int, str]:
    """Two ranks with no checkpoint due, sent SIGTERM (``signal_to(torchrun's pid)`` picks the
    process) after step KILL_AFTER; the run, its complete steps and the output."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({**CONFIG, "train": {**CONFIG["train"], "max_steps": 60},
                                  "checkpoint": {"every_steps": 0}}))  # fmt: skip
    run = tmp_path / "two-ranks"
    proc = _start_torchrun(config, run)
    try:
        deadline = time.monotonic() + 600
        while _lines(run / "ledger.jsonl") < KILL_AFTER:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(signal_to(proc.pid), signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    steps = len(_ledger(run))
    assert [r["step"] for r in _ledger(run)] == list(range(1, steps + 1)), out[-4000:]
    assert "agentrl/loop" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    saved = run / "checkpoints" / f"step-{steps:08d}"
    text = " ".join(out.split())
    assert text.count(f"saving a checkpoint of step {steps} (all 2 ranks) before stopping") == 1
    assert f"interrupted: {steps} complete steps in {run / 'ledger.jsonl'}; newest checkpoint: " \
           f"step {steps} ({saved})" in text, out[-4000:]  # fmt: skip
    assert sorted(p.name for p in saved.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]
    assert json.loads((saved / "state.json").read_text())["world_size"] == 2
    assert [p.name for p in (run / "checkpoints").glob("*step-*")] == [saved.name]
    return run, steps, text


def test_two_ranks_stopped_by_sigterm_save_together_and_resume_like_one_process(runs, tmp_path):
    """SIGTERM to torchrun (a preempted job): it signals both ranks, they drop the same step
    at its collection, save the last complete step together (each rank its partitions and RNG
    states) and exit; ``--resume`` then repeats the one-process run exactly."""
    _, straight, _, _, _ = runs
    run, steps, text = _stopped_two_ranks(tmp_path, lambda agent: agent)
    assert text.count("stopping (SIGTERM): every rank drops the step in progress") == 1, text
    assert steps < STEPS, "the stop came too late for this test"
    assert (run / ".agentrl-stop").exists(), "the signalled ranks leave their mark"
    resumed = _torchrun("train", "--resume", str(run), "--max-steps", str(STEPS))
    assert f"resuming from checkpoint step {steps}" in resumed.stdout
    assert not (run / ".agentrl-stop").exists(), "a resume starts without the earlier stop"
    _assert_like_one_process(straight, run)


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGTERM to rank 1 alone: rank 0, never signalled, stops sampling once rank 1's mark
    is in the run folder, and learns who stopped at the collection; both drop that step and
    save the last complete one together, and rank 0 says why."""
    _, _, text = _stopped_two_ranks(tmp_path, lambda agent: _rank_pid(agent, 1))
    assert "stopping: rank 1 received a stop signal; every rank drops the step in progress" in text
    assert "stopping (SIGTERM)" not in text, "rank 0 was not signalled; rank 1 does not speak"


# -- failures are loud, Ctrl-C is safe, resume says what it does ---------------------------------


def test_training_stops_when_every_trajectory_fails(tmp_path):
    """An env whose verifier raises on every trajectory: each step prints its error count and
    the first error with its traceback, and after ``train.max_steps_without_update`` (3)
    steps that trained on nothing the run stops with exit 1, saying why in the ledger."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({**CONFIG, "env": "faulty_envs:broken-reward-v0",
                                  "train": {**CONFIG["train"], "max_steps": 10},
                                  "eval": {"every_steps": 0}}))  # fmt: skip
    run = tmp_path / "run"
    proc = _agentrl("train", "--config", str(config), "--out", str(run), check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())
    for step in (1, 2, 3):
        assert f"step {step}: 8 of 8 trajectories failed; first: broken-reward-v0/" in text
    assert "in score" in proc.stdout and "KeyError" in proc.stdout  # the traceback
    assert "3 consecutive steps trained on nothing (8 of 8 trajectories failed" in proc.stderr
    assert "Traceback" not in proc.stderr
    ledger = _ledger(run)
    assert [r["step"] for r in ledger] == [1, 2, 3]
    assert [r["steps_without_update"] for r in ledger] == [1, 2, 3]
    assert all(r["errors"] == 8 and r["updates"] == 0 for r in ledger)
    assert ledger[0]["first_error"]["where"] == "reward"
    assert "in score" in ledger[0]["first_error"]["traceback"]
    assert "stop_reason" not in ledger[1] and "8 of 8" in ledger[2]["stop_reason"]


def _start_and_signal(config: Path, run: Path, marker, sig: int = signal.SIGTERM):
    """Start ``agentrl train``, send ``sig`` once ``marker()`` holds, return its outcome."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", "--config", str(config), "--out", str(run)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not marker():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    return proc.returncode, stdout, stderr


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run sent SIGINT (Ctrl-C) once its checkpoint of step 2 exists."""
    tmp = tmp_path_factory.mktemp("ctrl-c")
    config = tmp / "config.yaml"
    config.write_text(json.dumps({**CONFIG, "train": {**CONFIG["train"], "max_steps": 60}}))
    run = tmp / "run"
    marker = run / "checkpoints" / "step-00000002" / "state.json"
    return run, *_start_and_signal(config, run, marker.exists, signal.SIGINT)


def test_ctrl_c_stops_training_at_a_safe_point(interrupted):
    run, code, stdout, stderr = interrupted
    assert code == 130, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    steps = [r["step"] for r in _ledger(run)]
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) < 60
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    checkpoint_step = int(newest.name.split("-")[1])
    assert checkpoint_step <= len(steps)
    assert not list((run / "checkpoints").glob(".tmp-*")), "a checkpoint was left half-written"
    assert (
        f"interrupted: {len(steps)} complete steps in {run / 'ledger.jsonl'}; newest checkpoint:"
        f" step {checkpoint_step} ({newest}); agentrl train --resume {run} continues from it"
    ) in " ".join(stdout.split()), stdout[-2000:]


def test_sigterm_stops_training_like_ctrl_c(tmp_path):
    """SIGTERM (a scheduler preempting the job before its SIGKILL) takes Ctrl-C's path: the
    step in progress is dropped, the run says how to resume, exit 143."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({**CONFIG, "train": {**CONFIG["train"], "max_steps": 60}}))
    run = tmp_path / "run"
    marker = run / "checkpoints" / "step-00000001" / "state.json"
    code, stdout, stderr = _start_and_signal(config, run, marker.exists)
    assert code == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    text = " ".join(stdout.split())
    assert "stopping (SIGTERM): the step in progress is dropped" in text, stdout[-2000:]
    steps = [r["step"] for r in _ledger(run)]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) < 60
    assert f"interrupted: {len(steps)} complete steps in {run / 'ledger.jsonl'}" in text
    assert f"agentrl train --resume {run} continues from it" in text
    assert not list((run / "checkpoints").glob(".tmp-*")), "a checkpoint was left half-written"


def test_a_stopped_run_saves_its_last_step_and_resumes_as_the_straight_run(runs, tmp_path):
    """With no checkpoint due (``checkpoint.every_steps: 0``), SIGTERM after step 2 saves the
    last complete step before exiting, from the states recorded as it ended: ``--resume``
    then repeats the uninterrupted run exactly (samples, data order, losses)."""
    _, straight, _, _, _ = runs
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({**CONFIG, "train": {**CONFIG["train"], "max_steps": 60},
                                  "checkpoint": {"every_steps": 0}}))  # fmt: skip
    run = tmp_path / "run"
    code, stdout, stderr = _start_and_signal(
        config, run, lambda: _lines(run / "ledger.jsonl") >= KILL_AFTER
    )
    assert code == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    steps = len(_ledger(run))
    assert KILL_AFTER <= steps < STEPS, "the stop came too late for this test"
    saved = run / "checkpoints" / f"step-{steps:08d}"
    text = " ".join(stdout.split())
    assert f"saving a checkpoint of step {steps} before stopping" in text, stdout[-2000:]
    assert f"newest checkpoint: step {steps} ({saved})" in text, stdout[-2000:]
    assert [p.name for p in (run / "checkpoints").glob("*step-*")] == [saved.name]
    resumed = _agentrl("train", "--resume", str(run), "--max-steps", str(STEPS))
    assert f"resuming from checkpoint step {steps}" in resumed.stdout
    _assert_same_training(straight, run)


def test_a_checkpoint_at_stop_that_fails_loses_nothing_else(tmp_path):
    """The checkpoint written at a stop fails (its disk is full): the stop still ends with exit
    143 and the complete steps in the run files, says why, and leaves no partial folder."""
    with small_tmpfs(tmp_path, "4m") as disk:
        config = tmp_path / "config.yaml"
        settings = {"train": {**CONFIG["train"], "max_steps": 60}, "eval": {"every_steps": 0},
                    "checkpoint": {"every_steps": 0, "dir": str(disk)}}  # fmt: skip
        config.write_text(json.dumps({**CONFIG, **settings}))
        run = tmp_path / "run"

        def step_one_then_fill() -> bool:
            if _lines(run / "ledger.jsonl") < 1:
                return False
            _fill(disk)
            return True

        code, stdout, stderr = _start_and_signal(config, run, step_one_then_fill)
        assert code == 128 + signal.SIGTERM, stdout[-3000:] + stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        text = " ".join(stdout.split())
        assert "no checkpoint at stop:" in text and "ENOSPC" in text, stdout[-2000:]
        left = sorted(p.name for p in disk.iterdir())
        assert left == [".agentrl.lock", "filler"], f"a partial checkpoint was left: {left}"
        steps = [r["step"] for r in _ledger(run)]
        assert steps == list(range(1, len(steps) + 1)) and steps
        assert f"interrupted: {len(steps)} complete steps" in text


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (needs root; skipped where it cannot be mounted)."""
    with small_tmpfs(tmp_path, "4m") as mount:
        yield mount


def _fill(folder: Path) -> Path:
    """Write a file into ``folder`` until its disk is full; returns the file."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_a_full_disk_under_the_run_files_is_named_and_the_run_resumes(small_disk, tmp_path):
    """The run folder's disk fills up while training (checkpoints elsewhere): the run stops
    with one error naming ENOSPC, the file and how to resume (it was a raw OSError traceback);
    once there is room, ``--resume`` completes the run, with no torn or repeated records."""
    config = tmp_path / "config.yaml"
    steps = 6
    config.write_text(json.dumps({
        **CONFIG,
        "train": {**CONFIG["train"], "max_steps": steps},
        "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": 1, "keep": 2, "dir": str(tmp_path / "ckpt")},
    }))  # fmt: skip
    run = small_disk / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", "--config", str(config), "--out", str(run)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    marker = tmp_path / "ckpt" / "step-00000001" / "state.json"
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    filler = _fill(small_disk)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("agentrl: error:")]
    assert f"no space left on device (ENOSPC) writing {run}/" in line, line
    assert "B free there" in line and f"agentrl train --resume {run} continues from it" in line
    assert "once there is room" in line, line
    filler.unlink()
    resumed = _agentrl("train", "--resume", str(run))
    assert "resuming from checkpoint step" in resumed.stdout
    assert [r["step"] for r in _ledger(run)] == list(range(1, steps + 1))
    trajs = read_trajectories(str(run / "trajectories.jsonl"))  # a torn line would not parse
    assert len(trajs) == len({t.id for t in trajs}) == steps * 2 * 4


def test_an_interrupted_run_without_a_checkpoint_says_what_a_resume_does(tmp_path):
    """Interrupted before its first checkpoint: with no step recorded ``--resume`` starts over;
    with steps recorded a resume refuses (it never empties them), so the message says to train
    again in a new folder instead."""
    from agentrl.loop import TrainResult
    from agentrl.loop._cli import _interrupted_message

    run = tmp_path / "run"
    none = _interrupted_message(TrainResult(run, 0, 0, {}, interrupted=True))
    assert none.endswith(f"no checkpoint yet: agentrl train --resume {run} starts over")
    some = _interrupted_message(TrainResult(run, 3, 3, {}, interrupted=True))
    assert "--resume" not in some and "cannot be resumed" in some
    assert f"agentrl train --config {run / 'config.yaml'} --out NEW_RUN" in some


def test_resume_says_where_it_resumed_and_names_changed_settings(interrupted, tmp_path):
    run, _, _, _ = interrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest = sorted((copy / "checkpoints").glob("step-*"))[-1]
    step = int(newest.name.split("-")[1])
    changed = _agentrl("train", "--resume", str(copy), "--set", "optimizer.lr=0.5", "--set",
                       "algorithm.kl_coef=0.1", "--max-steps", "99", check=False)  # fmt: skip
    assert changed.returncode == 2, changed.stderr[-2000:]
    message = changed.stderr
    assert f"configuration mismatch with checkpoint {newest}" in message
    assert "optimizer.lr: 0.001 → 0.5" in message and "algorithm.kl_coef: 0.05 → 0.1" in message
    assert "max_steps: " not in message  # may change on resume: not a difference
    resumed = _agentrl("train", "--resume", str(copy), "--max-steps", str(step + 1))
    assert f"resuming from checkpoint step {step} ({newest}): policy version {step}" in (
        " ".join(resumed.stdout.split())
    ), resumed.stdout[-2000:]
    assert [r["step"] for r in _ledger(copy)] == list(range(1, step + 2))
