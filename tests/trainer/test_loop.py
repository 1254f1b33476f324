"""The training loop in-process: config validation and overrides, the task stream's cursor, a
short real run (tiny-random on ``vowels-v0``) with its ledger, trajectories, versions,
evaluation, checkpoints, resume and export, and the weight sink's disk mode."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest
import torch

from agentrl import ConfigError
from agentrl.loop import (
    EngineWeightSink,
    TaskStream,
    aevaluate,
    apply_overrides,
    dump_config,
    export_run,
    load_train_config,
    read_ledger,
    train,
)
from agentrl.loop._config import TRAIN_GROUP_SIZE

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`:FutureWarning"
)
ROOT = Path(__file__).resolve().parents[2]
LEDGER_FIELDS = {
    "step", "policy_version", "reward_mean", "kl", "version_lag", "gen_tokens_per_s",
    "learner_tokens", "publish_s", "reward_std", "pass_rate", "entropy", "clip_fraction",
    "ratio_mean", "ratio_min", "ratio_max", "mismatch_abs_mean", "mismatch_kl",
    "response_tokens_mean", "tool_calls_per_trajectory", "tool_errors_per_trajectory",
    "termination", "rollout_s", "reference_s", "logprob_s", "update_s", "step_s",
}  # fmt: skip


def tiny_config(tmp_path: Path, **sections) -> Path:
    data = {
        "model": "tiny-random",
        "env": "vowels_env:vowels-v0",
        "rollout": {"max_new_tokens": 8, "concurrency": 8, "group_size": 4},
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "optimizer": {"lr": 1e-3},
        "train": {"max_steps": 2, "tasks_per_step": 2, "micro_batch_tokens": 256},
        "checkpoint": {"every_steps": 1, "keep": 3},
        "eval": {"every_steps": 2, "num_tasks": 2},
        "logging": {"progress": False},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        (["algorithm.clip_low=-1"], "algorithm.clip_low"),
        (["train.max_step=3"], "train.max_step"),
        (["algorithm.name=reinforce"], "algorithm.name"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["rollout.temperature=1e-7"], "rollout.temperature must be >= 1e-06 for training"),
        (["rollout.group_size=1"], "algorithm grpo needs groups: set rollout.group_size >= 2"),
        # settings that would do nothing, or drop every group, without a word
        (["algorithm.name=ppo", "algorithm.dynamic_sampling=true", "rollout.group_size=1"],
         "with rollout.group_size=1 that is every group"),
        (["train.refill_rounds=3"], "algorithm grpo has algorithm.dynamic_sampling off"),
        (["rollout.max_context_tokens=8192"], "a trajectory must fit one micro-batch"),
        (["algorithm.tis_cap=2"], "old_logprobs: recompute"),
        (["optimizer=3"], "optimizer"),
    ],
)  # fmt: skip
def test_config_errors_name_the_field(sets, names):
    with pytest.raises(ConfigError, match="invalid config") as info:
        load_train_config(None, ["rollout.group_size=4", *sets])
    assert names in str(info.value)


def test_a_group_algorithm_defaults_its_group_size():
    """No config at all trains: GRPO's groups default to ``TRAIN_GROUP_SIZE``; a size the user
    names is kept (1 is refused above), and an algorithm without groups keeps the rollout's 1."""
    assert load_train_config(None, []).rollout.group_size == TRAIN_GROUP_SIZE == 4
    assert load_train_config(None, ["rollout.group_size=8"]).rollout.group_size == 8
    ppo = load_train_config(None, ["algorithm.name=ppo"])
    assert ppo.rollout.group_size == 1


def test_overrides_parse_yaml_values_and_name_bad_keys():
    data = apply_overrides({"a": {"x": 1}}, ["a.b=2", "a.c=[0, 1]", "d=true", "e=hi", "f.g.h=0.5"])
    assert data == {
        "a": {"x": 1, "b": 2, "c": [0, 1]},
        "d": True,
        "e": "hi",
        "f": {"g": {"h": 0.5}},
    }
    with pytest.raises(ConfigError, match="a.x is not a mapping"):
        apply_overrides(data, ["a.x.y=1"])
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["novalue"])


def test_resolved_config_round_trips_and_hash_ignores_what_may_change(tmp_path):
    cfg = load_train_config(tiny_config(tmp_path), ["rollout.env_kwargs.num_tasks=16"])
    assert cfg.rollout.group_size == 4 and cfg.rollout.env_kwargs == {"num_tasks": 16}
    assert cfg.rollout.max_context_tokens == 256  # a trajectory must fit a micro-batch
    again_file = tmp_path / "again.yaml"
    again_file.write_text(dump_config(cfg))
    again = load_train_config(again_file)
    assert again == cfg and again.hash() == cfg.hash()
    same = ["train.max_steps=99", "eval.num_tasks=5", "logging.trackers=[]"]
    same.append("engine.max_batch_size=3")
    assert load_train_config(again_file, same).hash() == cfg.hash()
    assert load_train_config(again_file, ["optimizer.lr=0.5"]).hash() != cfg.hash()


def test_example_config_is_valid():
    cfg = load_train_config(ROOT / "examples" / "train_calc_grpo.yaml")
    assert cfg.model == "smollm2-135m" and cfg.env == "calc-v0"
    assert cfg.algorithm.name == "grpo" and cfg.rollout.group_size >= 2


def test_task_stream_continues_without_skipping_or_repeating():
    stream = TaskStream(list(range(10)), seed=3)
    chunks = [stream.take(c, 3) for c in range(0, 30, 3)]
    flat = [t for chunk in chunks for t in chunk]
    assert flat == stream.take(0, 30)
    for epoch in range(3):
        assert sorted(flat[10 * epoch : 10 * epoch + 10]) == list(range(10))
    assert flat[:10] != flat[10:20]  # each epoch has its own order
    assert TaskStream(list(range(10)), seed=3).take(7, 5) == flat[7:12]


# -- a real run ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two steps of GRPO on tiny-random, then a resume to step 3."""
    tmp = tmp_path_factory.mktemp("loop")
    cfg = load_train_config(tiny_config(tmp))
    out = tmp / "run"
    first = train(cfg, out)
    resumed = train(load_train_config(out / "config.yaml", ["train.max_steps=3"]), out, resume=True)
    return cfg, out, first, resumed


def test_run_writes_ledger_trajectories_and_versions(run):
    from agentrl import read_trajectories

    cfg, out, first, resumed = run
    assert first.steps == 2 and resumed.steps == 3 and resumed.policy_version == 3
    ledger = read_ledger(out / "ledger.jsonl")
    assert [r["step"] for r in ledger] == [1, 2, 3]
    for record in ledger:
        assert LEDGER_FIELDS <= record.keys(), LEDGER_FIELDS - record.keys()
        assert record["policy_version"] == record["step"]
        assert record["rollout_version"] == record["step"] - 1 and record["version_lag"] == 0
        assert record["learner_tokens"] > 0 and record["kl"] is not None
        assert record["mismatch_abs_mean"] < 1e-3  # engine and trainer score the same ids
    assert "eval_reward_mean" in ledger[1] and "eval_reward_mean" not in ledger[0]
    trajs = read_trajectories(str(out / "trajectories.jsonl"))
    assert len(trajs) == 3 * 2 * 4
    by_step = [trajs[8 * k : 8 * k + 8] for k in range(3)]
    for k, step_trajs in enumerate(by_step):
        assert {t.policy_version for t in step_trajs} == {k}
        assert {t.task_id for t in step_trajs} == set(ledger[k]["task_ids"])
    stream = TaskStream(list(range(64)), seed=cfg.train.seed)  # vowels-v0 has 64 tasks
    want = [f"train-0-{i}" for i in stream.take(0, 6)]
    assert [t for r in ledger for t in r["task_ids"]] == want
    assert any((out / "tensorboard").iterdir())
    assert len(read_trajectories(str(out / "eval_trajectories.jsonl"))) == 2 * 1


def test_checkpoints_evaluate_and_export(run, tmp_path):
    from transformers import AutoModelForCausalLM

    from agentrl.trainer import consolidated_state_dict, list_checkpoints

    cfg, out, _, _ = run
    ckpts = list_checkpoints(out / "checkpoints")
    assert [p.name for p in ckpts] == ["step-00000001", "step-00000002", "step-00000003"]
    metrics = anyio.run(lambda: aevaluate(cfg, str(out), out=tmp_path / "eval"))
    assert metrics["policy_version"] == 3 and metrics["num_tasks"] == 2
    assert (tmp_path / "eval" / "eval_summary.json").is_file()
    first = (tmp_path / "eval" / "eval_trajectories.jsonl").read_text().splitlines()
    again = anyio.run(lambda: aevaluate(cfg, str(out), out=tmp_path / "eval", overwrite=True))
    replaced = (tmp_path / "eval" / "eval_trajectories.jsonl").read_text().splitlines()
    assert len(replaced) == len(first) == again["num_tasks"]  # one sample per task
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == [
        "eval_summary.json",
        "eval_trajectories.jsonl",
    ]
    folder, step = export_run(out, 2, tmp_path / "hf")
    assert step == 2
    assert export_run(out, None, tmp_path / "hf-newest")[1] == 3  # no step: the newest
    with pytest.raises(ConfigError, match=r"no complete checkpoint for step 9 under .*checkpoints:"
                       r" the complete ones are of steps 1, 2, 3$"):  # fmt: skip
        export_run(out, 9, tmp_path / "hf-none")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    weights = consolidated_state_dict(ckpts[1])
    assert all(torch.equal(weights[k], p.detach()) for k, p in model.named_parameters())


def test_weight_sink_disk_mode_updates_the_engine(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from agentrl.engine import open_embedded_engine

    weights = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).state_dict()

    async def main() -> int:
        async with open_embedded_engine(tiny_model_path, num_threads=1) as engine:
            sink = EngineWeightSink(
                engine, snapshot_dir=str(tmp_path), model_path=str(tiny_model_path)
            )
            await sink.publish(5, weights)
            return engine.weight_version

    assert anyio.run(main) == 5
    assert (tmp_path / "v00000005" / "model.safetensors").is_file()


@pytest.mark.parametrize("purge", [True, False])
def test_tensorboard_after_resume_has_each_step_once(tmp_path, purge):
    """A resumed run redoes the steps after its checkpoint: with ``purge_step`` TensorBoard shows
    each step once, with the resumed run's values (without it, the old values stay too)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from agentrl.loop import Ledger

    first = Ledger(tmp_path)
    for step in range(4):  # 0..3, then "killed" after the checkpoint of step 1
        first.write({"step": step, "reward_mean": float(step)})
    first.close()
    time.sleep(1.1)  # event files are named by the second they were opened
    resumed = Ledger(tmp_path, purge_step=2 if purge else None)
    for step in (2, 3):
        resumed.write({"step": step, "reward_mean": 10.0 + step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    seen = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    if purge:
        assert seen == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    else:
        assert sorted(s for s, _ in seen) == [0, 1, 2, 2, 3, 3]


def test_training_against_a_server_publishes_snapshots(tmp_path, tiny_model_path):
    """``server.urls``: rollouts on a real ``agentrl serve`` (the SGLang HTTP subset) over
    HTTP, each new policy version written as a safetensors snapshot and loaded by the server
    through ``/update_weights_from_disk``; the engine and the trainer still agree on every
    sampled token's logprob, and old snapshots are pruned."""
    import httpx
    from serve_helpers import start_serve, stop_serve

    from agentrl import read_trajectories

    proc, url = start_serve(tiny_model_path, tmp_path / "serve.log")
    try:
        cfg = load_train_config(
            tiny_config(
                tmp_path, server={"urls": [url], "keep_snapshots": 1}, train={"max_steps": 2}
            )
        )
        result = train(cfg, tmp_path / "run")
        version = httpx.get(url + "/get_weight_version", timeout=10).json()
    finally:
        stop_serve(proc)
    assert result.policy_version == 2
    assert str(version.get("weight_version")) == "2", version
    ledger = read_ledger(tmp_path / "run" / "ledger.jsonl")
    for record in ledger:
        assert record["rollout_version"] == record["step"] - 1
        assert record["mismatch_abs_mean"] < 1e-3  # the server scored the same ids we do
    trajs = read_trajectories(str(tmp_path / "run" / "trajectories.jsonl"))
    assert sorted({t.policy_version for t in trajs}) == [0, 1]
    assert [p.name for p in (tmp_path / "run" / "weights").iterdir()] == ["v00000002"]


def test_training_through_a_router_that_serves_another_model_too(tmp_path, tiny_model_path):
    """``server.urls`` names an ``sglang-router`` in front of two policy workers and a worker of
    another model (say, the reward model), ``server.model`` the policy's: the rollouts run on
    both policy workers, every version is published to both, and the other model's worker gets
    neither a request nor the weights."""
    import httpx
    from serve_helpers import metric, start_router, start_serve, stop_serve

    procs = []
    try:
        workers = []
        for index, name in enumerate(["policy", "policy", "reward"]):
            log = tmp_path / f"worker{index}.log"
            proc, url = start_serve(tiny_model_path, log, "--served-model-name", name)
            procs.append(proc)
            workers.append(url)
        router, router_url = start_router(workers, tmp_path / "router.log", failures=3)
        procs.append(router)
        cfg = load_train_config(
            tiny_config(
                tmp_path,
                server={"urls": [router_url], "model": "policy", "keep_snapshots": 1},
                train={"max_steps": 2},
            )
        )
        result = train(cfg, tmp_path / "run")
        info = [httpx.get(u + "/get_model_info", timeout=10).json() for u in workers]
        served = [metric(u, "sglang:num_requests_total") for u in workers]
    finally:
        for proc in procs:
            stop_serve(proc)
    assert result.policy_version == 2
    assert [i["weight_version"] for i in info[:2]] == ["2", "2"], info
    assert info[2]["weight_version"] != "2" and info[2]["model_path"] == str(tiny_model_path)
    assert served[0] > 0 and served[1] > 0 and served[2] == 0, served
    for record in read_ledger(tmp_path / "run" / "ledger.jsonl"):
        assert record["mismatch_abs_mean"] < 1e-3  # both workers scored the ids as we do


def test_dapo_refill_replaces_groups_without_signal(tmp_path):
    """``train.refill_rounds``: every other vowels task rewards a constant (its group has no
    signal); the loop samples fresh tasks until the step has ``tasks_per_step`` informative
    groups, trains on exactly those, writes every sampled trajectory and advances the cursor by
    every task it drew."""
    from agentrl import read_trajectories

    cfg = load_train_config(
        tiny_config(
            tmp_path,
            # tiny-random never stops within 8 tokens: DAPO's overlong filter would mask every
            # trajectory and the run would train on nothing (and stop after 3 such steps)
            algorithm={"name": "dapo", "kl_coef": 0.0, "overlong_filter": False},
            rollout={"env_kwargs": {"constant_every": 2}},
            train={"max_steps": 3, "refill_rounds": 4},
            eval={"every_steps": 0},
        )
    )
    train(cfg, tmp_path / "run")
    ledger = read_ledger(tmp_path / "run" / "ledger.jsonl")
    trajs = read_trajectories(str(tmp_path / "run" / "trajectories.jsonl"))
    cursor, refilled = 0, 0
    for record in ledger:
        drawn = record["task_ids"] + record["refill_task_ids"]
        constant = [t for t in record["task_ids"] if int(t.rsplit("-", 1)[1]) % 2 == 0]
        assert (record["refill_rounds"] > 0) == bool(constant), record
        assert record["groups_informative"] == 2, record  # 4 rounds are plenty here
        assert record["groups_filtered"] == 0  # the loop already dropped them
        assert record["trajectories_in"] == 2 * 4
        assert record["trajectories_used"] == 2 * 4 and record["updates"] > 0
        cursor += len(drawn)
        assert record["data_cursor"] == cursor
        step = [t for t in trajs if t.policy_version == record["step"] - 1]
        assert sorted({t.task_id for t in step}) == sorted(set(drawn))
        assert len(step) == 4 * len(drawn)
        refilled += len(record["refill_task_ids"])
    assert refilled > 0, "no step needed a refill: the test proves nothing"


def test_the_fates_say_what_dynamic_sampling_and_the_overlong_filter_left_out(tmp_path):
    """DAPO without refill: a group without a reward signal is ``filtered`` and a trajectory
    cut by a length limit ``overlong`` (both were recorded as ``trained``, their tokens counted
    in ``trained_tokens``, though the learner trained on none of them)."""
    from agentrl import read_trajectories

    cfg = load_train_config(
        tiny_config(
            tmp_path,
            # tiny-random never stops within 8 tokens: every trajectory is cut (max_tokens)
            algorithm={"name": "dapo", "kl_coef": 0.0},
            rollout={"env_kwargs": {"constant_every": 2}},
            train={"max_steps": 1, "tasks_per_step": 4},  # the seeded order draws both kinds
            eval={"every_steps": 0},
        )
    )
    train(cfg, tmp_path / "run")
    trajs = read_trajectories(str(tmp_path / "run" / "trajectories.jsonl"))
    by_task: dict[str, set[str]] = {}
    for traj in trajs:
        assert traj.termination_reason == "max_tokens", traj.termination_reason
        by_task.setdefault(traj.task_id, set()).add(traj.info["fate"])
    constant = {t for t in by_task if int(t.rsplit("-", 1)[1]) % 2 == 0}
    assert constant and constant != set(by_task), by_task  # both kinds in the step
    assert all(by_task[t] == {"filtered"} for t in constant), by_task
    assert all(by_task[t] == {"overlong"} for t in set(by_task) - constant), by_task
    (record,) = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert record["trained_tokens"] == 0 and record["trajectories_used"] == 0, record
    assert record["groups_surplus"] == len(constant), record


def test_reward_breakdown_and_first_error_reach_the_ledger_and_tensorboard(tmp_path, make_groups):
    """Each key of the env's reward breakdown is logged as ``reward/<key>`` (its mean over the
    trajectories that report it), in ledger.jsonl and under the same TensorBoard tag; a step
    with failed trajectories carries ``first_error`` with the traceback."""
    import msgspec
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from agentrl._types import TrajectoryError
    from agentrl.loop import Ledger, rollout_metrics

    trajs = make_groups(seed=3, groups=2, size=2)
    parts = [{"correct": 1.0, "format": 0.5}, {"correct": 0.0, "format": 1.0}, {"correct": 1.0}]
    parts[0]["mean"] = 0.25  # an env's own "mean" must not overwrite the reward mean's tag
    failed = msgspec.structs.replace(
        trajs[3],
        status="error",
        reward=None,
        error=TrajectoryError("KeyError", "'x'", "reward", 0, traceback="Traceback …"),
    )
    with_parts = zip(trajs[:3], parts, strict=True)
    trajs = [*(msgspec.structs.replace(t, reward_breakdown=b) for t, b in with_parts), failed]
    record = {"step": 4, **rollout_metrics(trajs, pass_threshold=1.0, elapsed_s=1.0)}
    assert record["reward/correct"] == pytest.approx(2 / 3)
    assert record["reward/format"] == pytest.approx(0.75)
    assert record["reward/breakdown/mean"] == 0.25 and "reward/mean" not in record
    assert record["errors"] == 1
    assert record["first_error"] == {
        "trajectory": trajs[3].id, "where": "reward", "type": "KeyError", "message": "'x'",
        "traceback": "Traceback …",
    }  # fmt: skip
    ledger = Ledger(tmp_path)
    ledger.write(record)
    ledger.close()
    assert read_ledger(tmp_path / "ledger.jsonl")[0]["reward/format"] == pytest.approx(0.75)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/format")] == [(4, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("reward/breakdown/mean")] == [(4, 0.25)]
    (mean,) = acc.Scalars("reward/mean")  # the reward mean alone under its tag
    assert mean.value == pytest.approx(record["reward_mean"])
    assert acc.Scalars("reward/correct")[0].value == pytest.approx(2 / 3)


def test_a_run_whose_masks_leave_nothing_to_train_stops(tmp_path):
    """No trajectory fails, but DAPO's overlong filter masks every one (tiny-random never stops
    within 8 tokens): after ``train.max_steps_without_update`` such steps the loop stops and
    says why, instead of "training" on nothing."""
    from agentrl.loop import TrainingStalled

    cfg = load_train_config(
        tiny_config(
            tmp_path,
            algorithm={"name": "dapo", "kl_coef": 0.0},
            train={"max_steps": 5, "max_steps_without_update": 2},
            eval={"every_steps": 0},
        )
    )
    with pytest.raises(TrainingStalled, match="2 consecutive steps trained on nothing") as info:
        train(cfg, tmp_path / "run")
    assert "0 of 8 trajectories failed; the learner kept 0 of 8" in str(info.value)
    assert "'max_tokens': 8" in str(info.value)
    ledger = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert [r["steps_without_update"] for r in ledger] == [1, 2]
    assert ledger[-1]["stop_reason"] in str(info.value)


def test_sampling_filters_in_training_are_said_once_at_the_start():
    from agentrl.loop._config import training_notes

    assert training_notes(load_train_config(None, [])) == []
    (note,) = training_notes(load_train_config(None, ["rollout.top_p=0.9", "rollout.top_k=50"]))
    assert note.startswith("rollout.top_p=0.9, rollout.top_k=50: tokens are sampled from the")
    assert "off-policy by the filter" in note
