"""The training runtime's roles: task accounting, the learner's fate rules, asynchronous
training with bounded staleness (tiny-random on ``vowels-v0``), partial groups, the runtime's
ledger fields and interval records."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from agentrl._types import read_trajectories
from agentrl.loop import load_train_config, read_ledger, train
from agentrl.loop._learner import GroupView, assign_fates
from agentrl.loop._tasks import TaskLedger

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`:FutureWarning"
)


def _config(tmp_path: Path, **sections) -> Path:
    data = {
        "model": "tiny-random",
        "env": "vowels_env:vowels-v0",
        "rollout": {"max_new_tokens": 8, "concurrency": 8, "group_size": 2},
        "algorithm": {"name": "grpo"},
        "optimizer": {"lr": 1e-3},
        "train": {"max_steps": 4, "tasks_per_step": 2, "micro_batch_tokens": 256},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "logging": {"progress": False, "interval_s": 0.2},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(data))
    return path


# -- task accounting -----------------------------------------------------------------------------


def test_task_ledger_requeues_what_was_not_settled():
    ledger = TaskLedger()
    assert ledger.take(3) == [0, 1, 2] and ledger.take(2) == [3, 4]
    ledger.settle([1, 0, 3])
    assert ledger.state() == {"low": 2, "settled": [3], "next": 5}
    resumed = TaskLedger.from_state(ledger.state(), cursor=0)
    assert resumed.take(3) == [2, 4, 5]  # the unsettled slots first, then fresh ones
    with pytest.raises(AssertionError, match="settled twice"):
        ledger.settle([3])
    assert TaskLedger.from_state({}, cursor=7).take(1) == [7]  # an older checkpoint: its cursor


# -- the learner's fate rules -------------------------------------------------------------------


def _view(slot, version, *, rewards=(0.0, 1.0), failed=False, timed_out=False):
    import msgspec
    from trajectories import trajectory_from_pieces

    from agentrl._types import TrajectoryError

    trajs = []
    for i, reward in enumerate(rewards):
        traj = trajectory_from_pieces(
            [("prompt", [1, 5, 6], 0), ("model", [7, 2], 0)],
            logprob=lambda _: -1.0,
            id=f"e/t@{slot}/{i}",
            group_id=f"e/t@{slot}",
            task_id="t",
            reward=reward,
            policy_version=version,
        )
        if failed and i == 0:
            error = TrajectoryError("RuntimeError", "x", "reward", 0)
            traj = msgspec.structs.replace(traj, status="error", reward=None, error=error)
        trajs.append(traj)
    return GroupView(slot, "t", version, timed_out, trajs)


@pytest.mark.parametrize(
    ("rule", "want"),
    [
        ("wait", ["trained", "stale", "trained", "timed_out", "trained"]),
        ("drop", ["trained", "stale", "dropped", "timed_out", "trained"]),
    ],
)
def test_fates_follow_the_lag_bound_and_the_partial_group_rule(rule, want):
    views = [
        _view(0, 5),
        _view(1, 3),  # 5 - 3 = 2 > k = 1: never trained on
        _view(2, 5, failed=True),
        _view(3, 5, timed_out=True),
        _view(4, 4),
    ]
    assign_fates(views, 5, 1, rule, keep_informative=None)
    assert [v.fate for v in views] == want
    assert [v.lag for v in views] == [0, 2, 0, 0, 1]


def test_a_group_sampled_by_a_version_newer_than_the_learner_is_never_trained():
    """The learner publishes every version its engines hold: a newer one (a server another run
    updated) holds weights this run never made."""
    views = [_view(0, 5), _view(1, 7)]
    assign_fates(views, 5, 1, "wait", keep_informative=None)
    assert [(v.fate, v.lag) for v in views] == [("trained", 0), ("stale", -2)]


def test_dynamic_sampling_filters_groups_without_a_signal_even_without_refill():
    """The learner's dynamic sampling trains nothing of such a group: its fate says so (it was
    'trained', counted in groups_trained and trained_tokens)."""
    views = [_view(0, 0, rewards=(1.0, 1.0)), _view(1, 0), _view(2, 0)]
    assign_fates(views, 0, 0, "wait", keep_informative=None, dynamic_sampling=True)
    assert [v.fate for v in views] == ["filtered", "trained", "trained"]


def test_refill_keeps_only_informative_groups_up_to_the_step_size():
    views = [_view(0, 0, rewards=(1.0, 1.0)), _view(1, 0), _view(2, 0), _view(3, 0)]
    assign_fates(views, 0, 0, "wait", keep_informative=2)
    assert [v.fate for v in views] == ["filtered", "trained", "trained", "surplus"]


# -- asynchronous training ----------------------------------------------------------------------


def _slot(traj) -> int:
    return int(traj.group_id.rsplit("@", 1)[1])


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    cfg = load_train_config(
        _config(
            tmp,
            algorithm={"old_logprobs": "recompute", "tis_cap": 2.0},
            train={"mode": "async", "max_version_lag": 1, "max_steps": 5},
        )
    )
    result = train(cfg, tmp / "run")
    return tmp / "run", result


def test_async_samples_ahead_within_the_lag_bound(async_run):
    out, result = async_run
    ledger = read_ledger(out / "ledger.jsonl")
    assert [r["step"] for r in ledger] == [1, 2, 3, 4, 5] and result.policy_version == 5
    assert [r["policy_version"] for r in ledger] == [1, 2, 3, 4, 5]
    assert all(r["version_lag_max"] <= 1 for r in ledger)
    # step s + 1's groups started while step s trained: they were sampled one version back
    lags = Counter()
    for r in ledger:
        lags.update({int(k): v for k, v in r["version_lag_hist"].items()})
    assert lags[1] > 0, lags
    assert all(r["groups_stale"] == 0 for r in ledger)
    for field in ("buffer_backlog", "in_flight_groups", "actor_idle_fraction", "publish_bytes"):
        assert all(field in r for r in ledger), field
    assert all(r["publish_bytes"] > 0 for r in ledger)


def test_every_task_slot_is_trained_once_and_ids_are_unique(async_run):
    out, _ = async_run
    trajs = read_trajectories(str(out / "trajectories.jsonl"))
    assert len({t.id for t in trajs}) == len(trajs)
    per_slot = Counter(_slot(t) for t in trajs)
    assert sorted(per_slot) == list(range(10))  # 5 steps × 2 tasks, none lost
    assert set(per_slot.values()) == {2}  # each slot's group once (group size 2)
    ledger = read_ledger(out / "ledger.jsonl")
    for record in ledger:
        step = str(record["step"])
        slots = sorted({_slot(t) for t in trajs if t.info.get("step") == step})
        assert slots == record["task_slots"], record
        assert {t.info["fate"] for t in trajs if t.info.get("step") == step} == {"trained"}


def test_interval_records_measure_the_runtime(async_run):
    out, _ = async_run
    lines = (out / "runtime.jsonl").read_text().splitlines()
    assert lines, "no interval record in a run of several seconds with interval_s=0.2"
    records = [json.loads(line) for line in lines]
    times = [r["time_s"] for r in records]
    assert times == sorted(times)
    assert sum(r["generated_tokens"] for r in records) > 0
    for r in records:
        assert 0.0 <= r["actor_idle_fraction"] <= 1.0
        assert 0.0 <= r["learner_idle_fraction"] <= 1.0
        assert r["buffer_backlog"] >= 0 and r["in_flight_groups"] >= 0


def test_a_run_shorter_than_one_interval_records_its_last_one(tmp_path):
    """The last, partial interval is written when the run ends: a run shorter than
    ``logging.interval_s`` still has its interval record (the dashboard's time axis)."""
    sections = {
        "train": {"max_steps": 1},
        "checkpoint": {"every_steps": 0},
        "logging": {"progress": False, "interval_s": 3600},
    }
    out = tmp_path / "run"
    train(load_train_config(_config(tmp_path, **sections)), out)
    records = [json.loads(x) for x in (out / "runtime.jsonl").read_text().splitlines()]
    assert len(records) == 1, records
    assert records[0]["step"] == 1 and records[0]["policy_version"] == 1
    assert records[0]["generated_tokens"] > 0 and records[0]["time_s"] < 3600


def test_drop_trains_without_failed_groups_and_counts_them(tmp_path):
    cfg = load_train_config(
        _config(
            tmp_path,
            rollout={"env_kwargs": {"fail_every": 2}},
            train={"max_steps": 2, "tasks_per_step": 4, "partial_groups": "drop"},
        )
    )
    train(cfg, tmp_path / "run")
    ledger = read_ledger(tmp_path / "run" / "ledger.jsonl")
    trajs = read_trajectories(str(tmp_path / "run" / "trajectories.jsonl"))
    dropped = [t for t in trajs if t.info["fate"] == "dropped"]
    assert dropped and all(t.status == "error" for t in dropped)
    assert sum(r["groups_dropped"] for r in ledger) == len({t.group_id for t in dropped})
    assert all(
        t.status != "error" for t in trajs if t.info["fate"] == "trained"
    )  # a failed member never reaches the learner under drop
    assert sum(r["trajectories_trained"] for r in ledger) == sum(
        t.info["fate"] == "trained" for t in trajs
    )


def test_fill_replaces_stragglers_with_fresh_tasks(tmp_path):
    cfg = load_train_config(
        _config(
            tmp_path,
            rollout={"env_kwargs": {"slow_every": 3, "slow_s": 30.0}},
            train={
                "max_steps": 2,
                "tasks_per_step": 3,
                "partial_groups": "fill",
                "group_timeout_s": 3.0,
            },
        )  # fmt: skip
    )
    train(cfg, tmp_path / "run")
    ledger = read_ledger(tmp_path / "run" / "ledger.jsonl")
    trajs = read_trajectories(str(tmp_path / "run" / "trajectories.jsonl"))
    timed_out = sum(r["groups_timed_out"] for r in ledger)
    assert timed_out > 0, "no group was slow: the test proves nothing"
    trained = {_slot(t) for t in trajs if t.info["fate"] == "trained"}
    for r in ledger:  # one fresh task in place of each of the step's own groups that timed out
        missing = [s for s in r["task_slots"] if s not in trained]
        assert len(r.get("fill_task_slots", [])) == len(missing), r
    slots = [s for r in ledger for s in r["task_slots"] + r.get("extra_task_slots", [])]
    assert len(slots) == len(set(slots))  # a straggler's slot is settled, never sampled again
    assert {_slot(t) for t in trajs} <= set(slots)


@pytest.mark.parametrize(
    "sets",
    [
        ["train.mode=async"],
        ["engine.in_flight=partial"],
        ["train.mode=async", "algorithm.old_logprobs=recompute"],
    ],
)
def test_off_policy_training_needs_the_decoupled_objective(sets):
    from agentrl import ConfigError

    with pytest.raises(ConfigError, match="decoupled PPO") as info:
        load_train_config(None, sets)
    assert "old_logprobs: recompute" in str(info.value) or "tis_cap" in str(info.value)
    ok = ["algorithm.old_logprobs=recompute", "algorithm.tis_cap=2"]
    assert load_train_config(None, [*sets, *ok]).train.mode in ("sync", "async")
    assert load_train_config(None, ["train.mode=async", "train.max_version_lag=0"])  # the sync case


def test_resume_refuses_a_run_file_that_lost_records_unless_told(tmp_path, capsys):
    from agentrl.loop._runfiles import RunFileError

    cfg = load_train_config(_config(tmp_path, train={"max_steps": 2}))
    out = tmp_path / "run"
    train(cfg, out)
    path = out / "trajectories.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + lines[3][:10])  # lost its tail, torn last line
    longer = load_train_config(out / "config.yaml", ["train.max_steps=3"])
    recorded = (out / "config.yaml").read_bytes()
    with pytest.raises(RunFileError, match="trajectories.jsonl"):
        train(longer, out, resume=True)
    assert path.read_bytes() == b"".join(lines[:3]) + lines[3][:10]  # nothing was changed
    # nor the configuration: a later plain --resume would have trained to the refused one's
    assert (out / "config.yaml").read_bytes() == recorded
    result = train(longer, out, resume=True, accept_lost_records=True)
    assert result.steps == 3
    assert "--accept-lost-records" in capsys.readouterr().out
    trajs = read_trajectories(str(path))  # whole lines only: the 3 kept, then step 3's
    assert len(trajs) == 3 + 2 * 2 and all(t.info["step"] == "3" for t in trajs[3:])


def test_async_generation_throughput_counts_the_time_the_actors_sampled_in(async_run):
    """The actors sample while the learner trains: a step's samples were made over the time
    since the previous step's collection, not only the learner's wait for them (which may be
    next to nothing), so ``gen_tokens_per_s`` is ``gen_tokens / sampling_s`` with that time."""
    out, _ = async_run
    ledger = read_ledger(out / "ledger.jsonl")
    for previous, record in itertools.pairwise(ledger):
        assert record["sampling_s"] >= record["rollout_s"]
        # the learner trained the previous step inside this step's sampling time
        assert record["sampling_s"] >= previous["update_s"]
        assert record["gen_tokens_per_s"] == pytest.approx(
            record["gen_tokens"] / record["sampling_s"]
        )


@pytest.mark.parametrize("checkpoint", ["current", "older"])
def test_a_resumed_stalled_run_stops_where_the_straight_one_would(tmp_path, checkpoint):
    """Every reward raises: after 2 steps without an update and a checkpoint, a resume with
    ``train.max_steps_without_update=3`` stops at step 3, not at step 5 (the count is restored,
    not granted anew). A checkpoint from before the count was saved takes it from its step's
    ledger record."""
    from agentrl.loop import TrainingStalled
    from agentrl.trainer._manifest import write_manifest

    sections = {
        "rollout": {"env_kwargs": {"fail_every": 1}},
        "train": {"max_steps": 2, "max_steps_without_update": 3},
        "checkpoint": {"every_steps": 1, "keep": 5},
        "logging": {"progress": False, "interval_s": 0},
    }
    out = tmp_path / "run"
    train(load_train_config(_config(tmp_path, **sections)), out)
    state_file = out / "checkpoints" / "step-00000002" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["steps_without_update"] == 2
    if checkpoint == "older":
        del state["steps_without_update"]
        state_file.write_text(json.dumps(state))
        write_manifest(state_file.parent)
    longer = load_train_config(out / "config.yaml", ["train.max_steps=6"])
    with pytest.raises(TrainingStalled, match="3 consecutive steps trained on nothing"):
        train(longer, out, resume=True)
    ledger = read_ledger(out / "ledger.jsonl")
    assert [(r["step"], r["steps_without_update"]) for r in ledger] == [(1, 1), (2, 2), (3, 3)]
    assert "stop_reason" in ledger[-1]


def test_a_resume_with_more_steps_keeps_the_lr_schedule_and_says_so(tmp_path, capsys):
    """A cosine schedule made for 2 steps, resumed with ``train.max_steps=4``: one line says the
    schedule keeps its length and what the LR is after it, and steps 3-4 train at
    min_lr_ratio·lr (the curve is not re-shaped to 4 steps: the LR does not rise again)."""
    sections = {
        "optimizer": {"lr": 1e-3, "schedule": "cosine", "min_lr_ratio": 0.1},
        "train": {"max_steps": 2},
        "checkpoint": {"every_steps": 1, "keep": 1},
        "logging": {"progress": False, "interval_s": 0},
    }
    out = tmp_path / "run"
    train(load_train_config(_config(tmp_path, **sections)), out)
    capsys.readouterr()
    train(load_train_config(out / "config.yaml", ["train.max_steps=4"]), out, resume=True)
    text = capsys.readouterr().out
    assert (
        "--resume: train.max_steps is 4, the run was started with 2: its cosine LR schedule "
        "keeps its length (2 steps); from step 3 on the LR stays at 0.0001 "
        "(optimizer.min_lr_ratio × lr)"
    ) in text, text[-2000:]
    lrs = [r["lr"] for r in read_ledger(out / "ledger.jsonl")]
    assert lrs == pytest.approx([1e-3, 1e-4 + 0.9e-3 * 0.5, 1e-4, 1e-4]), lrs


def test_no_checkpoint_at_stop_once_the_dropped_step_has_updated_the_learner(capsys):
    """A stop during the evaluation that follows step 4's update drops step 4 after its update
    was applied: the weights are no longer step 3's, so no checkpoint of step 3 is written from
    them (the newest scheduled checkpoint stays the resume point); with the weights still step
    3's it is written, from the states recorded when step 3 ended."""
    from types import SimpleNamespace

    import anyio

    from agentrl.loop._runtime import _Ended, _Runtime

    saved: list[tuple] = []
    checkpointer = SimpleNamespace(save=lambda *args, **kwargs: saved.append((args, kwargs)))
    ended = _Ended(3, 3, {"low": 6}, 6, 0, {"torch": "states at step 3"})
    alone = {"setup": SimpleNamespace(lead=True), "world": 1}
    updated = SimpleNamespace(ended=ended, learner=SimpleNamespace(version=4),
                              checkpointer=checkpointer, **alone)  # fmt: skip
    anyio.run(_Runtime._save_at_stop, updated)
    assert saved == [] and updated.ended is ended
    assert "had applied the update of step 4" in capsys.readouterr().out
    learner = SimpleNamespace(version=3)
    current = SimpleNamespace(ended=ended, learner=learner, checkpointer=checkpointer, **alone)
    anyio.run(_Runtime._save_at_stop, current)
    assert saved == [((3, learner, {"low": 6}, 6), {"idle_steps": 0, "rng": ended.rng})]
    assert current.ended is None
    assert "saving a checkpoint of step 3 before stopping" in capsys.readouterr().out


def test_step_errors_reach_the_terminal_without_their_control_characters(capsys):
    """An env's error message, traceback and the stop reason may carry model or tool output:
    the step's report shows their escape sequences as text (``\\x1b``), newlines kept."""
    from agentrl.loop._ledger import StepProgress

    hostile = "bad answer \x1b[2J\x1b]0;PWNED\x07\x1b[41m red"
    progress = StepProgress(3, 0, enabled=False)
    progress._report_errors({
        "step": 1, "errors": 2, "trajectories": 4, "stop_reason": f"stalled: {hostile}",
        "first_error": {"trajectory": "calc-v0/\x1b[1mt1/0", "where": "reward",
                        "type": "RuntimeError", "message": hostile,
                        "traceback": f"Traceback:\n  File x\nRuntimeError: {hostile}"},
    })  # fmt: skip
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    assert "\n    File x\n" in out, "the traceback keeps its lines"
    text = " ".join(out.split())  # rich wraps long lines
    assert "bad answer \\x1b[2J\\x1b]0;PWNED\\x07\\x1b[41m red" in text
    assert "calc-v0/\\x1b[1mt1/0 (reward) RuntimeError" in text
    assert "stopping: stalled: bad answer \\x1b[2J" in text


def test_a_resume_never_continues_from_another_runs_checkpoints(tmp_path):
    """Two runs of one configuration; a resume of one pointed (``checkpoint.dir``) at the
    other's checkpoints resumed the other run silently, cutting its own files to the other's
    lengths. Each run has an id, kept by its resumes and recorded in its checkpoints."""
    from agentrl import ConfigError
    from agentrl.trainer import read_state

    cfg = load_train_config(_config(tmp_path, train={"max_steps": 2}))
    first, second = tmp_path / "first", tmp_path / "second"
    train(cfg, first)
    train(cfg, second)
    ids = [json.loads((run / "config.json").read_text())["run_id"] for run in (first, second)]
    assert ids[0] != ids[1] and all(len(i) == 16 for i in ids)
    assert read_state(first / "checkpoints" / "step-00000002").run_id == ids[0]
    before = {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()}
    other = f"checkpoint.dir={second / 'checkpoints'}"
    longer = load_train_config(first / "config.yaml", ["train.max_steps=3", other])
    with pytest.raises(ConfigError, match=rf"checkpoint .*second.* belongs to another run \(run "
                       rf"{ids[1]}; .*first is run {ids[0]}\)"):  # fmt: skip
        train(longer, first, resume=True)
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == before
    result = train(load_train_config(first / "config.yaml", ["train.max_steps=3"]), first,
                   resume=True)  # fmt: skip
    assert result.steps == 3
    assert json.loads((first / "config.json").read_text())["run_id"] == ids[0]
    assert read_state(first / "checkpoints" / "step-00000003").run_id == ids[0]


def test_a_resume_refused_after_the_config_was_written_leaves_it_as_it_was(tmp_path, monkeypatch):
    """A resume that fails once the run's config files are rewritten (the learner cannot be
    made, a checkpoint does not load, a tracker does not start) left ``config.yaml`` with the
    refused command's settings: the next plain ``--resume`` trained to its ``max_steps``."""
    import agentrl.loop._runtime as runtime

    cfg = load_train_config(_config(tmp_path, train={"max_steps": 2}))
    out = tmp_path / "run"
    train(cfg, out)
    before = {n: (out / n).read_bytes() for n in ("config.yaml", "config.json")}

    def broken(*args, **kwargs):
        raise RuntimeError("the learner cannot be made")

    monkeypatch.setattr(runtime, "_make_learner", broken)
    longer = load_train_config(out / "config.yaml", ["train.max_steps=7"])
    with pytest.raises(RuntimeError, match="the learner cannot be made"):
        train(longer, out, resume=True)
    assert {n: (out / n).read_bytes() for n in before} == before
