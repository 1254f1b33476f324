"""Values that could only fail later are refused when the config is read: NaN and infinities in
every float field of every config model, Adam's betas outside [0, 1), an eval split no
environment serves, a dtype the engine cannot run; and the file itself is read by the one
reader (UTF-8, no key twice, bounded aliases), ``--set`` values included."""

from __future__ import annotations

import math
import time
import typing

import pydantic
import pytest
import yaml

from agentrl import ConfigError, RolloutConfig
from agentrl.engine import EngineOptions
from agentrl.engine._server_limits import ServeLimits
from agentrl.loop import TrainConfig, dump_config, load_train_config
from agentrl.loop._config import LEGACY_VALUES
from agentrl.sandboxes import PoolConfig
from agentrl.sandboxes._config import DockerConfig, GVisorConfig, LocalConfig, ServiceConfig
from agentrl.trainer import AlgorithmConfig, OptimizerConfig

BASE = ["rollout.group_size=2"]


def refused(*sets: str, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_train_config(path, [*BASE, *sets])
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _models(model: type[pydantic.BaseModel], seen: set) -> None:
    """``model`` and every model its fields hold, at any depth."""
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        for part in _parts(field.annotation):
            if isinstance(part, type) and issubclass(part, pydantic.BaseModel):
                _models(part, seen)


def _parts(annotation: typing.Any) -> list[typing.Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _parts(args[0])
    return [annotation, *(p for a in args for p in _parts(a))]


CONFIG_MODELS: set = set()
for _root in (TrainConfig, PoolConfig, DockerConfig, GVisorConfig, LocalConfig, ServiceConfig,
              ServeLimits):  # fmt: skip
    _models(_root, CONFIG_MODELS)


def _float_fields() -> list[tuple[type, str, typing.Any]]:
    out = []
    for model in sorted(CONFIG_MODELS, key=lambda m: m.__name__):
        for name, field in model.model_fields.items():
            if float in _parts(field.annotation):
                tupled = typing.get_origin(field.annotation) is tuple or any(
                    typing.get_origin(p) is tuple for p in _parts(field.annotation)
                )
                out.append((model, name, tupled))
    return out


FLOAT_FIELDS = _float_fields()


def test_the_walk_sees_every_section():
    names = {m.__name__ for m in CONFIG_MODELS}
    assert {"RolloutConfig", "OptimizerConfig", "AlgorithmConfig", "EngineOptions"} <= names
    assert {"EvalSection", "TrainSection", "LocalConfig", "ServiceConfig"} <= names
    assert len(FLOAT_FIELDS) > 30


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("model", "name", "tupled"), FLOAT_FIELDS, ids=[f"{m.__name__}.{n}" for m, n, _ in FLOAT_FIELDS]
)
def test_every_float_field_refuses_non_finite_numbers(model, name, tupled, bad):
    value = (bad, 0.5) if tupled else bad
    data = {"type": model.model_fields["type"].default} if "type" in model.model_fields else {}
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate({**data, name: value})
    assert any(err["loc"][0] == name for err in info.value.errors()), info.value


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["optimizer.betas=[2,-1]"], "optimizer.betas.0: Input should be less than 1 (got 2); "
         "optimizer.betas.1: Input should be greater than or equal to 0 (got -1)"),
        (["optimizer.betas=[.nan,.nan]"], "optimizer.betas.0: Input should be a finite number"),
        (["optimizer.betas=[0.9,1]"], "optimizer.betas.1: Input should be less than 1"),
        (["rollout.temperature=.inf"], "rollout.temperature: Input should be a finite number"),
        (["optimizer.lr=.inf"], "optimizer.lr: Input should be a finite number (got inf)"),
        (["optimizer.eps=.inf"], "optimizer.eps: Input should be a finite number"),
        (["optimizer.weight_decay=.inf"], "optimizer.weight_decay: Input should be a finite"),
        (["train.pass_threshold=.nan"], "train.pass_threshold: Input should be a finite number"),
        (["eval.temperature=-.inf"], "eval.temperature: Input should be a finite number"),
        (["train.collective_timeout_s=1e20"], "train.collective_timeout_s: Input should be less"),
        (["eval.split=validation"],
         "eval.split: Input should be 'train' or 'eval' (got 'validation')"),
        (["engine.dtype=int64"], "engine.dtype: dtype must be one of float32, bfloat16, "
         "float16, float64, got 'int64'"),
        (["engine.dtype=float33"], "engine.dtype: dtype must be one of"),
        (["server.urls=[router:30000]"],
         "server.urls: server URL 'router:30000': expected http(s)://HOST:PORT"),
        (["server.urls=[http://a:1,http://b:2/,http://a:1/]"],
         "server.urls: server URL 'http://a:1/' is given twice (as 'http://a:1')"),
        (["server.urls=[http://a:99999]"], "server.urls: server URL 'http://a:99999'"),
        # YAML's true/yes where a number is due was read as 1
        (["train.tasks_per_step=true"],
         "train.tasks_per_step: a number is due here, not a boolean (got True)"),
        (["rollout.group_size=yes"], "rollout.group_size: a number is due here, not a boolean"),
        (["algorithm.clip_low=false"], "algorithm.clip_low: a number is due here, not a boolean"),
        (["optimizer.lr=true"], "optimizer.lr: a number is due here, not a boolean"),
        (["engine.max_batch_size=true"], "engine.max_batch_size: a number is due here"),
        (["sandbox={backend: {type: local}, size: true}"],
         "sandbox: size: a number is due here, not a boolean"),
    ],
)  # fmt: skip
def test_values_that_could_only_fail_later_are_refused_at_load(sets, needle):
    assert needle in refused(*sets)


def test_values_inside_the_bounds_still_load():
    sets = ["optimizer.betas=[0,0.5]", "eval.split=train", "engine.dtype=bfloat16"]
    cfg = load_train_config(None, [*BASE, *sets, "train.pass_threshold=0.5"])
    assert cfg.optimizer.betas == (0.0, 0.5) and cfg.eval.split == "train"
    assert load_train_config(None, [*BASE, "engine.dtype=half"]).engine.dtype == "half"
    assert OptimizerConfig().betas == (0.9, 0.999) and AlgorithmConfig().gamma == 1.0
    assert RolloutConfig(temperature=1e6).temperature == 1e6
    assert EngineOptions(dtype="float64").dtype == "float64"


# -- the file and --set values go through the one reader -----------------------------------------


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"model: tiny-random\n\xff\xfe: 1\n")
    assert f"{path}: line 2: not UTF-8 text" in refused(path=path)


def test_a_section_written_twice_is_refused_not_merged(tmp_path):
    """``train`` twice used to keep only the second (max_steps silently back to 100)."""
    path = tmp_path / "dup.yaml"
    path.write_text("train: {max_steps: 5}\nrollout: {group_size: 2}\ntrain: {tasks_per_step: 1}\n")
    assert "line 3: key 'train' appears twice in one mapping (first at line 1)" in refused(
        path=path
    )


def test_set_values_refuse_repeated_keys_and_alias_bombs():
    assert "--set rollout.env_kwargs: line 1: key 'levels' appears twice" in refused(
        "rollout.env_kwargs={levels: [0], levels: [1]}"
    )
    chain = ["&a [" + ",".join(["x"] * 10) + "]"]
    for prev, name in zip("abcdef", "bcdefg", strict=True):  # 10 ** 7 values on one line
        chain.append(f"&{name} [" + ",".join([f"*{prev}"] * 10) + "]")
    message = refused(f"rollout.env_kwargs.x=[{', '.join(chain)}]")
    assert "once its aliases (*name) are expanded" in message
    assert load_train_config(None, [*BASE, "model=not: yaml: here"]).model == "not: yaml: here"


def test_an_alias_bomb_in_env_kwargs_is_refused_before_anything_expands_it(tmp_path):
    lines = ["a: &a [x,x,x,x,x,x,x,x,x,x]"] + [
        f"{n}: &{n} [{','.join([f'*{p}'] * 10)}]" for p, n in zip("abcdef", "bcdefg", strict=True)
    ]
    path = tmp_path / "bomb.yaml"
    path.write_text("rollout:\n  group_size: 2\n  env_kwargs:\n"
                    + "".join(f"    {line}\n" for line in lines))  # fmt: skip
    started = time.thread_time()  # CPU time: a stall of a loaded machine is not counted
    message = refused(path=path)
    assert time.thread_time() - started < 1.0 and len(message) < 300
    assert "more than 100000 values" in message


def test_a_large_value_in_an_error_is_shortened():
    huge = "[" + ",".join(["1"] * 50_000) + "]"
    message = refused(f"rollout.top_p={huge}")
    assert "rollout.top_p: " in message and len(message) < 300


def test_env_kwargs_within_the_bound_dump_and_hash(tmp_path):
    cfg = load_train_config(None, [*BASE, "rollout.env_kwargs.levels=[0, 1]"])
    assert "levels" in dump_config(cfg) and len(cfg.hash()) == 16


# Hashes that runs written before ``algorithm.clip_ratio_c`` and ``rollout.max_tool_output_chars``
# existed carry in their checkpoints (computed by that code): a resume compares against them, so
# they must never change.
_RECORDED_HASHES = [
    ({"env": "calc-v0", "model": "tiny-random"}, "bf7d752181cb7747"),
    (
        {
            "env": "calc-v0",
            "model": "tiny-random",
            "algorithm": {"name": "dapo", "clip_high": 0.3},
            "rollout": {"group_size": 8},
            "optimizer": {"lr": 2e-6, "schedule": "cosine"},
        },
        "a1c235cf03674373",
    ),
]


def _field(cfg: TrainConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize(("data", "recorded_hash"), _RECORDED_HASHES)
def test_runs_from_before_a_field_existed_resume_as_they_were_trained(
    tmp_path, data, recorded_hash
):
    """A run's config.yaml written before fields were added lacks them: loaded as a run's own
    file each takes the value that reproduces that run (no dual clip, no tool-output cap), and
    it hashes as that run's checkpoints say; a new run gets the defaults, which hash
    differently."""
    fresh = TrainConfig.model_validate(data)
    assert fresh.algorithm.clip_ratio_c == 3.0 and fresh.hash() != recorded_hash
    assert fresh.rollout.max_tool_output_chars == 1 << 20
    old = yaml.safe_load(dump_config(fresh))
    for dotted in LEGACY_VALUES:
        section, leaf = dotted.split(".")
        del old[section][leaf]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    resumed = load_train_config(path, recorded=True)
    assert {dotted: _field(resumed, dotted) for dotted in LEGACY_VALUES} == LEGACY_VALUES
    assert resumed.hash() == recorded_hash
    assert load_train_config(path).hash() == fresh.hash()  # as a new run's --config
    turned_on = load_train_config(
        path,
        ["algorithm.clip_ratio_c=3.0", f"rollout.max_tool_output_chars={1 << 20}"],
        recorded=True,
    )
    assert turned_on.hash() == fresh.hash()
