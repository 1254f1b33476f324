"""What environment code hands the runtime is checked (``_env_values``): a bad value ends that
trajectory as an error naming the hook and the field, the rest of the batch runs on, hooks see
copies, and every trajectory can be written as JSON."""

from __future__ import annotations

import asyncio
import math
import re

import pytest
from fakes import ScriptedEngine

import agentrl
from agentrl import Message, Reward, Task
from agentrl._errors import ConfigError, EnvError
from agentrl._rollout import RolloutContext, run_trajectory
from agentrl._runner import _sampling_part, arollout, config_diff, run_groups
from agentrl._types import encode_trajectory
from agentrl.formats import check_boundary

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]

ECHO = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
ANSWER = "done<|im_end|>"
SEEN: dict[str, list] = {}
"""What the hooks of an env saw, by mode."""


@agentrl.env("hostile-values-v0", max_turns=3, max_new_tokens=64)
class HostileValues:
    """Each ``mode`` breaks one rule; ``""`` follows them all."""

    def __init__(self, mode: str = "") -> None:
        self.mode = mode
        self.seen = SEEN.setdefault(mode, [])

    def tasks(self, split: str, *, seed: int = 0) -> list[Task]:
        if self.mode == "dup-ids":
            return [
                Task(id="same", prompt="a"),
                Task(id="other", prompt="b"),
                Task(id="same", prompt="c"),
            ]
        if self.mode == "surrogate-id":
            return [Task(id="bad-\udcff", prompt="p")]
        if self.mode == "tasks-raise":
            raise KeyError("no such split")
        if self.mode == "tasks-none":
            return None  # type: ignore[return-value]
        return [Task(id=f"{split}-{i}", prompt=f"Say {i}.") for i in range(2)]

    async def reset(self, task: Task) -> list:
        prompt = [Message("system", "Use echo."), Message("user", task.prompt)]
        match self.mode:
            case "reset-surrogate":
                return [prompt[0], Message("user", "bad \ud800 text")]
            case "reset-role":
                return [Message("robot", "beep")]  # type: ignore[arg-type]
            case "reset-int":
                return [Message("user", 12345)]  # type: ignore[arg-type]
            case "reset-str":
                return "Say hi."  # type: ignore[return-value]
            case "reset-cancelled":
                raise asyncio.CancelledError("the env's own")
            case "reset-message-surrogate":
                raise ValueError("bad \udcff value")
            case "reset-exit":
                raise SystemExit(3)
            case "reset-huge":
                return [prompt[0], Message("user", "word " * 3000)]
        return prompt

    @agentrl.tool
    def echo(self, text: str) -> str:
        """Echo the text."""
        if self.mode == "tool-surrogate":
            return "bad \udcff output"
        if self.mode == "tool-huge":
            return "word " * 3000
        return text

    async def respond(self, message: Message) -> list[Message] | None:
        self.seen.append(("respond", message.content))
        message.content = "EDITED"  # a copy: the record keeps what the model wrote
        match self.mode:
            case "respond-str":
                return "continue"  # type: ignore[return-value]
            case "respond-empty":
                return []
            case "respond-assistant":
                return [Message("assistant", "I wrote this for you.")]
        return None

    async def turn_reward(self, episode) -> float:
        self.seen.append(("turn", episode.termination_reason, episode.truncated))
        return float("nan") if self.mode == "turn-nan" else 0.25

    async def reward(self, episode) -> float | Reward:
        episode.messages[0].content = "TAMPERED"
        for record in episode.tool_calls:
            record.output, record.ok = "TAMPERED", False
        self.seen.append(("reward", episode.termination_reason, episode.truncated))
        match self.mode:
            case "reward-nan":
                return float("nan")
            case "reward-inf":
                return math.inf
            case "reward-str":
                return "1e308"  # type: ignore[return-value]
            case "reward-huge-int":
                return 10**400  # type: ignore[return-value]
            case "reward-total-nan":
                return Reward(total=float("nan"))
            case "reward-breakdown-inf":
                return Reward(total=1.0, breakdown={"a": math.inf})
            case "reward-bool":
                return True
        return Reward(total=1.0, breakdown={"format": 0.5})

    async def close(self) -> None: ...


def _ctx(fmt, engine, mode: str = "", **cfg) -> RolloutContext:
    return RolloutContext(
        spec=agentrl.spec("hostile-values-v0"),
        engine=engine,
        fmt=fmt,
        config=agentrl.RolloutConfig(env_kwargs={"mode": mode}, **cfg),
        tokenizer_fingerprint="test",
        model_name="scripted",
    )


async def _run(chatml, tokenizer, mode, replies=(ECHO, ANSWER), **cfg):
    SEEN.pop(mode, None)
    engine = ScriptedEngine(tokenizer, list(replies))
    env = agentrl.make("hostile-values-v0", mode=mode)
    task = env.tasks("train")[0]
    traj = await run_trajectory(
        _ctx(chatml, engine, mode, **cfg), task, group_id="g", sample_index=0, seed=1
    )
    encode_trajectory(traj)  # every trajectory can be written
    traj.validate()
    return traj


@pytest.mark.parametrize(
    ("mode", "where", "words"),
    [
        ("reset-surrogate", "reset", "reset(): messages[1].content is not valid Unicode"),
        ("reset-role", "reset", "messages[0].role is 'robot'"),
        ("reset-int", "reset", "messages[0].content must be a str, got int 12345"),
        ("reset-str", "reset", "reset() must return a non-empty list of Message, got str"),
        ("reward-nan", "reward", "reward() must return a float or Reward (finite), got nan"),
        ("reward-inf", "reward", "got inf"),
        ("reward-str", "reward", "got '1e308'"),
        ("reward-huge-int", "reward", "must return a float or Reward (finite), got 1000000"),
        ("reward-total-nan", "reward", "Reward.total must be a finite number, got nan"),
        ("reward-breakdown-inf", "reward", "Reward.breakdown['a'] must be a finite number"),
        ("turn-nan", "turn_reward", "turn_reward() must be a finite number, got nan"),
        ("respond-str", "respond", "must return a list of Message or None"),
        ("respond-empty", "respond", "must return a list of Message or None"),
        ("respond-assistant", "respond", "messages[0].role is 'assistant'"),
    ],
)
async def test_a_bad_value_is_the_trajectorys_error_naming_the_hook_and_field(
    chatml, tokenizer, mode, where, words
):
    replies = (ANSWER,) if mode.startswith("respond") else (ECHO, ANSWER)
    traj = await _run(chatml, tokenizer, mode, replies)
    assert traj.status == "error" and traj.termination_reason == "error"
    assert traj.error is not None and traj.error.where == where, traj.error
    assert "hostile-values-v0" in traj.error.message and words in traj.error.message
    assert traj.reward is None


async def test_sys_exit_in_an_async_hook_is_the_trajectorys_failure(chatml, tokenizer):
    """As from a tool or a sync hook; from an async hook it ended the whole batch."""
    traj = await _run(chatml, tokenizer, "reset-exit")
    assert traj.status == "error" and traj.error.where == "reset"
    assert traj.error.type == "SystemExit" and traj.error.message == "3"


async def test_a_bool_reward_is_a_number(chatml, tokenizer):
    traj = await _run(chatml, tokenizer, "reward-bool")
    assert traj.status == "done" and traj.reward == 1.0


async def test_a_tool_result_that_is_not_text_is_a_failed_call_and_the_episode_goes_on(
    chatml, tokenizer
):
    traj = await _run(chatml, tokenizer, "tool-surrogate")
    assert traj.status == "done" and traj.reward == 1.0
    (record,) = traj.tool_calls
    assert not record.ok and record.error_kind == "tool_exception"
    assert "not valid Unicode (a lone surrogate at character 4)" in record.output
    assert check_boundary(chatml, traj).ok


@pytest.mark.parametrize("mode", ["reset-cancelled", "reset-message-surrogate"])
async def test_an_exception_of_the_envs_own_is_recorded_never_dropped(chatml, tokenizer, mode):
    """An ``asyncio.CancelledError`` that env code raises while nobody cancels the task is the
    env's failure (under asyncio it would otherwise end the task silently), and an exception
    whose message is not valid Unicode still gives a trajectory JSON can hold."""
    traj = await _run(chatml, tokenizer, mode)
    assert traj.status == "error" and traj.error.where == "reset"
    if mode == "reset-message-surrogate":
        assert traj.error.message == "bad \ufffd value"


async def test_a_task_id_that_is_not_text_gives_a_writable_error_trajectory(chatml, tokenizer):
    traj = await _run(chatml, tokenizer, "surrogate-id")
    assert traj.task_id == "bad-\ufffd" and traj.id == "g/0"
    assert traj.status == "error" and traj.error.where == "runtime"
    assert "not valid Unicode" in traj.error.message


async def test_hooks_see_copies_and_the_episode_ends_only_once_it_has(chatml, tokenizer):
    traj = await _run(chatml, tokenizer, "", (ECHO, ANSWER))
    assert traj.status == "done" and traj.reward == 1.0
    assert traj.messages[0].content.startswith("Use echo.")  # reward() edited its copy
    assert traj.tool_calls[0].ok and traj.tool_calls[0].output == "hi"
    assert not any("EDITED" in m.content for m in traj.messages)  # respond() edited a copy
    assert check_boundary(chatml, traj).ok
    # turn_reward runs while the episode runs (no reason yet); reward() sees how it ended
    assert SEEN[""] == [
        ("turn", None, False),
        ("turn", None, False),
        ("respond", "done"),
        ("reward", "stop", False),
    ]


async def test_a_turn_cut_by_max_tokens_is_seen_as_cut_by_its_turn_reward(chatml, tokenizer):
    traj = await _run(chatml, tokenizer, "", ("word " * 50,), max_new_tokens=8)
    assert traj.termination_reason == "max_tokens"
    assert SEEN[""] == [("turn", "max_tokens", True), ("reward", "max_tokens", True)]


async def test_an_observation_that_leaves_no_room_ends_the_episode_before_it(chatml, tokenizer):
    traj = await _run(chatml, tokenizer, "tool-huge", max_context_tokens=400)
    assert traj.status == "truncated" and traj.termination_reason == "context_limit"
    assert len(traj.token_ids) <= 400
    assert traj.messages[-1].role == "assistant"  # the observation is not in ids or messages
    assert traj.tool_calls[0].ok and traj.tool_calls[0].output.startswith("word word")
    assert check_boundary(chatml, traj).ok


@pytest.mark.parametrize("room", [0, -1, 1])
async def test_a_prompt_with_no_room_to_generate_is_resets_error(chatml, tokenizer, room):
    """A prompt at or over the context used to give a 'truncated' trajectory holding the whole
    prompt and no sampled token; one token of room still generates."""
    probe = await _run(chatml, tokenizer, "reset-huge", replies=[ANSWER])
    size = probe.prompt_len
    traj = await _run(
        chatml, tokenizer, "reset-huge", replies=[ANSWER], max_context_tokens=size + room
    )
    if room == 1:
        assert traj.status == "truncated" and traj.termination_reason == "context_limit"
        assert sum(traj.loss_mask) == 1
        return
    assert traj.status == "error" and traj.error.where == "reset" and traj.reward is None
    assert traj.error.message == (
        f"hostile-values-v0: reset() gave a prompt of {size} tokens, which leaves no room to "
        f"generate in a context of {size + room} (rollout.max_context_tokens)"
    )
    assert traj.token_ids == [] and traj.num_turns == 0


@agentrl.env("few-hooks-v0", max_turns=1, max_new_tokens=8)
class FewHooks:
    """No ``close`` (optional); ``mode="no-reward"`` also lacks the verifier (required)."""

    def __init__(self, mode: str = "") -> None:
        if mode == "no-reward":
            self.reward = None

    def tasks(self, split: str, *, seed: int = 0) -> list[Task]:
        return [Task(id=f"{split}-{i}", prompt=f"Say {i}.") for i in range(2)]

    async def reset(self, task: Task) -> list:
        return [Message("user", task.prompt)]

    def reward(self, episode) -> float:
        return 1.0


async def test_close_is_optional_and_a_missing_required_hook_is_named_before_a_run(tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER] * 2)
    result = await arollout("few-hooks-v0", engine=engine, tokenizer=tokenizer)
    assert [(t.status, t.reward, t.error) for t in result.trajectories] == [("done", 1.0, None)] * 2
    config = agentrl.RolloutConfig(env_kwargs={"mode": "no-reward"})
    engine = ScriptedEngine(tokenizer, [ANSWER])
    with pytest.raises(EnvError, match=re.escape("few-hooks-v0: FewHooks has no reward() (")):
        await arollout("few-hooks-v0", engine=engine, tokenizer=tokenizer, config=config)
    assert engine.calls == []


def test_check_env_passes_an_env_without_close():
    agentrl.check_env("few-hooks-v0")


async def test_the_batch_goes_on_beside_a_bad_trajectory(chatml, tokenizer):
    engine = ScriptedEngine(tokenizer, [ECHO, ANSWER])
    ctx = _ctx(chatml, engine, "reward-nan", group_size=2)
    tasks = agentrl.make("hostile-values-v0").tasks("train")
    written: list[bytes] = []
    trajs = await run_groups(
        ctx, tasks, on_trajectory=lambda t: written.append(encode_trajectory(t))
    )
    assert len(trajs) == len(written) == 4
    assert {t.error.where for t in trajs} == {"reward"}


async def test_repeated_task_ids_and_an_offset_past_the_split_are_refused_before_a_run(tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER])
    config = agentrl.RolloutConfig(env_kwargs={"mode": "dup-ids"})
    with pytest.raises(
        EnvError, match=r"task ids of 'train' are not unique: 'same' is tasks 0 and 2"
    ):
        await arollout("hostile-values-v0", engine=engine, tokenizer=tokenizer, config=config)
    with pytest.raises(
        ConfigError, match=r"task_offset 2: hostile-values-v0's 'train' split has 2"
    ):
        await arollout("hostile-values-v0", engine=engine, tokenizer=tokenizer, task_offset=2)
    assert engine.calls == []


async def test_a_task_id_that_is_not_text_never_stops_the_batch(tokenizer):
    """Through ``arollout``: the seed was derived from the id before the trajectory's own
    error handling, and the UnicodeEncodeError ended the whole run."""
    engine = ScriptedEngine(tokenizer, [ANSWER] * 4)
    config = agentrl.RolloutConfig(env_kwargs={"mode": "surrogate-id"}, group_size=2)
    result = await arollout("hostile-values-v0", engine=engine, tokenizer=tokenizer, config=config)
    assert len(result.trajectories) == 2
    assert all(t.status == "error" and "not valid Unicode" in t.error.message
               for t in result.trajectories)  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "words"),
    [
        ("tasks-raise", "tasks('train', seed=0) raised KeyError: 'no such split'"),
        ("tasks-none", "tasks('train', seed=0) returned None (a list of Task expected)"),
    ],
)
async def test_tasks_that_fail_are_named_before_a_run(tokenizer, mode, words):
    engine = ScriptedEngine(tokenizer, [ANSWER])
    config = agentrl.RolloutConfig(env_kwargs={"mode": mode})
    with pytest.raises(EnvError, match=re.escape(f"hostile-values-v0: {words}")):
        await arollout("hostile-values-v0", engine=engine, tokenizer=tokenizer, config=config)
    assert engine.calls == []


def test_an_append_must_use_the_engine_the_run_used():
    old = {"env": "calc-v0", "model": "m", "split": "train", "rollout": {"seed": 0}}
    assert config_diff(_sampling_part(old), _sampling_part({**old, "engine": "embedded"})) == []
    scripted = _sampling_part({**old, "engine": "ScriptedEngine"})
    assert config_diff(_sampling_part(old), scripted) == ['engine: "embedded" → "ScriptedEngine"']


def test_check_env_applies_the_same_rules():
    for mode, words in [
        ("dup-ids", "task ids of 'train' are not unique"),
        ("reset-role", "messages[0].role is 'robot'"),
        ("reward-breakdown-inf", "Reward.breakdown['a'] must be a finite number"),
        ("respond-assistant", "messages[0].role is 'assistant'"),
    ]:
        with pytest.raises(EnvError, match=re.escape(words)):
            agentrl.check_env("hostile-values-v0", env_kwargs={"mode": mode})


async def test_a_split_shorter_than_asked_runs_what_it_has_and_says_so(tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER])
    found: list[int] = []
    config = agentrl.RolloutConfig(group_size=2)
    result = await arollout(
        "hostile-values-v0", engine=engine, tokenizer=tokenizer, n=8, config=config,
        on_tasks=found.append,
    )  # fmt: skip
    assert found == [2] and result.planned == 4 and len(result.trajectories) == 4


async def test_what_counts_as_the_trajectorys_own_exception():
    from agentrl._rollout import own_exception

    assert own_exception(ValueError("x")) and own_exception(SystemError("y"))
    # env code calling sys.exit() in an async hook: the trajectory's, as from a tool or a
    # sync hook (it ended the whole batch)
    assert own_exception(SystemExit(3))
    # the run's, never one trajectory's: Ctrl-C and a coroutine being closed
    for exc in (KeyboardInterrupt(), GeneratorExit()):
        assert not own_exception(exc)
    # nobody is cancelling this task: a CancelledError here is code's own (and under trio it
    # is never a cancellation)
    assert own_exception(asyncio.CancelledError("mine"))
