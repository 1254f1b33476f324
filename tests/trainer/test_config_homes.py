"""One home per setting, typed sections, and a validator that never rewrites the model: settings
at their old place are refused naming their home, a typo in ``engine`` or ``deepspeed`` fails at
load with its dotted name (DeepSpeed's own parser checks what agentrl does not type), derived
values come from ``mode="before"`` (a new mapping), and every example config loads."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pydantic
import pytest

from agentrl import ConfigError, EngineError
from agentrl.engine import EngineOptions, engine_options
from agentrl.loop import TrainConfig, dump_config, load_train_config
from agentrl.loop._config import MOVED_SETTINGS
from agentrl.trainer import AlgorithmConfig, DeepSpeedSection, algorithm_names, deepspeed_config

ROOT = Path(__file__).resolve().parents[2]
BASE = ["rollout.group_size=4"]


def load(*sets: str) -> TrainConfig:
    return load_train_config(None, [*BASE, *sets])


def refused(*sets: str) -> str:
    with pytest.raises(ConfigError, match="invalid config") as info:
        load(*sets)
    return str(info.value)


# -- one home per setting ----------------------------------------------------------------------


@pytest.mark.parametrize(("old", "home"), list(MOVED_SETTINGS.items()))
def test_a_setting_at_its_old_place_names_its_home(old, home):
    dotted = ".".join(old)
    message = refused(f"{dotted}={{}}" if dotted == "env_kwargs" else f"{dotted}=4")
    assert f"{dotted}: moved to {home} (every setting has one home)" in message
    data = {"rollout": {"group_size": 4}}
    node = data
    for part in old[:-1]:
        node = node.setdefault(part, {})
    node[old[-1]] = 4
    with pytest.raises(Exception, match=re.escape(f"moved to {home}")):
        TrainConfig.model_validate(data)


def test_the_homes_hold_the_values():
    cfg = load("rollout.env_kwargs.levels=[0]", "rollout.group_size=8")
    assert cfg.rollout.group_size == 8 and cfg.rollout.env_kwargs == {"levels": [0]}
    assert "group_size" not in AlgorithmConfig.model_fields
    assert "env_kwargs" not in TrainConfig.model_fields


def test_rollout_config_files_are_told_the_new_home_too(tmp_path):
    """``agentrl rollout --config`` reads the ``rollout`` section of a train config: a setting
    left at its old place would be ignored there, so it is refused the same way."""
    import subprocess
    import sys

    for data, needle in (
        ({"env_kwargs": {"levels": [0]}}, "env_kwargs: moved to rollout.env_kwargs"),
        ({"algorithm": {"group_size": 4}}, "algorithm.group_size: moved to rollout.group_size"),
    ):
        path = tmp_path / "old.yaml"
        path.write_text(json.dumps(data))
        proc = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "rollout", "--env", "calc-v0", "--config",
             str(path), "--out", str(tmp_path / "run")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("train_*.yaml")), ids=str)
def test_every_example_config_loads(example):
    cfg = load_train_config(example)
    assert cfg.algorithm.name in algorithm_names()


# -- the validator returns new values; it never rewrites the model -----------------------------


def test_no_validator_writes_through_object_setattr():
    for path in [*(ROOT / "agentrl").rglob("*.py"), *(ROOT / "trainer").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
                assert not (
                    node.func.attr == "__setattr__"
                    and isinstance(target, ast.Name)
                    and target.id == "object"
                ), f"{path}:{node.lineno}: object.__setattr__"


def test_derived_context_limit_comes_from_the_input_not_a_rewrite():
    data = {"rollout": {"group_size": 4}, "train": {"micro_batch_tokens": 512}}
    before = json.dumps(data, sort_keys=True)
    cfg = TrainConfig.model_validate(data)
    assert json.dumps(data, sort_keys=True) == before  # the caller's mapping is untouched
    assert cfg.rollout.max_context_tokens == 512
    assert "max_context_tokens" in cfg.rollout.model_fields_set  # it was input, not patched in
    again = TrainConfig.model_validate(json.loads(json.dumps(cfg.model_dump(mode="json"))))
    assert again == cfg and again.hash() == cfg.hash()
    explicit = load("rollout.max_context_tokens=300", "train.micro_batch_tokens=512")
    assert explicit.rollout.max_context_tokens == 300
    assert "a trajectory must fit one micro-batch" in refused(
        "rollout.max_context_tokens=600", "train.micro_batch_tokens=512"
    )


def test_configs_are_values_and_a_changed_copy_is_validated_like_a_file():
    """No section can be changed in place past the cross-section checks (pydantic keeps a
    failed assignment): configs are frozen; a change is a new, validated config."""
    cfg = load("train.micro_batch_tokens=512")
    for section, name, value in ((cfg, "train", cfg.train), (cfg.train, "micro_batch_tokens", 64)):
        with pytest.raises(pydantic.ValidationError, match="frozen"):
            setattr(section, name, value)
    data = cfg.model_dump()
    data["train"]["micro_batch_tokens"] = 256
    with pytest.raises(pydantic.ValidationError, match="a trajectory must fit one micro-batch"):
        TrainConfig.model_validate(data)
    assert cfg.train.micro_batch_tokens == 512 and cfg.rollout.max_context_tokens == 512


def test_hash_sees_resolved_algorithm_values():
    unset = load()
    explicit = load(
        "algorithm.clip_low=0.2", "algorithm.kl_coef=0", "algorithm.agg=seq-mean-token-mean"
    )
    assert unset.hash() == explicit.hash()  # the same run: grpo's own defaults, written out
    assert load("algorithm.clip_low=0.3").hash() != unset.hash()


# -- engine: typed ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["engine.max_batch=4"], "engine.max_batch: Extra inputs are not permitted (got 4)"),
        (["engine.max_batch_size=0"], "engine.max_batch_size: Input should be greater than or"),
        (["engine.device=tpu"], "engine.device: device must be 'cpu', 'cuda' or 'cuda:N'"),
        (["engine.dtype=float33"], "engine.dtype: dtype must be one of float32, bfloat16"),
        (
            ["engine.in_flight=later"],
            "engine.in_flight: Input should be 'finish', 'abort' or 'partial'",
        ),
    ],
)
def test_an_engine_typo_fails_at_load_with_its_name(sets, needle):
    assert needle in refused(*sets)


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (
            ["optimizer.lrr=1"],
            "optimizer.lrr: Extra inputs are not permitted (got 1); did you mean 'lr'?",
        ),
        (["rollout.tempreature=1"], "did you mean 'temperature'?"),
        (["trian.max_steps=1"], "trian: Extra inputs are not permitted; did you mean 'train'?"),
        (["engine.max_batch=4"], "(got 4); did you mean 'max_batch_size'?"),
    ],
)
def test_a_misspelt_field_gets_the_close_one(sets, needle):
    assert needle in refused(*sets)


def test_an_unknown_field_close_to_none_gets_no_guess():
    assert "did you mean" not in refused("optimizer.zzzz=1")


def test_engine_options_stay_one_validated_type():
    cfg = load("engine.max_batch_size=3", "engine.device=cuda:1")
    assert isinstance(cfg.engine, EngineOptions) and cfg.engine.max_batch_size == 3
    assert engine_options(cfg.engine) is cfg.engine
    assert engine_options({"num_threads": 2}).num_threads == 2
    with pytest.raises(ConfigError, match="engine.num_thread: Extra inputs"):
        engine_options({"num_thread": 2})
    assert cfg.engine.replace(num_threads=4).num_threads == 4
    with pytest.raises(EngineError, match="block_size: Input should be greater than or equal"):
        cfg.engine.replace(block_size=0)
    with pytest.raises(Exception, match="frozen"):
        cfg.engine.max_batch_size = 5  # type: ignore[misc]


# -- deepspeed: typed where agentrl relies on it, DeepSpeed's parser for the rest --------------


def test_a_misspelled_deepspeed_key_fails_with_its_name():
    message = refused("deepspeed.zero_optimisation.stage=3")
    assert "deepspeed.zero_optimisation: not a DeepSpeed config key" in message
    assert "did you mean 'zero_optimization'?" in message
    assert "deepspeed.wall_clock_breakdwn: not a DeepSpeed config key" in refused(
        "deepspeed.wall_clock_breakdwn=true"
    )


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (
            ["deepspeed.zero_optimization.overlap_com=false"],
            "deepspeed.zero_optimization.overlap_com: Extra inputs are not permitted",
        ),
        (["deepspeed.bf16.enabeld=true"], "deepspeed.bf16.enabeld: Extra inputs are not permitted"),
        (
            ["deepspeed.zero_optimization.stage=2"],
            "deepspeed.zero_optimization.stage: Input should be 3",
        ),
        (["deepspeed.elasticity.enabled=true"], "deepspeed.elasticity: DeepSpeed refuses it"),
        (
            ["deepspeed.bf16.enabled=true", "deepspeed.fp16.enabled=true"],
            "deepspeed: DeepSpeed refuses these keys together: bfloat16 and fp16 modes",
        ),
        (  # DeepSpeed reads JSON, where inf is null: the error said "(got None)"
            ["deepspeed.zero_optimization.reduce_bucket_size=.inf"],
            "deepspeed.zero_optimization.reduce_bucket_size: a finite number is due here (got inf)",
        ),
    ],
)
def test_deepspeed_sections_are_checked_by_deepspeed(sets, needle):
    assert needle in refused(*sets)


@pytest.mark.parametrize(
    ("key", "home"),
    [
        ("gradient_clipping", "optimizer.grad_clip"),
        ("optimizer.type", "the optimizer section"),
        ("scheduler.type", "optimizer.schedule"),
        ("gradient_accumulation_steps", "algorithm.mini_batches"),
        ("train_micro_batch_size_per_gpu", "train.micro_batch_tokens"),
        ("steps_per_print", "agentrl reports every step itself"),  # 0 divided by zero
    ],
)
def test_deepspeed_keys_owned_elsewhere_name_their_home(key, home):
    message = refused(f"deepspeed.{key}=2")
    assert f"deepspeed.{key.split('.')[0]}: set elsewhere" in message and home in message


def test_valid_deepspeed_overrides_reach_the_generated_config():
    cfg = load("deepspeed.zero_optimization.overlap_comm=false", "deepspeed.bf16.enabled=false")
    overrides = cfg.deepspeed.overrides()
    assert overrides == {
        "zero_optimization": {"stage": 3, "overlap_comm": False},
        "bf16": {"enabled": False},
    }
    merged = deepspeed_config(optimizer=cfg.optimizer, bf16=True, overrides=overrides)
    assert merged["zero_optimization"]["overlap_comm"] is False
    assert merged["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert merged["bf16"] == {"enabled": False}
    again = load_train_config_text(dump_config(cfg))
    assert again.deepspeed == cfg.deepspeed and again.hash() == cfg.hash()
    assert DeepSpeedSection().overrides() == {"zero_optimization": {"stage": 3}}


def load_train_config_text(text: str) -> TrainConfig:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return load_train_config(f.name)
    finally:
        Path(f.name).unlink()
