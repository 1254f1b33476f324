"""The generated reference (``docs/reference/``): current with the code, complete (every field of
every config model and env API type, each documented), and its check catches a stale page."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from agentrl.docs import (
    PAGES,
    REFRESH,
    MissingDocstring,
    config_reference,
    env_api_reference,
    stale_pages,
)
from agentrl.docs._describe import fields_of

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "docs" / "reference"


def test_committed_reference_is_current():
    stale = stale_pages(FOLDER)
    assert not stale, (
        f"docs/reference is stale ({', '.join(stale)}): refresh it with `{REFRESH}` from the "
        "repository root and commit the result.\n" + "\n".join(stale.values())
    )


def _models(cls: type, seen: set[type]) -> None:
    """Every pydantic model reachable from ``cls`` through its fields."""
    from agentrl.docs._describe import nested_model, union_models

    if cls in seen:
        return
    seen.add(cls)
    for info in cls.model_fields.values():
        for model in [nested_model(info.annotation), *union_models(info.annotation)]:
            if model is not None:
                _models(model, seen)


def test_every_config_field_is_in_the_reference():
    """Each field of every model reachable from the training config, the sandbox pool config
    and the scripted-engine file appears in its section's table, with its docstring."""
    from agentrl.engine import EngineOptions, ScriptFile
    from agentrl.loop import TrainConfig
    from agentrl.sandboxes import PoolConfig

    text = config_reference()
    models: set[type] = set()
    for root in (TrainConfig, PoolConfig, ScriptFile):
        _models(root, models)
    assert EngineOptions in models and len(models) >= 15
    for model in models:
        for field in fields_of(model):
            first_words = " ".join(field.doc.replace("``", "`").split()[:4])
            assert f"| `{field.name}` |" in text, f"{model.__name__}.{field.name}"
            assert first_words in text, f"{model.__name__}.{field.name}: {first_words!r}"


def test_every_algorithm_and_moved_setting_is_in_the_reference():
    from agentrl.loop._config import MOVED_SETTINGS
    from agentrl.trainer import algorithm_names, algorithm_spec

    text = config_reference()
    for name in algorithm_names():
        spec = algorithm_spec(name)
        assert f"| `{name}` | `{spec.estimator_name}` | `{spec.surrogate}` |" in text
    for old, new in MOVED_SETTINGS.items():
        assert f"| `{'.'.join(old)}` | `{new}` |" in text


def test_env_api_reference_covers_the_types_and_hooks():
    import agentrl
    from agentrl import _types

    text = env_api_reference()
    for cls in (agentrl.Task, agentrl.Message, agentrl.Episode, agentrl.Reward):
        assert f"`agentrl.{cls.__name__}`" in text
        for field in fields_of(cls):
            assert f"| `{field.name}` |" in text
    for cls in (_types.ToolCallRecord, _types.Trajectory, _types.GenerateResult):
        for field in fields_of(cls):
            assert f"| `{field.name}` |" in text, f"{cls.__name__}.{field.name}"
    for hook in ("tasks", "reset", "reward", "close", "respond (optional)"):
        assert f"### `{hook}`" in text
    assert "agentrl.env(env_id: str" in text and "agentrl.check_env(" in text


def test_an_undocumented_field_is_refused():
    class Section(pydantic.BaseModel):
        documented: int = 1
        """Has its docstring."""
        bare: int = 2

    with pytest.raises(MissingDocstring, match="Section: fields without a docstring: bare"):
        fields_of(Section)


def test_check_command_fails_on_a_stale_page_and_names_the_refresh(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = [sys.executable, "-m", "agentrl.docs", "--out", str(tmp_path)]
    written = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PAGES)
    current = subprocess.run([*run, "--check"], env=env, capture_output=True, text=True)
    assert current.returncode == 0 and "current" in current.stdout, current.stderr
    page = tmp_path / "config.md"
    page.write_text(page.read_text().replace("Peak learning rate.", "Peak rate."))
    stale = subprocess.run([*run, "--check"], env=env, capture_output=True, text=True)
    assert stale.returncode == 1
    assert "config.md is stale" in stale.stderr and f"refresh with: {REFRESH}" in stale.stderr
    assert "-| `lr` |" in stale.stdout and "+| `lr` |" in stale.stdout
