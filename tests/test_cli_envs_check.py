"""``agentrl envs check``: the environment checker from the command line, one line per id, exit 1
when any fails (the others still checked), ``--all`` for every registered id."""

from __future__ import annotations

import subprocess
from pathlib import Path

from cli_helpers import REPO, run_cli

BROKEN = '''
import itertools

import agentrl
from agentrl import Message, Task

CALLS = itertools.count()


@agentrl.env("shuffled-v0")
class Shuffled:
    """Tasks in another order on every call: check_env must refuse it."""

    def tasks(self, split, *, seed=0):
        ids = [f"{split}-{i}" for i in range(5)]
        turn = next(CALLS) % len(ids)
        return [Task(id=i, prompt="hi") for i in ids[turn:] + ids[:turn]]

    async def reset(self, task):
        return [Message("user", task.prompt)]

    async def reward(self, episode):
        return 0.0

    async def close(self):
        return None


@agentrl.env("fine-v0")
class Fine(Shuffled):
    def tasks(self, split, *, seed=0):
        return [Task(id=f"{split}-{i}", prompt="hi") for i in range(5)]


@agentrl.env("stuck-v0")
class Stuck(Fine):
    """A verifier that never returns (a blocking call: only a thread can be left behind)."""

    def reward(self, episode):
        import time

        time.sleep(3600)
'''


def agentrl_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, columns=200)


def test_check_one_env_passes():
    proc = agentrl_cli("envs", "check", "calc-v0")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "ok   calc-v0" in proc.stdout
    assert "all 1 environment(s) pass the contract checks" in proc.stdout


def test_check_all_covers_every_registered_id():
    proc = agentrl_cli("envs", "check", "--all")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    checked = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")]
    entry_points = {"calc-v0", "python-math-v0", "code-tests-v0"}  # what a fresh process sees
    assert entry_points <= set(checked) and len(set(checked)) == len(checked)
    assert f"all {len(checked)} environment(s) pass" in proc.stdout


def test_a_failing_env_is_reported_and_the_others_still_run(tmp_path):
    (tmp_path / "broken_envs.py").write_text(BROKEN)
    proc = agentrl_cli(
        "envs", "check", "broken_envs:shuffled-v0", "fine-v0", "nope-v0", cwd=tmp_path
    )
    assert proc.returncode == 1, proc.stderr + proc.stdout
    out = " ".join(proc.stdout.split())
    assert "FAIL broken_envs:shuffled-v0: shuffled-v0: tasks('train', seed=0) is not" in out
    assert "ok fine-v0" in out
    assert "FAIL nope-v0: no environment named 'nope'" in out
    assert "2 failed, 1 passed" in out


def test_env_kwargs_reach_the_factory_and_bad_input_is_named():
    bad_level = agentrl_cli("envs", "check", "calc-v0", "--env-kwargs", '{"levels": [9]}')
    assert bad_level.returncode == 1 and "levels" in bad_level.stdout, bad_level.stdout
    assert (
        agentrl_cli("envs", "check", "calc-v0", "--env-kwargs", '{"levels": [0]}').returncode == 0
    )
    for args, needle in (
        ([], "give environment ids, or --all"),
        (["calc-v0", "--env-kwargs", "{bad"], "--env-kwargs is not valid JSON"),
        (["calc-v0", "--env-kwargs", "[1]"], "--env-kwargs must be a JSON object"),
        (["calc-v0", "--timeout-s", "0"], "--timeout-s must be a number of seconds > 0, got 0.0"),
        (["calc-v0", "--timeout-s", "nan"], "--timeout-s must be a number of seconds > 0"),
    ):
        proc = agentrl_cli("envs", "check", *args)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_a_hook_that_hangs_fails_by_name_within_the_deadline(tmp_path):
    """A hanging hook is a failed check (named, with the deadline), not a hung command; the
    ids after it are still checked."""
    (tmp_path / "broken_envs.py").write_text(BROKEN)
    proc = agentrl_cli(
        "envs", "check", "broken_envs:stuck-v0", "fine-v0", "--timeout-s", "1", cwd=tmp_path
    )
    assert proc.returncode == 1, proc.stderr + proc.stdout
    out = " ".join(proc.stdout.split())
    assert (
        "FAIL broken_envs:stuck-v0: stuck-v0: reward() of an episode with an empty answer did "
        "not finish within 1 s (check_env timeout_s)" in out
    ), out
    assert "ok fine-v0" in out and "1 failed, 1 passed" in out


HOSTILE = """
import agentrl
from agentrl import Message, Task


@agentrl.env("hostile-text-v0", description="a [/] b [bold]x \\x1b]0;OWNED\\x07 title")
class HostileText:
    def tasks(self, split, *, seed=0):
        if split == "eval":
            raise ValueError("bad path [/data/x] \\x1b[2J")
        return [Task(id="a", prompt="hi")]

    async def reset(self, task):
        raise ValueError("split must be one of [train, eval] \\x1b[2J")

    async def reward(self, episode):
        return 0.0

    async def close(self):
        return None
"""


def test_an_envs_text_is_shown_as_text(tmp_path):
    """An env's description, errors and tasks were printed as rich markup (``[/]`` crashed the
    command with a MarkupError, ``[train, eval]`` vanished) and reached the terminal with their
    escape sequences; ``envs show`` raised on a split whose tasks() fails."""
    (tmp_path / "hostile_text.py").write_text(HOSTILE)
    show = agentrl_cli("envs", "show", "hostile_text:hostile-text-v0", cwd=tmp_path)
    assert show.returncode == 0, show.stderr[-3000:]
    assert "\x1b" not in show.stdout and "\x07" not in show.stdout
    assert "a [/] b [bold]x \\x1b]0;OWNED\\x07 title" in show.stdout
    assert "eval: hostile-text-v0: tasks('eval', seed=0) raised ValueError: bad path [/data/x]" \
        in " ".join(show.stdout.split())  # fmt: skip
    check = agentrl_cli("envs", "check", "hostile_text:hostile-text-v0", cwd=tmp_path)
    assert check.returncode == 1 and "Traceback" not in check.stderr, check.stderr[-3000:]
    out = " ".join(check.stdout.split())
    assert "\x1b" not in check.stdout and "bad path [/data/x] \\x1b[2J" in out, out
