"""The two reference pages: every configuration field (``config.md``) and the environment API
(``env-api.md``), rendered from the code, and the check that the committed files are current."""

from __future__ import annotations

import difflib
from pathlib import Path

from ._describe import value_text
from ._pages import HEADER, ModelPage, cell, function_section, struct_section

REFRESH = "python -m agentrl.docs"
"""The command that rewrites the pages (run from the repository root)."""


def config_reference() -> str:
    """``docs/reference/config.md``: the training config and every section, the algorithm
    table, the sandbox pool config and the scripted engine's file format."""
    from agentrl._config_file import MAX_VALUES
    from agentrl.engine import ScriptFile
    from agentrl.loop import TrainConfig
    from agentrl.loop._config import MOVED_SETTINGS
    from agentrl.sandboxes import PoolConfig
    from agentrl.trainer import AlgorithmConfig, DeepSpeedSection
    from agentrl.trainer._deepspeed import OWNED_KEYS

    def moved() -> list[str]:
        rows = ["Settings that moved (a config that still uses the old place is refused, naming "
                "the new one):", "", "| old place | its one home |", "|---|---|"]  # fmt: skip
        return rows + [f"| `{'.'.join(old)}` | `{new}` |" for old, new in MOVED_SETTINGS.items()]

    def owned() -> list[str]:
        rows = ["Keys another section sets (refused here):", "", "| key | its home |", "|---|---|"]
        return rows + [f"| `{key}` | {cell(home)} |" for key, home in OWNED_KEYS.items()]

    page = ModelPage(
        notes={
            TrainConfig: moved,
            AlgorithmConfig: lambda: ["The algorithms are listed [below](#algorithms)."],
            DeepSpeedSection: owned,
        }
    )
    page.lines += [
        "# Configuration reference",
        "",
        HEADER,
        "",
        "Every config model refuses unknown fields and numbers that are not finite (NaN, "
        "infinities); an error names the field (dotted) and the value (shortened when long). "
        "Files are read as UTF-8 (JSON for `.json`, YAML otherwise, `--set` values too); a key "
        "written twice in one mapping is refused, and so is a document holding more than "
        f"{MAX_VALUES:,} values once its YAML aliases (`*name`) are expanded. Defaults are "
        "shown as YAML/JSON values; `(section)` is a nested section with its own defaults.",
        "",
        "- [Training config](#train) (`agentrl train --config FILE`; its `rollout` and `engine` "
        "sections are also what `agentrl rollout --config FILE` reads)",
        "- [Algorithms](#algorithms) (`algorithm.name`)",
        "- [Sandbox pool](#pool) (`--sandbox FILE.json`, `agentrl sandbox serve`)",
        "- [Scripted engine file](#script) (`agentrl rollout --engine scripted:FILE`)",
        "",
    ]
    page.add(TrainConfig, title="Training config: `agentrl.loop.TrainConfig`", anchor="train")
    page.lines += _algorithm_table()
    page.add(PoolConfig, title="Sandbox pool: `agentrl.sandboxes.PoolConfig`", anchor="pool")
    page.add(ScriptFile, title="Scripted engine file: `agentrl.engine.ScriptFile`", anchor="script")
    return _finish(page.lines)


def _algorithm_table() -> list[str]:
    from agentrl.trainer import algorithm_names, algorithm_spec

    lines = [
        '## <a id="algorithms"></a>Algorithms',
        "",
        "One row per registered algorithm (`agentrl.trainer.register_algorithm`): what "
        "`algorithm.name` selects. The `algorithm` settings left unset take the row's values; "
        "group estimators need `rollout.group_size >= 2`, `gae` opens a critic, `kl_coef > 0` a "
        "frozen reference.",
        "",
        "| name | advantages | surrogate | clip_low | clip_high | agg | dynamic_sampling | "
        "overlong_filter | kl_coef | needs | what it is |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in algorithm_names():
        a = algorithm_spec(name)
        needs = "critic" if a.needs_critic else "groups"
        values = [a.clip_low, a.clip_high, a.agg, a.dynamic_sampling, a.overlong_filter, a.kl_coef]
        row = [f"`{a.name}`", f"`{a.estimator_name}`", f"`{a.surrogate}`"]
        row += [f"`{value_text(v)}`" for v in values] + [needs, cell(a.summary)]
        lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""]


def env_api_reference() -> str:
    """``docs/reference/env-api.md``: the hooks an environment implements, the functions that
    register, build and check one, and the types it sees and produces."""
    import agentrl
    from agentrl import _env, _types
    from agentrl._checker import check_env
    from agentrl.engine import Engine

    lines = [
        "# Environment API reference",
        "",
        HEADER,
        "",
        "An environment is any class (or factory) with the hooks below, registered with "
        "`@agentrl.env`; it sees and returns `Message`s, never tokens. The runtime owns the "
        "loop: generate, parse tool calls, run the tools, append, then reward.",
        "",
        "## Hooks",
        "",
    ]
    hooks = [
        (_env.Env.tasks, "tasks"),
        (_env.Env.reset, "reset"),
        (_env.Env.reward, "reward"),
        (_env.Env.close, "close"),
        (_env.Responder.respond, "respond (optional)"),
        (_env.TurnRewarder.turn_reward, "turn_reward (optional)"),
    ]
    for fn, title in hooks:
        lines += _hook(fn, title)
    lines += ["## Registering, building, checking", ""]
    for fn, name in (
        (agentrl.env, "agentrl.env"),
        (agentrl.tool, "agentrl.tool"),
        (agentrl.register, "agentrl.register"),
        (agentrl.spec, "agentrl.spec"),
        (agentrl.make, "agentrl.make"),
        (check_env, "agentrl.check_env"),
    ):
        lines += function_section(fn, name)
    lines += ["## Types", ""]
    for cls in (
        _env.Task,
        _types.Message,
        _env.Reward,
        _env.Episode,
        _types.ToolCallRecord,
        _types.Trajectory,
        _types.Span,
        _types.TrajectoryError,
        _types.Timing,
        _types.SamplingParams,
        _types.GenerateResult,
        agentrl.EnvSpec,
    ):
        lines += struct_section(cls)
    lines += ["## Value sets", "", "| name | values |", "|---|---|"]
    for name in ("Role", "SpanSource", "TrajectoryStatus", "TerminationReason", "FinishReason"):
        lines.append(f"| `{name}` | {_literal(getattr(_types, name))} |")
    lines += [f"| `Split` | {_literal(_env.Split)} |", ""]
    lines += ["## The engine protocol", ""]
    lines += [
        "What the runtime calls to generate (`agentrl.engine.Engine`): the embedded engine, "
        "the SGLang client and the scripted engine implement it.",
        "",
    ]
    for name in ("generate", "open_session", "close_session", "update_weights", "aclose"):
        lines += function_section(getattr(Engine, name), name, level=3)
    return _finish(lines)


def _hook(fn: object, title: str) -> list[str]:
    lines = function_section(fn, fn.__name__, level=3)  # type: ignore[attr-defined]
    lines[0] = f"### `{title}`"
    return lines


def _literal(alias: object) -> str:
    import typing

    return ", ".join(f"`{v}`" for v in typing.get_args(alias))


def _finish(lines: list[str]) -> str:
    text = "\n".join(lines).rstrip() + "\n"
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


PAGES = {"config.md": config_reference, "env-api.md": env_api_reference}
"""File name under ``docs/reference`` → its renderer."""


def write_reference(folder: str | Path) -> list[Path]:
    """Render every page into ``folder``; returns the files written."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, render in PAGES.items():
        path = out / name
        path.write_text(render())
        written.append(path)
    return written


def stale_pages(folder: str | Path) -> dict[str, str]:
    """``{file name: unified diff}`` for each page whose committed text differs from what the
    code renders now (a missing file counts); empty when all are current."""
    stale = {}
    for name, render in PAGES.items():
        path = Path(folder) / name
        current = path.read_text() if path.is_file() else ""
        fresh = render()
        if current != fresh:
            diff = difflib.unified_diff(
                current.splitlines(keepends=True),
                fresh.splitlines(keepends=True),
                f"{name} (committed)",
                f"{name} (from the code)",
                n=1,
            )
            stale[name] = "".join(diff)
    return stale
