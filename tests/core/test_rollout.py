"""The trajectory state machine: masks, spans, termination reasons, deadlines, failures."""

from __future__ import annotations

import json
import threading

import anyio
import pytest
from fakes import ScriptedEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loop_probes import calc_context, wait_abandoned_at_most

import agentrl
from agentrl._rollout import run_trajectory
from agentrl._runner import run_groups
from agentrl._types import decode_trajectory, encode_trajectory
from agentrl.formats import check_boundary

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 2"}}\n</tool_call>'
ANSWER = "<answer>5</answer><|im_end|>"


_ctx = calc_context


def _task(answer="5"):
    return agentrl.Task(id="t0", prompt="What is 3 + 2?", answer=answer)


async def _run(chatml, tokenizer, replies, **cfg):
    engine = ScriptedEngine(tokenizer, replies)
    traj = await run_trajectory(
        _ctx(chatml, engine, **cfg), _task(), group_id="g", sample_index=0, seed=1
    )
    return traj, engine


def _assert_invariants(traj, chatml, engine=None):
    traj.validate()
    report = check_boundary(chatml, traj)
    assert report.ok, report.message
    if engine is not None:
        # the engine always saw exactly the accumulated context (token-in/token-out)
        for call in engine.calls:
            assert traj.token_ids[: len(call)] == call


async def test_tool_call_then_answer(chatml, tokenizer):
    traj, engine = await _run(chatml, tokenizer, [CALL, ANSWER])
    _assert_invariants(traj, chatml, engine)
    assert traj.status == "done" and traj.termination_reason == "stop"
    assert traj.reward == 1.0 and traj.reward_breakdown["correct"] == 1.0
    assert traj.num_turns == 2 and len(traj.turn_rewards) == 2
    assert [c.ok for c in traj.tool_calls] == [True] and traj.tool_calls[0].output == "5"
    assert traj.policy_version == 7
    sources = [(s.source, s.turn) for s in traj.spans]
    assert sources == [
        ("prompt", 0),
        ("model", 0),
        ("template", 0),  # closes turn 0
        ("template", 1),  # opens the tool message
        ("tool", 1),
        ("template", 1),  # closes it and opens the next assistant turn
        ("model", 1),
        ("template", 1),
    ]
    # the sampled <|im_end|> is a model token (mask 1); the "\n" after it is template (mask 0)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    last_model = [s for s in traj.spans if s.source == "model"][-1]
    assert traj.token_ids[last_model.end - 1] == im_end
    assert traj.loss_mask[last_model.end - 1] == 1
    assert tokenizer.decode(traj.token_ids[last_model.end :]) == "\n"
    # the tool turn was cut by the stop string: the template closes it with <|im_end|>\n
    first_close = traj.spans[2]
    assert tokenizer.decode(traj.token_ids[first_close.start : first_close.end]) == "<|im_end|>\n"
    tool_span = traj.spans[4]
    assert tokenizer.decode(traj.token_ids[tool_span.start : tool_span.end]) == "5"
    assert engine.sessions == set()  # the session was closed


async def test_no_tool_answer_directly(chatml, tokenizer):
    traj, _ = await _run(chatml, tokenizer, ["<answer>4</answer><|im_end|>"])
    _assert_invariants(traj, chatml)
    assert traj.status == "done" and traj.reward == 0.0 and traj.tool_calls == []


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "parse_error"),
        ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "unknown_tool"),
        ('<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>', "invalid_arguments"),
        (
            '<tool_call>\n{"name": "calculator", '
            '"arguments": {"expression": "1", "x": 2}}\n</tool_call>',
            "invalid_arguments",
        ),
        (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": [1]}}\n</tool_call>',
            "invalid_arguments",
        ),
        (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}\n</tool_call>',
            "tool_exception",
        ),
        ('<tool_call>\n["calculator"]\n</tool_call>', "parse_error"),
    ],
)
async def test_malformed_calls_become_observations(chatml, tokenizer, call, kind):
    traj, _ = await _run(chatml, tokenizer, [call, ANSWER])
    _assert_invariants(traj, chatml)
    assert traj.status == "done" and traj.reward == 1.0  # the rollout continued
    (record,) = traj.tool_calls
    assert not record.ok and record.error_kind == kind
    tool_msgs = [m for m in traj.messages[traj.prompt_messages :] if m.role == "tool"]
    assert tool_msgs[0].content.startswith(f"Error ({kind})")


async def test_oversize_arguments(chatml, tokenizer):
    big = json.dumps({"name": "calculator", "arguments": {"expression": "1+" * 50 + "1"}})
    traj, _ = await _run(
        chatml,
        tokenizer,
        [f"<tool_call>\n{big}\n</tool_call>", ANSWER],
        max_tool_argument_bytes=64,
        max_new_tokens=256,
    )
    _assert_invariants(traj, chatml)
    assert traj.tool_calls[0].error_kind == "oversize_arguments"


async def test_turn_cut_by_max_tokens(chatml, tokenizer):
    traj, _ = await _run(
        chatml, tokenizer, ["one two three four five six seven eight nine ten"], max_new_tokens=4
    )
    _assert_invariants(traj, chatml)
    assert traj.status == "truncated" and traj.termination_reason == "max_tokens"
    model = [s for s in traj.spans if s.source == "model"]
    assert sum(s.end - s.start for s in model) == 4
    close = traj.spans[-1]
    assert close.source == "template"
    assert tokenizer.decode(traj.token_ids[close.start : close.end]) == "<|im_end|>\n"
    assert traj.reward == 0.0  # the verifier still ran


async def test_max_turns(chatml, tokenizer):
    traj, _ = await _run(chatml, tokenizer, [CALL], max_turns=3)
    _assert_invariants(traj, chatml)
    assert traj.status == "truncated" and traj.termination_reason == "max_turns"
    assert traj.num_turns == 3 and len(traj.tool_calls) == 3


async def test_tool_error_budget(chatml, tokenizer):
    bad = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    traj, _ = await _run(chatml, tokenizer, [bad], max_turns=10, tool_error_budget=1)
    _assert_invariants(traj, chatml)
    assert traj.termination_reason == "tool_error_budget" and len(traj.tool_calls) == 2


async def test_context_limit(chatml, tokenizer):
    probe, _ = await _run(chatml, tokenizer, [ANSWER])
    limit = probe.prompt_len + 10  # room for 10 sampled tokens: the tool call is cut
    traj, engine = await _run(chatml, tokenizer, [CALL, ANSWER], max_context_tokens=limit)
    _assert_invariants(traj, chatml)
    assert traj.status == "truncated" and traj.termination_reason == "context_limit"
    assert sum(traj.loss_mask) == 10
    assert len(traj.token_ids) <= limit + 2  # only the closing template passes the limit


async def test_engine_failure_is_recorded(chatml, tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, ANSWER], fail_on_call=1)
    traj = await run_trajectory(_ctx(chatml, engine), _task(), group_id="g", sample_index=0, seed=1)
    traj.validate()
    assert traj.status == "error" and traj.error.where == "engine"
    assert "scripted failure" in traj.error.message and traj.reward is None
    assert engine.sessions == set()


def _fake_clock():
    """trio's autojump clock: sleeps take no real time, so deadline tests never wait."""
    import trio.testing

    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


@pytest.mark.parametrize("anyio_backend", [_fake_clock()])
async def test_turn_deadline_with_fake_clock(chatml, tokenizer, anyio_backend):
    """A generate call past ``turn_timeout_s`` (a stalled or overloaded server) is the engine's
    failure: the trajectory carries no reward (it was ``truncated`` and scored on an answer the
    policy never gave, shifting its group's advantages)."""
    engine = ScriptedEngine(tokenizer, [CALL], delay_s=1000.0)
    traj = await run_trajectory(
        _ctx(chatml, engine, turn_timeout_s=5.0), _task(), group_id="g", sample_index=0, seed=1
    )
    _assert_invariants(traj, chatml)
    assert traj.status == "error" and traj.error.where == "engine" and traj.reward is None
    assert "no reply within rollout.turn_timeout_s=5 s" in traj.error.message
    assert traj.num_turns == 0


@pytest.mark.parametrize("anyio_backend", [_fake_clock()])
async def test_trajectory_deadline_with_fake_clock(chatml, tokenizer, anyio_backend):
    # An unknown tool keeps the loop on the event loop: a sync tool would run in a worker
    # thread, and the autojump clock jumps while a task waits on a thread.
    unknown = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [unknown], delay_s=30.0)
    traj = await run_trajectory(
        _ctx(chatml, engine, trajectory_timeout_s=100.0, max_turns=50, tool_error_budget=99),
        _task(),
        group_id="g",
        sample_index=0,
        seed=1,
    )
    _assert_invariants(traj, chatml)
    assert traj.termination_reason == "deadline" and traj.num_turns == 3


async def test_groups_share_prompt_and_failures_stay_local(chatml, tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, ANSWER], fail_on_call=0)
    ctx = _ctx(chatml, engine, group_size=3, concurrency=2)
    tasks = agentrl.make("calc-v0").tasks("train")[:2]
    seen = []
    trajs = await run_groups(ctx, tasks, on_trajectory=seen.append)
    assert len(trajs) == 6 == len(seen)
    assert [t.status for t in trajs].count("error") == 1  # only the first engine call failed
    by_group = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t)
    assert len(by_group) == 2
    for group in by_group.values():
        prompts = {tuple(t.token_ids[: t.prompt_len]) for t in group if t.prompt_len}
        assert len(prompts) == 1
        assert len({t.sampling.seed for t in group}) == 3  # distinct per-sample seeds


_FRAGMENTS = [
    CALL,
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7*6"}}\n</tool_call>',
    "<tool_call>\n{broken\n</tool_call>",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": 5}}\n</tool_call>',
    '<tool_call>{"name": "nope"}</tool_call>',
    "<answer>5</answer><|im_end|>",
    "I think the answer is 42.<|im_end|>",
    "  spaces\n\nand newlines\t<|im_end|>",
    "unicode: 7×6 = ٤٢ 😀<|im_end|>",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+',
    "<|endoftext|>",
    "<answer>5</answer>",
]


@pytest.mark.parametrize("anyio_backend", ["trio"])
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    replies=st.lists(st.sampled_from(_FRAGMENTS), min_size=1, max_size=6),
    max_new=st.integers(min_value=3, max_value=64),
    max_turns=st.integers(min_value=1, max_value=6),
)
async def test_property_masks_and_boundary(
    chatml, tokenizer, anyio_backend, replies, max_new, max_turns
):
    traj, engine = await _run(
        chatml, tokenizer, replies, max_new_tokens=max_new, max_turns=max_turns
    )
    _assert_invariants(traj, chatml, engine)
    assert traj.status in ("done", "truncated")
    # loss_mask is 1 exactly on model spans and nowhere else; logprobs null elsewhere
    for span in traj.spans:
        for i in range(span.start, span.end):
            assert traj.loss_mask[i] == (span.source == "model")
            assert (traj.logprobs[i] is None) == (span.source != "model")
    assert sum(traj.loss_mask) == sum(s.end - s.start for s in traj.spans if s.source == "model")


# -- loud failures: tool deadlines, tracebacks, stopping -----------------------------------------


@agentrl.env("tool-deadlines-v0", max_turns=4, max_new_tokens=96, tags=("test",))
class ToolDeadlinesEnv:
    """Tools that never return (async and sync) and one whose own deadline outlasts the env's;
    ``tool_timeout_s`` is the env-wide default. With ``broken_reward`` the verifier raises."""

    tool_timeout_s = 0.3

    def __init__(self, broken_reward: bool = False) -> None:
        self.broken_reward = broken_reward
        self.release = threading.Event()

    def tasks(self, split: str = "train", *, seed: int = 0) -> list[agentrl.Task]:
        return [agentrl.Task(id=f"t{i}", prompt="Use the tools.") for i in range(4)]

    async def reset(self, task):
        return [agentrl.Message("system", "Call tools."), agentrl.Message("user", task.prompt)]

    @agentrl.tool
    async def hang(self) -> str:
        """Never returns (async)."""
        await anyio.sleep_forever()
        return ""

    @agentrl.tool
    def stuck(self) -> str:
        """Blocks its thread until the env is closed (sync)."""
        self.release.wait(60)
        return "released"

    @agentrl.tool(timeout_s=5)
    async def patient(self) -> str:
        """Takes longer than the env's default deadline, within its own."""
        await anyio.sleep(0.6)
        return "finished"

    async def reward(self, episode) -> float:
        if self.broken_reward:
            return _broken_verifier(episode)
        return float(len(episode.tool_calls))

    async def close(self) -> None:
        self.release.set()


def _broken_verifier(episode) -> float:
    raise KeyError("answer")  # a bug in the env's verifier


def _call(name: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'


def _deadlines_ctx(chatml, engine, **cfg):
    ctx = _ctx(chatml, engine, **cfg)
    ctx.spec = agentrl.spec("tool-deadlines-v0")
    return ctx


@agentrl.env("tool-flood-v0", max_turns=2, max_new_tokens=96, tags=("test",))
class ToolFloodEnv:
    """A tool whose result is 5 MB of text."""

    def tasks(self, split: str = "train", *, seed: int = 0) -> list[agentrl.Task]:
        return [agentrl.Task(id="t0", prompt="Use the tool.")]

    async def reset(self, task):
        return [agentrl.Message("system", "Call tools."), agentrl.Message("user", task.prompt)]

    @agentrl.tool
    def flood(self) -> str:
        """Returns 5 MB of text."""
        return "abcd " * 1_000_000

    async def reward(self, episode) -> float:
        return 1.0

    async def close(self) -> None:
        return None


async def test_a_tool_result_past_max_tool_output_chars_is_cut_with_a_note(chatml, tokenizer):
    """A tool that returns megabytes: the model reads the first ``max_tool_output_chars``
    characters and a note, and neither the tokenizer nor the trajectory's record take the rest
    (5 MB took seconds of the event loop, gigabytes at 20 MB, and a 5 MB JSONL line)."""
    engine = ScriptedEngine(tokenizer, [_call("flood"), ANSWER])
    ctx = _ctx(chatml, engine, max_tool_output_chars=1000)
    ctx.spec = agentrl.spec("tool-flood-v0")
    traj = await run_trajectory(ctx, _task(), group_id="g", sample_index=0, seed=1)
    _assert_invariants(traj, chatml, engine)
    (record,) = traj.tool_calls
    assert record.ok and record.output.startswith("abcd " * 200)
    note = (
        "[output truncated: 5000000 characters, the first 1000 kept "
        "(rollout.max_tool_output_chars)]"
    )
    assert record.output.endswith("\n" + note) and len(record.output) == 1001 + len(note)
    assert traj.status == "done" and len(encode_trajectory(traj)) < 50_000


async def test_tools_that_never_return_time_out_and_the_trajectory_goes_on(chatml, tokenizer):
    """Every call has a deadline: the env's ``tool_timeout_s`` (0.3 s here, not the rollout's
    10 s default), or the tool's own ``timeout_s``; a timed-out call is ``tool_timeout``, the
    model is told, and the trajectory continues to its answer."""
    replies = [_call("hang"), _call("stuck"), _call("patient"), ANSWER]
    engine = ScriptedEngine(tokenizer, replies)
    ctx = _deadlines_ctx(chatml, engine, tool_error_budget=5)
    with anyio.fail_after(20):
        traj = await run_trajectory(ctx, _task(), group_id="g", sample_index=0, seed=1)
    _assert_invariants(traj, chatml, engine)
    assert traj.status == "done" and traj.termination_reason == "stop", traj.error
    kinds = [(c.name, c.error_kind) for c in traj.tool_calls]
    assert kinds == [("hang", "tool_timeout"), ("stuck", "tool_timeout"), ("patient", None)]
    hang = traj.tool_calls[0].output
    assert hang == "Error (tool_timeout): tool 'hang' did not finish within 0.3 s"
    assert traj.tool_calls[2].output == "finished"
    assert all(c.latency_s < 3 for c in traj.tool_calls[:2])
    # the sync tool's thread could not be stopped: the trajectory says so (and how many such
    # threads of the process still ran when it ended, when any did)
    assert traj.info["abandoned_tool_threads"] == "1"
    assert set(traj.info) <= {"abandoned_tool_threads", "abandoned_threads_running"}
    assert traj.reward == 3.0


async def test_too_many_abandoned_threads_end_the_trajectory_loudly(chatml, tokenizer):
    """Past ``max_abandoned_threads`` abandoned threads still running, a sync tool call is
    refused: the trajectory ends in error naming the setting, instead of every later call
    timing out (a silently wrong observation and reward)."""
    from agentrl._threads import abandoned_threads

    await wait_abandoned_at_most(0)  # an earlier test's thread ending mid-test would move the cap
    cap = abandoned_threads() + 1
    engine = ScriptedEngine(tokenizer, [_call("stuck"), _call("stuck"), ANSWER])
    ctx = _deadlines_ctx(chatml, engine, max_abandoned_threads=cap)
    with anyio.fail_after(20):
        traj = await run_trajectory(ctx, _task(), group_id="g", sample_index=0, seed=1)
    assert traj.status == "error" and traj.error.where == "tool", traj.error
    assert traj.error.type == "ToolError"
    assert f"(rollout.max_abandoned_threads = {cap})" in traj.error.message
    assert [c.error_kind for c in traj.tool_calls] == ["tool_timeout"]


async def test_an_invalid_env_tool_timeout_is_an_error_trajectory(chatml, tokenizer, monkeypatch):
    monkeypatch.setattr(ToolDeadlinesEnv, "tool_timeout_s", -1)
    engine = ScriptedEngine(tokenizer, [ANSWER])
    traj = await run_trajectory(
        _deadlines_ctx(chatml, engine), _task(), group_id="g", sample_index=0, seed=1
    )
    assert traj.status == "error" and "tool_timeout_s must be a number > 0" in traj.error.message


async def test_an_error_record_keeps_a_short_traceback(chatml, tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER])
    ctx = _deadlines_ctx(chatml, engine, env_kwargs={"broken_reward": True})
    traj = await run_trajectory(ctx, _task(), group_id="g", sample_index=0, seed=1)
    assert traj.status == "error" and traj.reward is None
    error = traj.error
    assert (error.where, error.type, error.message) == ("reward", "KeyError", "'answer'")
    tb = error.traceback
    assert tb.startswith("Traceback (most recent call last):") and tb.endswith("KeyError: 'answer'")
    assert "in _broken_verifier" in tb and 'raise KeyError("answer")' in tb
    assert tb.count('File "') <= 6  # the innermost frames only
    decoded = decode_trajectory(encode_trajectory(traj))
    assert decoded.error.traceback == tb  # it is written with the trajectory


async def test_groups_continue_their_sample_indices(chatml, tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER])
    ctx = _ctx(chatml, engine, group_size=2)
    tasks = agentrl.make("calc-v0").tasks("train")[:2]
    first = {f"calc-v0/{tasks[0].id}": 2}
    trajs = await run_groups(ctx, tasks, first_sample=first)
    ids = sorted(t.id for t in trajs)
    assert ids == sorted(
        [f"calc-v0/{tasks[0].id}/2", f"calc-v0/{tasks[0].id}/3"]
        + [f"calc-v0/{tasks[1].id}/0", f"calc-v0/{tasks[1].id}/1"]
    )
    again = await run_groups(ctx, tasks[:1])  # the seed follows the sample index
    by_index = {t.sample_index: t.sampling.seed for t in again + trajs if t.task_id == tasks[0].id}
    assert len(set(by_index.values())) == 4


async def test_stop_cancels_what_is_in_flight_and_returns_what_finished(chatml, tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER], delay_s=0.05)
    ctx = _ctx(chatml, engine, group_size=1, concurrency=2)
    tasks = agentrl.make("calc-v0").tasks("train")[:40]
    stop = anyio.Event()
    seen = []

    def on_trajectory(traj):
        seen.append(traj)
        if len(seen) == 5:
            stop.set()

    with anyio.fail_after(20):
        trajs = await run_groups(ctx, tasks, on_trajectory=on_trajectory, stop=stop)
    assert 5 <= len(trajs) < 40 and len(trajs) == len(seen)
    assert all(t.status == "done" for t in trajs)
    assert engine.sessions == set()  # the cancelled trajectories closed their sessions
    assert await run_groups(ctx, tasks, stop=stop) == []  # already stopped: nothing starts


class _ScoringTogether:
    """Rewards that each wait until all four have started (a verifier slow enough to overlap)."""

    def __init__(self) -> None:
        self.started = 0
        self.all_started = anyio.Event()


@agentrl.env("slow-score-v0", max_turns=1, max_new_tokens=16, tags=("test",))
class _SlowScore:
    """One turn; with ``scoring``, each reward waits until the four of the batch are being
    scored at once (without it, as for the registry's own checks, a reward returns at once)."""

    def __init__(self, scoring: _ScoringTogether | None = None) -> None:
        self.scoring = scoring

    def tasks(self, split: str = "train", *, seed: int = 0) -> list[agentrl.Task]:
        return [agentrl.Task(id=f"s{i}", prompt="Say 5.") for i in range(4)]

    async def reset(self, task: agentrl.Task) -> list[agentrl.Message]:
        return [agentrl.Message("user", task.prompt)]

    async def reward(self, episode: agentrl.Episode) -> float:
        if self.scoring is None:
            return 1.0
        self.scoring.started += 1
        if self.scoring.started == 4:
            self.scoring.all_started.set()
        with anyio.fail_after(10):
            await self.scoring.all_started.wait()
        return 1.0

    async def close(self) -> None:
        return None


async def test_a_slow_verifier_does_not_hold_a_generation_slot(chatml, tokenizer):
    """concurrency=1 bounds trajectories generating, not trajectories being scored: the four
    rewards are in progress at once. Were scoring inside the generation slot, each reward would
    wait for others that could not start: the first three would fail at their 10 s."""
    import dataclasses

    engine = ScriptedEngine(tokenizer, [ANSWER])
    scoring = _ScoringTogether()
    ctx = dataclasses.replace(
        _ctx(chatml, engine, concurrency=1, env_kwargs={"scoring": scoring}),
        spec=agentrl.spec("slow-score-v0"),
    )
    trajs = await run_groups(ctx, ctx.spec.make().tasks("train"))
    assert [t.error for t in trajs] == [None] * 4, [t.error for t in trajs]
    assert [t.reward for t in trajs] == [1.0] * 4


class _CountingTasks(ScriptedEngine):
    """A scripted engine that records the most tasks alive in the event loop at any call."""

    peak = 0

    async def generate(self, input_ids, sampling, session=None):
        self.peak = max(self.peak, len(anyio.get_running_tasks()))
        return await super().generate(input_ids, sampling, session)


async def test_a_large_rollout_starts_each_trajectory_when_a_slot_frees(chatml, tokenizer):
    """240 samples at concurrency 3: they start in (task, sample) order as slots free, so the
    loop never holds more than a few tasks (it held one per sample, waiting on the slot)."""
    engine = _CountingTasks(tokenizer, [ANSWER], delay_s=0.001)
    ctx = _ctx(chatml, engine, concurrency=3, group_size=4)
    tasks = [agentrl.Task(id=f"t{i}", prompt="What is 3 + 2?", answer="5") for i in range(60)]
    trajs = await run_groups(ctx, tasks)
    assert [t.id for t in trajs] == [f"calc-v0/t{i}/{k}" for i in range(60) for k in range(4)]
    assert all(t.status == "done" and t.reward == 1.0 for t in trajs)
    assert engine.peak <= 3 + 10, engine.peak  # the three running, the test's own, scoring
