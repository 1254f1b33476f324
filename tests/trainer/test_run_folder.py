"""What a training run writes into its folder: never through a symlink, checked before the
model loads; a configuration that cannot run leaves no folder; a folder where a run stopped
before its first record is started again, one that holds a run's progress is not."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from agentrl import ConfigError, EnvError, OutputError
from agentrl._types import read_trajectories
from agentrl.loop import aevaluate, load_train_config, read_ledger, train

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
    (saved,) = shared.iterdir()
    with pytest.raises(ConfigError, match=f"{shared} already holds checkpoints \\({saved.name}"):
        train(cfg, tmp_path / "second")
    assert not (tmp_path / "second").exists()
