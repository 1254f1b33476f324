"""The scripted engine: replays a file of assistant turns through the ``Engine`` protocol,
token-in/token-out (the real SmolLM2 tokenizer), so an env's tools run end to end without a model
that calls them: unit behaviour, file formats, and ``agentrl rollout --engine scripted:FILE`` on
calc-v0 and python-math-v0 (local sandbox) with the mask and boundary checks."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import anyio
import pydantic
import pytest
from cli_helpers import REPO, run_cli

import agentrl
from agentrl import ConfigError, EngineError, SamplingParams, read_trajectories
from agentrl.engine import Engine, Script, ScriptedEngine, read_script
from agentrl.formats import check_boundary

STOP_IDS = [0, 2]  # <|endoftext|>, <|im_end|>


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def sampling(max_new_tokens: int = 64, stop: tuple[str, ...] = ("</tool_call>",)):
    return SamplingParams(
        max_new_tokens=max_new_tokens, stop=list(stop), stop_token_ids=STOP_IDS, seed=1
    )


def generate(engine, ids, params, session=None):
    return anyio.run(lambda: engine.generate(ids, params, session))


# -- the engine ------------------------------------------------------------------------------


def test_turns_are_tokenized_with_the_model_tokenizer_and_end_like_a_chat_model(tokenizer):
    engine = ScriptedEngine(tokenizer, ["The answer is <answer>5</answer>"])
    assert isinstance(engine, Engine)
    prompt = tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    out = generate(engine, prompt, sampling())
    text_ids = tokenizer("The answer is <answer>5</answer>", add_special_tokens=False)
    assert out.token_ids == [*text_ids["input_ids"], 2]  # then <|im_end|>, as a model samples it
    assert out.finish_reason == "stop" and out.matched_stop == 2
    assert out.logprobs == [0.0] * len(out.token_ids)  # synthetic, documented
    assert out.prompt_tokens == len(prompt) and out.weight_version == 0


def test_stop_strings_and_the_token_budget_cut_like_a_real_engine(tokenizer):
    text = call("calculator", expression="2 + 3") + " and then some text"
    engine = ScriptedEngine(tokenizer, [text, "x " * 50])
    out = generate(engine, [1, 2, 3], sampling())
    decoded = tokenizer.decode(out.token_ids)
    assert decoded.endswith("</tool_call>") and "then some" not in decoded
    assert out.finish_reason == "stop" and out.matched_stop == "</tool_call>"
    cut = generate(engine, [*[1, 2, 3], *out.token_ids, 5], sampling(max_new_tokens=7))
    assert len(cut.token_ids) == 7 and cut.finish_reason == "length" and cut.matched_stop is None


def test_each_trajectory_follows_its_own_script(tokenizer, tmp_path):
    """Sessions tell trajectories apart; without one, a context that extends an earlier answer
    continues that trajectory; a fresh prompt starts a new one; ``match`` picks the script."""
    script = read_script_text(
        tmp_path,
        {"scripts": [{"match": "apples", "turns": ["A1", "A2"]}, {"turns": ["B1", "B2"]}]},
    )
    engine = ScriptedEngine(tokenizer, script)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def text(result) -> str:
        return tokenizer.decode(result.token_ids, skip_special_tokens=True)

    async def main() -> None:
        s1, s2 = await engine.open_session(), await engine.open_session()
        apples, pears = ids("3 apples?"), ids("3 pears?")
        assert text(await engine.generate(apples, sampling(), s1)) == "A1"
        assert text(await engine.generate(pears, sampling(), s2)) == "B1"
        assert text(await engine.generate(apples + [9], sampling(), s1)) == "A2"
        await engine.close_session(s1)
        with pytest.raises(EngineError, match="unknown session"):
            await engine.generate(apples, sampling(), s1)
        first = await engine.generate(pears, sampling())  # no session
        assert text(first) == "B1"
        again = await engine.generate(pears, sampling())  # another trajectory, same prompt
        assert text(again) == "B1"
        follow = await engine.generate([*pears, *first.token_ids, 198, 77], sampling())
        assert text(follow) == "B2"
        with pytest.raises(EngineError, match="the script has 2 turn"):
            third = [*pears, *first.token_ids, 198, 77, *follow.token_ids, 5]
            await engine.generate(third, sampling())

    anyio.run(main)


def read_script_text(folder: Path, data):
    """A script file (JSON is YAML) read back through ``read_script``."""
    path = folder / "script.yaml"
    path.write_text(json.dumps(data))
    return read_script(path)


def test_script_files_yaml_and_jsonl(tmp_path):
    (tmp_path / "a.yaml").write_text("- one\n- two\n")
    (tmp_path / "b.yaml").write_text("turns: [one, two]\n")
    (tmp_path / "c.jsonl").write_text('"one"\n\n{"text": "two"}\n')
    for name in ("a.yaml", "b.yaml", "c.jsonl"):
        script = read_script(tmp_path / name)
        assert [s.turns for s in script.scripts] == [["one", "two"]], name
    bad = {
        "d.yaml": ("scripts: [{turns: []}]", "scripts.0.turns"),
        "e.yaml": ("scripts: [{turn: [a]}]", "scripts.0.turn"),
        "f.jsonl": ('"one"\n[1, 2]\n', "f.jsonl:2"),
        "g.jsonl": ('"one"\n{oops\n', "g.jsonl:2 is not valid JSON"),
        "h.yaml": ("turns: [a\n", "cannot parse"),
    }
    for name, (content, needle) in bad.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
            read_script(tmp_path / name)
    with pytest.raises(ConfigError, match="no such script file"):
        read_script(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        (
            "lone.jsonl",
            '"fine"\n\n"bad \\ud800 surrogate"\n',
            "lone.jsonl:3: invalid script: turn 2: the text is not valid Unicode: a lone "
            "surrogate U+D800 at character 5",
        ),
        (
            "low.jsonl",
            '{"text": "\\udc00 first"}\n',
            "low.jsonl:1: invalid script: turn 1: the text is not valid Unicode: a lone "
            "surrogate U+DC00 at character 1",
        ),
    ],
)
def test_a_lone_surrogate_is_refused_when_the_script_is_read(tmp_path, name, content, needle):
    """A text that cannot be encoded cannot be tokenized: refused at load, naming the line,
    not by the tokenizer in every trajectory."""
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        read_script(tmp_path / name)


def test_a_lone_surrogate_is_refused_by_the_engine_and_the_model(tokenizer):
    with pytest.raises(pydantic.ValidationError, match="not valid Unicode: a lone surrogate"):
        ScriptedEngine(tokenizer, ["fine", "half a pair \ud83d"])
    with pytest.raises(pydantic.ValidationError, match=r"match\n.*not valid Unicode"):
        Script(match="\udfff", turns=["fine"])
    assert Script(match="😀", turns=["a whole pair 😀"]).turns == ["a whole pair 😀"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("- one\n- two\n- 5\n", "x.yaml:3: invalid script: turn 3: Input should be a valid string"),
        (
            "turns:\n  - one\n  - [a]\n",
            "x.yaml:3: invalid script: turns.1: Input should be a valid",
        ),
        (
            "scripts:\n  - match: a\n    turns: [one]\n  - match: b\n    turns: []\n",
            "x.yaml:5: invalid script: scripts.1.turns: List should have at least 1 item",
        ),
        (
            "scripts:\n  - turns: [one]\n    matches: a\n  - turns: [two, {x: 1}]\n",
            "x.yaml: lines 3, 4: invalid script: scripts.0.matches: Extra inputs are not "
            "permitted (got 'a'); scripts.1.turns.1: Input should be a valid string",
        ),
        ("hello\n", "x.yaml:1: invalid script: Input should be a valid dictionary"),
    ],
)
def test_bad_script_entries_name_their_line(tmp_path, content, needle):
    (tmp_path / "x.yaml").write_text(content)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        read_script(tmp_path / "x.yaml")


def test_no_matching_script_is_an_engine_error(tokenizer, tmp_path):
    script = read_script_text(tmp_path, {"scripts": [{"match": "zebra", "turns": ["x"]}]})
    with pytest.raises(EngineError, match="no script matches this prompt"):
        generate(ScriptedEngine(tokenizer, script), [1, 2, 3], sampling())


# -- end to end: the runtime, the env's real tools, the checks ------------------------------


def agentrl_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, columns=160)


def _check_masks(trajectories, tokenizer) -> None:
    fmt = agentrl.formats.get_format("chatml-hermes", tokenizer)
    for traj in trajectories:
        traj.validate()
        report = check_boundary(fmt, traj)
        assert report.ok, report.message


def test_rollout_replays_a_script_through_calc_tools(tmp_path, tokenizer, tiny_model_path):
    """The calculator runs on the scripted calls; the answer it computed earns the reward; a
    malformed call and an unknown tool are recorded as the runtime records them."""
    first, second = agentrl.make("calc-v0", levels=[2]).tasks("train", seed=0)[:2]
    operands = [word for word in first.prompt.split() if word.isdigit()]
    solve = [
        call("calculator", expression=" * ".join(operands)),
        f"<answer>{first.answer}</answer>",
    ]
    fumble = ["<tool_call>\n{not json\n</tool_call>", call("abacus", x=1), "no idea"]
    path = tmp_path / "calc.yaml"
    path.write_text(
        json.dumps({"scripts": [{"match": first.prompt, "turns": solve}, {"turns": fumble}]})
    )
    out = tmp_path / "run"
    proc = agentrl_cli(
        "rollout", "--env", "calc-v0", "--model", "tiny-random", "--engine", f"scripted:{path}",
        "--env-kwargs", '{"levels": [2]}', "-n", "2", "--group", "2", "--out", str(out),
        "--check",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "boundary check: all 4 trajectories match the re-render" in proc.stdout
    trajectories = read_trajectories(str(out / "trajectories.jsonl"))
    _check_masks(trajectories, tokenizer)
    # not a model's samples: every trajectory and the run's config say so
    assert all(t.info.get("logprobs") == "synthetic" for t in trajectories)
    assert json.loads((out / "config.json").read_text())["engine"] == "ScriptedEngine"
    solved = [t for t in trajectories if t.task_id == first.id]
    assert len(solved) == 2
    for t in solved:
        assert t.status == "done" and t.reward == 1.0
        (record,) = t.tool_calls
        assert record.ok and record.name == "calculator" and record.output == first.answer
        assert all(lp == 0.0 for lp in t.logprobs if lp is not None)
    fumbled = [t for t in trajectories if t.task_id == second.id]
    assert len(fumbled) == 2
    for t in fumbled:
        assert [r.error_kind for r in t.tool_calls] == ["parse_error", "unknown_tool"]
        assert t.status == "done" and t.reward == 0.0 and t.num_turns == 3


def test_rollout_replays_a_script_through_a_local_sandbox(tmp_path, tokenizer, tiny_model_path):
    """python-math-v0: the scripted program runs in the local sandbox; its printed result is
    what the script's answer repeats; the verifier grades it."""
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is not installed (scripts/services start installs it)")
    task = agentrl.make("python-math-v0").tasks("train", seed=0)[2]  # a 50% discount of $120
    program = "price = 120\nprint(price * (100 - 50) / 100)"
    path = tmp_path / "math.jsonl"
    lines = [call("run_python", code=program), "The new price is \\boxed{60}."]
    path.write_text("\n".join(json.dumps({"text": line}) for line in lines) + "\n")
    out = tmp_path / "run"
    proc = agentrl_cli(
        "rollout", "--env", "python-math-v0", "--model", "tiny-random",
        "--engine", f"scripted:{path}", "--sandbox", "local", "-n", "1", "--task-offset", "2",
        "--out", str(out), "--check",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (traj,) = read_trajectories(str(out / "trajectories.jsonl"))
    _check_masks([traj], tokenizer)
    assert traj.task_id == task.id and task.answer == "60"
    (record,) = traj.tool_calls
    assert record.ok and "60.0" in record.output and "status: ok" in record.output
    assert traj.status == "done" and traj.reward == 1.0
    assert traj.reward_breakdown == {"correct": 1.0, "format": 1.0}


def test_the_example_script_runs_as_documented(tmp_path, tiny_model_path):
    """examples/calc_scripted.yaml, with the command its header gives."""
    out = tmp_path / "run"
    proc = agentrl_cli(
        "rollout", "--env", "calc-v0", "--model", "tiny-random",
        "--engine", "scripted:examples/calc_scripted.yaml", "--env-kwargs", '{"levels": [0]}',
        "-n", "2", "--check", "--dry-run", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    # written in the order they finished: sort by task
    trajectories = read_trajectories(str(out / "trajectories.jsonl"))
    first, second = sorted(trajectories, key=lambda t: t.task_id)
    assert first.task_id == "train-L0-0-0" and first.reward == 1.0
    assert [r.output for r in first.tool_calls] == ["5"]
    assert [r.output for r in second.tool_calls] == ["42"] and second.status == "done"


def test_a_bad_engine_spec_is_a_clear_error(tmp_path):
    for spec, needle in (
        ("scripted", "expected 'embedded' or 'scripted:FILE'"),
        ("sglang:x", "expected 'embedded' or 'scripted:FILE'"),
        (f"scripted:{tmp_path / 'none.yaml'}", "no such script file"),
    ):
        proc = agentrl_cli(
            "rollout", "--env", "calc-v0", "--model", "tiny-random", "--engine", spec, "-n", "1",
            "--out", str(tmp_path / "run"),
        )  # fmt: skip
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
