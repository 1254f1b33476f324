"""What README.md, docs/*.md and the example configs tell a user to copy works as written:
every ```python block runs, every ```yaml block is a valid (partial) run configuration, every
flag of an ``agentrl ...`` command they show (the examples: in their comments) exists in that
command's ``--help``, and an ``$ agentrl plan ...`` block prints what it shows.
``docs/reference/`` is generated and checked by test_reference_docs.py.

A python block that cannot run in a plain test run says so on the line before it:
``<!-- snippet: not run (REASON) -->``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from agentrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- snippet: not run"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# ``agentrl`` (or ``-m agentrl.cli`` under torchrun) and what follows it on that line
COMMAND = re.compile(r"(?:^|[\s`(])(?:agentrl|-m agentrl\.cli) ([a-z][^`\n]*)")
SUBCOMMANDS = {
    "envs": {"list", "show", "check"},
    "models": {"list", "pull"},
    "plan": {"memory", "capacity"},
    "sandbox": {"image", "serve"},
    "image": {"build"},
}
TOP = {"rollout", "inspect", "envs", "models", "doctor", "plan", "dashboard", "serve", "sandbox"}
TOP |= {"train", "eval", "export"}


def blocks(language: str) -> list[tuple[str, int, str, str]]:
    """(page, line, the line before the fence, body) of every fenced block in ``language``."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == language:
                line = text.count("\n", 0, m.start()) + 1
                before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
                found.append((page.relative_to(ROOT).as_posix(), line, before, m.group(2)))
    return found


def _ids(items: list[tuple]) -> list[str]:
    return [f"{page}:{line}" for page, line, *_ in items]


PYTHON = blocks("python")
YAML = blocks("yaml")


def test_the_pages_hold_snippets():
    assert PYTHON and TOML and len(YAML) >= 4, (PYTHON, TOML, YAML)


@pytest.mark.parametrize(("page", "line", "before", "code"), PYTHON, ids=_ids(PYTHON))
def test_python_snippet_runs_as_copied(page, line, before, code, tmp_path, tiny_model_path):
    if before.startswith(NOT_RUN):
        pytest.skip(before)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{page}:{line}\n{code}\n{proc.stdout}\n{proc.stderr}"


def test_the_readme_example_is_the_example_file():
    """README says its environment "is examples/echo_env.py": every line of it is there, in
    order (the file adds a docstring and prints the result under ``__main__``)."""
    (readme,) = [code for page, _, _, code in PYTHON if page == "README.md"]
    lines = iter(x.strip() for x in (ROOT / "examples" / "echo_env.py").read_text().splitlines())
    missing = [x.strip() for x in readme.splitlines() if x.strip() and x.strip() not in lines]
    assert not missing, missing


@pytest.mark.parametrize(("page", "line", "before", "text"), YAML, ids=_ids(YAML))
def test_yaml_snippet_is_a_valid_run_configuration(page, line, before, text, tmp_path):
    from agentrl.loop import load_train_config

    fragment = yaml.safe_load(text)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": "tiny-random", "env": "calc-v0", **fragment}))
    load_train_config(config)  # raises ConfigError naming the field


TOML = blocks("toml")


@pytest.mark.parametrize(("page", "line", "before", "text"), TOML, ids=_ids(TOML))
def test_toml_snippet_parses_and_names_the_entry_point_group(page, line, before, text):
    from agentrl._registry import ENTRY_POINT_GROUP

    groups = tomllib.loads(text).get("project", {}).get("entry-points", {})
    assert set(groups) <= {ENTRY_POINT_GROUP}, groups
    for value in groups.get(ENTRY_POINT_GROUP, {}).values():
        assert re.fullmatch(r"[\w.]+:[\w.]+", value), value  # module:attr


def _help(path: tuple[str, ...]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0, path
    return out.getvalue()


EXAMPLES = sorted((ROOT / "examples").glob("*.y*ml"))
"""Example configs whose comments show the commands that use them."""


def _command_lines() -> list[tuple[str, str]]:
    """(page, command text after ``agentrl``) of every command in code spans and blocks, and
    in the example configs' comments."""
    found = []
    for page in [*PAGES, *EXAMPLES]:
        text = page.read_text()
        if page.suffix != ".md":
            code = [line.lstrip("# ") for line in text.splitlines() if line.startswith("#")]
        else:
            code = [m.group(2) for m in FENCE.finditer(text)]
            code += re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
        for chunk in code:
            chunk = chunk.replace("\\\n", " ")
            for m in COMMAND.finditer(chunk):
                found.append((page.relative_to(ROOT).as_posix(), m.group(1).split(" #")[0]))
    return found


def test_every_documented_flag_exists():
    helps: dict[tuple[str, ...], str] = {}
    unknown = []
    commands = _command_lines()
    assert len(commands) > 40, commands
    for page, command in commands:
        words = command.split()
        if not words or words[0] not in TOP:
            continue  # prose such as "agentrl runs model-written code"
        path = [words[0]]
        for word in words[1:]:
            if word not in SUBCOMMANDS.get(path[-1], ()):
                break
            path.append(word)
        key = tuple(path)
        if key not in helps:
            helps[key] = _help(key)
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[key]):
                unknown.append(f"{page}: agentrl {' '.join(key)} has no {flag}: {command}")
    assert not unknown, "\n".join(unknown)


def test_documented_extras_exist():
    extras = set(re.findall(r"^(\w+) = \[", _section(ROOT / "pyproject.toml"), re.M))
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"agentrl\[(\w+)\]", page.read_text()))
        for m in re.finditer(r"the extras are ((?:`\w+`(?:, | and )?)+)", page.read_text()):
            named |= set(re.findall(r"`(\w+)`", m.group(1)))
    assert named and named <= extras, named - extras


def _section(path: Path) -> str:
    text = path.read_text()
    start = text.index("[project.optional-dependencies]")
    end = text.index("\n[", start + 1)
    return text[start:end]


PLAN_OUTPUTS = [
    (page, line, body) for page, line, _, body in blocks("") if body.startswith("$ agentrl plan ")
]


@pytest.mark.parametrize(("page", "line", "body"), PLAN_OUTPUTS, ids=_ids(PLAN_OUTPUTS))
def test_plan_example_prints_what_the_page_shows(page, line, body, capsys):
    command, *shown = body.replace("\\\n", " ").splitlines()
    argv = shlex.split(command.removeprefix("$ agentrl "))
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    if shown:
        assert printed == shown, f"{page}:{line}"


def test_plan_examples_are_found():
    assert len(PLAN_OUTPUTS) >= 2, PLAN_OUTPUTS
