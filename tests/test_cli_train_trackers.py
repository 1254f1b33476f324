"""``agentrl train`` with every tracker on (TensorBoard, W&B offline, an MLflow file store),
then ``--resume``d for one more step: each tracker holds the ledger's numbers under the
TensorBoard names at the training step, the runtime's interval records, the run config, and
the resumed steps in the same tracker run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tracker_files import mlflow_run, wandb_offline_runs

from agentrl.loop._ledger import interval_scalars, step_scalars
from agentrl.loop._trackers import mlflow_key, mlflow_params

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _config(tmp: Path) -> dict:
    return {
        "model": "tiny-random",
        "env": "vowels_env:vowels-v0",
        "rollout": {"max_new_tokens": 8, "concurrency": 8, "group_size": 2},
        "algorithm": {"name": "grpo"},
        "optimizer": {"lr": 1e-3},
        "train": {"max_steps": 2, "tasks_per_step": 2, "micro_batch_tokens": 256},
        "checkpoint": {"every_steps": 1},
        "logging": {
            "trackers": ["tensorboard", "wandb", "mlflow"],
            "interval_s": 0.25,
            "wandb": {"mode": "offline", "project": "trackers-test", "tags": ["t"]},
            "mlflow": {"tracking_uri": (tmp / "mlruns").as_uri(), "experiment": "trackers"},
        },
    }


def _agentrl(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT / "tests" / "trainer"), os.environ.get("PYTHONPATH", "")])
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist and not k.startswith("WANDB_")}
    env.update(
        PYTHONPATH=path,
        MLFLOW_ALLOW_FILE_STORE="true",  # MLflow 3 asks for it to use a folder as its store
        WANDB_SILENT="true",
        WANDB_CONFIG_DIR=str(tmp / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp / "wandb-data"),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trackers")
    config = tmp / "config.yaml"
    config.write_text(json.dumps(_config(tmp)))
    run = tmp / "run"
    _agentrl(tmp, "--config", str(config), "--out", str(run))
    first_ids = json.loads((run / "trackers.json").read_text())
    resumed = _agentrl(tmp, "--resume", str(run), "--max-steps", "3")
    return tmp, run, first_ids, resumed


@pytest.fixture(autouse=True)
def _mlflow_folder_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the store back here


def _close(a: float, b: float) -> bool:
    # the trackers store the float64 the ledger wrote (JSON text both ways): equal up to the
    # last bit of a repr round trip
    return math.isclose(a, b, rel_tol=1e-15, abs_tol=0.0)


def test_every_tracker_holds_the_ledger_at_the_training_step(tracked_run):
    tmp, run, _, _ = tracked_run
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == [1, 2, 3]
    ids = json.loads((run / "trackers.json").read_text())
    _, metrics = mlflow_run(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"])
    rows = [row for r in wandb_offline_runs(run / "wandb") for row in r["history"]]
    step_rows = [row for row in rows if "interval/run_s" not in row]
    for record in ledger:
        step, scalars = record["step"], step_scalars(record)
        assert {"reward/mean", "mismatch/kl", "time/update_s", "train/loss"} <= set(scalars)
        wandb_row = [row for row in step_rows if row["train/step"] == step][-1]
        for name, value in scalars.items():
            at_step = [m.value for m in metrics[mlflow_key(name)] if m.step == step]
            assert at_step and _close(at_step[-1], value), (name, step, at_step, value)
            assert _close(wandb_row[name], value), (name, step, wandb_row.get(name), value)
    # the reward histogram (a step whose groups were all skipped has none): W&B as TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"histograms": 0})  # keep all
    acc.Reload()
    tb_steps = (
        [e.step for e in acc.Histograms("reward/histogram")] if acc.Tags()["histograms"] else []
    )
    histograms = [row for row in step_rows if "reward/histogram/_type" in row]  # nested keys
    assert {row["reward/histogram/_type"] for row in histograms} <= {"histogram"}
    assert [row["train/step"] for row in histograms] == tb_steps
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3]
    # a runtime/ tag holds the step records only (the interval records are a section apart)
    assert [e.step for e in acc.Scalars("runtime/buffer_backlog")] == [1, 2, 3]


def test_interval_records_reach_every_tracker(tracked_run):
    tmp, run, _, _ = tracked_run
    intervals = [json.loads(line) for line in (run / "runtime.jsonl").read_text().splitlines()]
    assert intervals, "no interval record: the run was shorter than logging.interval_s"
    ids = json.loads((run / "trackers.json").read_text())
    _, metrics = mlflow_run(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"])
    runs = wandb_offline_runs(run / "wandb")
    rows = [row for r in runs for row in r["history"] if "interval/run_s" in row]
    by_time = {row["interval/time_s"]: row for row in rows}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard" / "interval"), size_guidance={"scalars": 0})
    acc.Reload()
    for record in intervals:
        row = by_time[record["time_s"]]
        assert row["train/step"] == record["step"]
        second = int(row["interval/run_s"])  # since the run first started
        for name, value in interval_scalars(record).items():
            assert _close(row[name], value), (name, record["time_s"])
            assert any(
                m.step == second and _close(m.value, value) for m in metrics[mlflow_key(name)]
            ), (name, second)
            assert any(e.step == second for e in acc.Scalars(name)), (name, second)
    # the resumed process's intervals come after the first one's (time goes on across the
    # resume, and TensorBoard's purge of the redone steps leaves the interval points alone)
    first, second_process = ([row["interval/run_s"] for row in r["history"]
                              if "interval/run_s" in row] for r in runs)  # fmt: skip
    assert first and second_process and max(first) < min(second_process)
    assert len(acc.Scalars("interval/buffer_backlog")) == len(first) + len(second_process)


def test_the_run_config_is_attached(tracked_run):
    import yaml

    tmp, run, _, _ = tracked_run
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    ids = json.loads((run / "trackers.json").read_text())
    mlflow, _ = mlflow_run(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"])
    params = mlflow_params(resolved)
    assert mlflow.data.params["train.tasks_per_step"] == "2"
    # the first run's values (params are write-once; the resume changed only max_steps)
    assert {k: v for k, v in params.items() if k != "train.max_steps"}.items() <= (
        mlflow.data.params.items()
    )
    for wandb in wandb_offline_runs(run / "wandb"):
        config = {k: v for k, v in wandb["config"].items() if k != "_wandb"}
        assert config["rollout"] == resolved["rollout"] and config["model"] == "tiny-random"


def test_resume_appends_to_the_same_tracker_runs(tracked_run):
    tmp, run, first_ids, resumed = tracked_run
    ids = json.loads((run / "trackers.json").read_text())
    assert ids == first_ids
    runs = wandb_offline_runs(run / "wandb")
    # one W&B run written by two processes: offline files per process, the same run id
    assert [r["id"] for r in runs] == [ids["wandb"]["id"]] * 2
    steps = [
        [row["train/step"] for row in r["history"] if "interval/run_s" not in row] for r in runs
    ]
    assert steps == [[1, 2], [3]]
    mlflow, metrics = mlflow_run(ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"])
    assert sorted(m.step for m in metrics["reward/mean"]) == [1, 2, 3]
    assert mlflow.info.status == "FINISHED"
    assert " failed at " not in resumed.stderr  # no tracker was switched off
    # the resume changed train.max_steps: MLflow keeps the first value and says so
    assert "mlflow: params are write-once; the run keeps its first value of train.max_steps" in (
        resumed.stderr
    )
    assert mlflow.data.params["train.max_steps"] == "2"
