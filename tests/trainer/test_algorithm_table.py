"""The algorithm table: one row drives the config (names, defaults, group check), the learner
(estimator, surrogate, critic, reference) and the reference docs. A test-only algorithm registered
in the table alone trains end to end on tiny-random."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import agentrl.trainer._learner as learner_module
from agentrl import ConfigError
from agentrl.docs import config_reference
from agentrl.loop import load_train_config, read_ledger, train
from agentrl.trainer import (
    AlgorithmConfig,
    AlgorithmSpec,
    algorithm_names,
    algorithm_spec,
    policy_loss,
    register_algorithm,
    unregister_algorithm,
)

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`:FutureWarning"
)
HERE = Path(__file__).resolve().parent
ESTIMATOR_CALLS: list[tuple[torch.Tensor, torch.Tensor]] = []


def best_baseline_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """A made-up estimator: each reward minus its group's best (never positive)."""
    ESTIMATOR_CALLS.append((rewards.clone(), groups.clone()))
    best = torch.full((int(groups.max()) + 1,), -torch.inf, dtype=rewards.dtype)
    best = best.scatter_reduce(0, groups, rewards, "amax")
    return rewards - best[groups]


TEST_ALGORITHM = AlgorithmSpec(
    name="test-best-baseline",
    summary="Test only: reward minus the group's best, CISPO surrogate, a reference by default.",
    advantages=best_baseline_advantages,
    surrogate="cispo",
    clip_low=0.5,
    clip_high=0.25,
    agg="seq-mean-token-sum",
    kl_coef=0.02,
)


@pytest.fixture
def registered():
    register_algorithm(TEST_ALGORITHM)
    ESTIMATOR_CALLS.clear()
    yield TEST_ALGORITHM
    unregister_algorithm(TEST_ALGORITHM.name)


def test_the_config_reads_names_and_defaults_from_the_table(registered):
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'; registered: grpo, dr_grpo"):
        load_train_config(None, ["algorithm.name=nope", "rollout.group_size=2"])
    cfg = AlgorithmConfig(name=registered.name)
    assert cfg.spec is registered and cfg.surrogate == "cispo" and cfg.needs_reference
    resolved = cfg.resolved()
    assert (resolved.clip_low, resolved.clip_high, resolved.agg, resolved.kl_coef) == (
        0.5, 0.25, "seq-mean-token-sum", 0.02,
    )  # fmt: skip
    assert not AlgorithmConfig(name=registered.name, kl_coef=0).needs_reference
    assert AlgorithmConfig(name=registered.name, clip_low=0.1).resolved().clip_low == 0.1
    with pytest.raises(ConfigError, match="needs groups: set rollout.group_size >= 2"):
        load_train_config(None, [f"algorithm.name={registered.name}", "rollout.group_size=1"])
    assert load_train_config(None, [f"algorithm.name={registered.name}"]).rollout.group_size == 4
    assert registered.name in algorithm_names()
    assert f"| `{registered.name}` | `best_baseline_advantages` | `cispo` |" in config_reference()


def test_every_built_in_resolves_from_its_row():
    for name in algorithm_names():
        spec = algorithm_spec(name)
        resolved = AlgorithmConfig(name=name).resolved()
        assert (resolved.clip_low, resolved.clip_high, resolved.agg) == (
            spec.clip_low, spec.clip_high, spec.agg,
        )  # fmt: skip
        assert resolved.dynamic_sampling == spec.dynamic_sampling
        assert resolved.overlong_filter == spec.overlong_filter
    assert algorithm_spec("ppo").needs_critic and not algorithm_spec("grpo").needs_critic
    assert algorithm_spec("dapo").dynamic_sampling and algorithm_spec("gspo").surrogate == "gspo"


def test_bad_rows_and_surrogates_are_refused(registered):
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm(AlgorithmSpec(**{**registered.__dict__, "clip_low": 0.3}))
    assert register_algorithm(registered) is registered  # the same row again: a no-op
    for change, needle in (
        ({"surrogate": "ppg"}, "unknown surrogate 'ppg'"),
        ({"name": "bad name"}, "use letters, digits"),
        ({"advantages": "td"}, "advantages must be 'gae' or a function"),
        ({"clip_low": 0.0}, "clips must be > 0"),
    ):
        with pytest.raises(ValueError, match=needle):
            register_algorithm(AlgorithmSpec(**{**registered.__dict__, "name": "x", **change}))
    x = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="unknown surrogate 'grpo'"):
        policy_loss(x, x, x, torch.tensor([True]), surrogate="grpo")  # type: ignore[arg-type]


def test_an_algorithm_registered_in_the_table_alone_trains(registered, tmp_path, monkeypatch):
    """One step on tiny-random: the table's estimator computes the advantages, its surrogate
    and defaults reach the loss, and its kl_coef opens the reference (the ledger's KL)."""
    seen: list[dict] = []
    real_loss = learner_module.policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(learner_module, "policy_loss", spy)
    monkeypatch.syspath_prepend(str(HERE))  # vowels_env
    config = {
        "model": "tiny-random",
        "env": "vowels_env:vowels-v0",
        "rollout": {"max_new_tokens": 8, "concurrency": 8, "group_size": 3},
        "algorithm": {"name": registered.name},
        "optimizer": {"lr": 1e-3},
        "train": {"max_steps": 1, "tasks_per_step": 2, "micro_batch_tokens": 256},
        "checkpoint": {"every_steps": 0, "at_end": False},
        "logging": {"progress": False, "trackers": []},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    result = train(load_train_config(path), tmp_path / "run")
    assert result.steps == 1
    (record,) = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert record["updates"] >= 1 and record["kl"] is not None  # the reference was opened
    assert len(ESTIMATOR_CALLS) == 1
    rewards, groups = ESTIMATOR_CALLS[0]
    assert rewards.shape == (6,) and groups.tolist() == [0, 0, 0, 1, 1, 1]
    assert seen and all(kw["surrogate"] == "cispo" for kw in seen)
    assert {(kw["clip_low"], kw["clip_high"], kw["agg"], kw["kl_coef"]) for kw in seen} == {
        (0.5, 0.25, "seq-mean-token-sum", 0.02)
    }
