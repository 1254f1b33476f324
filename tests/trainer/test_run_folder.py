"""What a training run writes into its folder: never through a symlink, checked before the
model loads; a configuration that cannot run leaves no folder; a folder where a run stopped
before its first record is started again, one that holds a run's progress is not; one process
writes a run folder at a time; ``--resume`` never empties a run that recorded steps, refuses a
checkpoint root that is not a folder, and sets aside the broken checkpoints it skipped."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from agentrl import ConfigError, EnvError, OutputError
from agentrl._types import read_trajectories
from agentrl.loop import aevaluate, load_train_config, read_ledger, train
from agentrl.trainer import find_intact_checkpoint, list_checkpoints

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`:FutureWarning"
)

CONFIG = {
    "model": "tiny-random",
    "env": "vowels_env:vowels-v0",
    "rollout": {"max_new_tokens": 8, "concurrency": 8, "group_size": 2},
    "algorithm": {"name": "grpo"},
    "train": {"max_steps": 1, "tasks_per_step": 1, "micro_batch_tokens": 256},
    "checkpoint": {"every_steps": 0, "at_end": False},
    "eval": {"at_start": True, "every_steps": 0, "num_tasks": 1},
    "logging": {"trackers": [], "progress": False},
}


def _config(tmp_path: Path, *sets: str):
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(CONFIG))
    return load_train_config(path, list(sets))


@pytest.mark.parametrize(
    "name", ["config.json", "config.yaml", "trajectories.jsonl", "ledger.jsonl", "trackers.json"]
)
def test_a_symlink_in_the_run_folder_is_refused_before_anything_is_written(tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(OutputError, match=rf"{out / name} is a symlink \(to {victim}\)"):
        train(_config(tmp_path), out)
    assert victim.read_text() == "precious\n"
    assert [p.name for p in out.iterdir()] == [name]


def test_a_bad_env_argument_leaves_no_run_folder(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(EnvError, match="unexpected keyword argument 'foo'"):
        train(_config(tmp_path, "rollout.env_kwargs.foo=1"), out)
    assert not out.exists()


def test_a_folder_left_before_the_first_record_is_started_again(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # what a start that failed after writing its files left: the configuration, an empty
    # ledger, and an evaluation's trajectory cut short by a kill
    (out / "config.yaml").write_text("env: calc-v0\nrollout: {env_kwargs: {foo: 1}}\n")
    (out / "config.json").write_text('{"env": "calc-v0", "train": true}')
    (out / "ledger.jsonl").write_text("")
    (out / "eval_trajectories.jsonl").write_text('{"id": "a stale line"}\n')
    result = train(_config(tmp_path), out)
    assert result.steps == 1
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1]
    evals = read_trajectories(str(out / "eval_trajectories.jsonl"))  # the stale line is gone
    assert len(evals) == 1 and evals[0].env == "vowels-v0"
    assert "vowels_env:vowels-v0" in (out / "config.yaml").read_text()

    # now it holds a run: a new start is refused, files untouched
    ledger = (out / "ledger.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=f"{out} already holds a run; resume it with --resume"):
        train(_config(tmp_path), out)
    assert (out / "ledger.jsonl").read_bytes() == ledger


def test_eval_never_writes_into_a_training_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").write_text('{"step": 1}\n')
    (run / "eval_trajectories.jsonl").write_text("")
    cfg = _config(tmp_path)
    with pytest.raises(ConfigError, match=f"--out {run} holds a training run \\(ledger.jsonl"):
        anyio.run(lambda: aevaluate(cfg, "tiny-random", out=run))
    assert sorted(p.name for p in run.iterdir()) == ["eval_trajectories.jsonl", "ledger.jsonl"]
    assert (run / "eval_trajectories.jsonl").read_text() == ""


def test_eval_never_mixes_two_evaluations(tmp_path):
    """An ``--out`` holding an evaluation is refused before anything loads (its trajectories
    would be mixed with the new ones); ``overwrite`` replaces it (tests/trainer/test_loop.py)."""
    out = tmp_path / "eval"
    out.mkdir()
    (out / "eval_summary.json").write_text("{}")
    (out / "eval_trajectories.jsonl").write_text("old\n")
    cfg = _config(tmp_path)
    with pytest.raises(
        ConfigError,
        match=f"--out {out} already holds an evaluation \\(eval_summary.json, "
        "eval_trajectories.jsonl\\): choose another directory, or pass --overwrite",
    ):
        anyio.run(lambda: aevaluate(cfg, "tiny-random", out=out))
    assert (out / "eval_trajectories.jsonl").read_text() == "old\n"


def test_a_relative_checkpoint_dir_is_taken_from_the_run_folder(tmp_path, monkeypatch):
    """Not from the working directory: a ``--resume`` from another one would find no
    checkpoint there and start the run over."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = tmp_path / "run"
    train(_config(tmp_path, "checkpoint.dir=ck", "checkpoint.at_end=true"), run)
    assert [p.name for p in (run / "ck").iterdir()] and not list(elsewhere.iterdir())


def test_a_checkpoint_root_that_holds_checkpoints_is_refused(tmp_path):
    first = tmp_path / "first"
    shared = tmp_path / "ckpt"
    cfg = _config(tmp_path, f"checkpoint.dir={shared}", "checkpoint.at_end=true")
    train(cfg, first)
    (saved,) = shared.glob("step-*")
    with pytest.raises(ConfigError, match=f"{shared} already holds checkpoints \\({saved.name}"):
        train(cfg, tmp_path / "second")
    assert not (tmp_path / "second").exists()


# -- one writer per run folder ---------------------------------------------------------------------

_HOLD = (
    "import sys; from pathlib import Path; from agentrl.loop._runlock import RunLock\n"
    "lock = RunLock.acquire(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()\n"
)


@contextlib.contextmanager
def _held(out: Path):
    """Another process holds ``out``'s lock (as a run training there does) until the block
    ends; yields what the refusal names it by."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        yield f"pid {holder.pid} on {socket.gethostname()}"
    finally:
        holder.communicate(b"", timeout=60)


def _files(out: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".agentrl.lock"
    }


def test_a_second_process_on_the_run_folder_is_refused_before_it_writes(tmp_path):
    """Another process holds ``OUT/.agentrl.lock`` (a run training or resuming there): a
    resume, or a new run into a folder whose run has not recorded a step yet, is refused with
    one line naming the folder and the holder's pid, and writes nothing; once the holder is gone
    the resume goes on."""
    out = tmp_path / "run"
    train(_config(tmp_path, "checkpoint.at_end=true"), out)
    before = _files(out)
    longer = load_train_config(out / "config.yaml", ["train.max_steps=2"])
    fresh = tmp_path / "fresh"
    for folder, resume in ((out, True), (fresh, False)):
        with _held(folder) as holder:
            with pytest.raises(ConfigError) as info:
                train(longer, folder, resume=resume)
            message = str(info.value)
            assert f"{folder} is in use" in message and holder in message, message
            assert "\n" not in message
    assert _files(out) == before and _files(fresh) == {}
    assert train(longer, out, resume=True).steps == 2
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1, 2]


def test_a_checkpoint_root_another_run_writes_is_refused_before_anything_is_written(tmp_path):
    """Two runs given one ``checkpoint.dir``, the second starting before the first has written
    a checkpoint: the second is refused naming the root and the first run's pid, and writes
    nothing; a root that is the run folder itself is locked once (the run trains)."""
    shared = tmp_path / "ckpt"
    cfg = _config(tmp_path, f"checkpoint.dir={shared}", "checkpoint.at_end=true")
    second = tmp_path / "second"
    with _held(shared) as holder:
        with pytest.raises(ConfigError) as info:
            train(cfg, second)
    message = str(info.value)
    assert f"checkpoint root {shared} is in use" in message and holder in message, message
    assert "another checkpoint.dir" in message and "\n" not in message
    assert _files(second) == {} and list(shared.glob("step-*")) == []
    assert train(cfg, second).steps == 1  # the first run is gone: the root is free
    inside = tmp_path / "inside"
    own = _config(tmp_path, f"checkpoint.dir={inside}", "checkpoint.at_end=true")
    assert train(own, inside).steps == 1
    assert [p.name for p in inside.glob("step-*")] == ["step-00000001"]


# -- --resume never starts a run that recorded steps over ---------------------------------------


@pytest.mark.parametrize("where", ["no-checkpoints", "another-checkpoint-dir"])
def test_resume_without_a_checkpoint_refuses_a_ledger_that_holds_steps(tmp_path, where):
    """A run that recorded steps and has no checkpoint where the configuration says (it never
    wrote one; ``checkpoint.dir`` mistyped on resume) is refused, not started over: nothing is
    emptied."""
    out = tmp_path / "run"
    if where == "no-checkpoints":  # the root exists (the run held its lock), holding none
        train(_config(tmp_path), out)
        sets, root, what = ["train.max_steps=2"], out / "checkpoints", "(it is empty)"
    else:
        train(_config(tmp_path, "checkpoint.at_end=true"), out)
        sets, root = ["train.max_steps=2", "checkpoint.dir=ckpt-elsewhere"], out / "ckpt-elsewhere"
        what = "(it does not exist)"
    before = _files(out)
    cfg = load_train_config(out / "config.yaml", sets)
    with pytest.raises(ConfigError) as info:
        train(cfg, out, resume=True)
    message = str(info.value)
    assert f"{out / 'ledger.jsonl'} holds 1 step but {root} has no checkpoint" in message
    assert what in message and "\n" not in message
    assert _files(out) == before


def test_resume_of_a_run_that_recorded_no_step_starts_over(tmp_path, capsys):
    """Killed before its first step was recorded (only the evaluation at start): no checkpoint,
    and nothing to lose, so ``--resume`` starts from step 1."""
    out = tmp_path / "run"
    train(_config(tmp_path), out)
    first = (out / "ledger.jsonl").read_text().splitlines()[0]
    (out / "ledger.jsonl").write_text(first + "\n")
    assert train(_config(tmp_path), out, resume=True).steps == 1
    assert "has no checkpoint yet: starting over from step 1" in capsys.readouterr().out
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1]


@pytest.mark.parametrize("kind", ["file", "link-to-file", "broken-link"])
def test_a_checkpoint_root_that_is_not_a_folder_is_refused(tmp_path, kind):
    out = tmp_path / "run"
    train(_config(tmp_path, "checkpoint.at_end=true"), out)
    root = out / "ck"
    if kind == "file":
        root.write_text("not a folder\n")
    elif kind == "link-to-file":
        root.symlink_to(out / "config.yaml")
    else:
        root.symlink_to(tmp_path / "nowhere")
    before = (out / "ledger.jsonl").read_bytes()
    cfg = load_train_config(out / "config.yaml", ["train.max_steps=2", f"checkpoint.dir={root}"])
    for resume in (True, False):  # the run's own, and a new run's
        with pytest.raises(ConfigError, match=f"checkpoint root {root} "):
            train(cfg, out if resume else tmp_path / "new", resume=resume)
    assert (out / "ledger.jsonl").read_bytes() == before and not (tmp_path / "new").exists()


# -- broken checkpoints a resume skipped are set aside ---------------------------------------------


def test_resume_sets_broken_newer_checkpoints_aside_and_keeps_its_own(tmp_path, capsys):
    """Resuming from step 2 past broken checkpoints 3 and 4 with ``checkpoint.keep=1``: 3 and
    4 are renamed ``broken-step-N`` (and said so), and the step-3 checkpoint the resumed run
    writes is the one kept (pruning never removes what it just wrote, nor counts a broken
    folder)."""
    out = tmp_path / "run"
    cfg = _config(tmp_path, "train.max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep=5")
    train(cfg, out)
    root = out / "checkpoints"
    for step in (3, 4):
        weights = next((root / f"step-{step:08d}" / "policy").rglob("*optim_states.pt"))
        os.truncate(weights, 100)
    capsys.readouterr()
    resumed = load_train_config(
        out / "config.yaml", ["train.max_steps=3", "checkpoint.keep=1"], recorded=True
    )
    assert train(resumed, out, resume=True).steps == 3
    text = capsys.readouterr().out
    for step in (3, 4):
        name = f"step-{step:08d}"
        assert f"moved broken checkpoint {root / name} to {root / ('broken-' + name)}" in text
    assert [p.name for p in list_checkpoints(root)] == ["step-00000003"]
    assert find_intact_checkpoint(root).path == root / "step-00000003"
    assert sorted(p.name for p in root.glob("broken-*")) == [
        "broken-step-00000003",
        "broken-step-00000004",
    ]
    assert [r["step"] for r in read_ledger(out / "ledger.jsonl")] == [0, 1, 2, 3]
