"""``python-math-v0`` and ``code-tests-v0``: the contract (``check_env``), the task data, the
sandbox glue, and scripted trajectories through the real state machine and a real local pool."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from fakes import ScriptedEngine
from sandbox_service import scratch_root

import agentrl
from agentrl._rollout import RolloutContext, run_trajectory
from agentrl.envs import SandboxLease, open_sandbox_runner, python_math, wants_sandbox
from agentrl.envs._code_tasks import TASKS
from agentrl.envs.calc import CalcEnv
from agentrl.envs.code_tests import CodeTestsEnv, extract_code
from agentrl.envs.python_math import LEVELS, PythonMathEnv
from agentrl.sandboxes import (
    LocalConfig,
    PoolConfig,
    SandboxRunner,
    answers_match,
    grade_math,
    open_sandbox_pool,
    run_unit_tests,
)
from agentrl.sandboxes._types import RunRequest

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]
IDS = ("python-math-v0", "code-tests-v0")


@asynccontextmanager
async def local_pool(tmp_path: Path, **pool) -> AsyncIterator[SandboxRunner]:
    pool.setdefault("size", 2)
    with scratch_root() as scratch:
        config = PoolConfig(backend=LocalConfig(scratch_root=str(scratch)), **pool)
        async with open_sandbox_pool(config) as p:
            yield p
        assert not list(scratch.iterdir()), "temp dirs left behind"


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def trajectory(chatml, tokenizer, env_id: str, task, replies, sandbox, **env_kwargs):
    """One trajectory; the sandbox reaches the env as a constructor kwarg, as the runtime's
    ``--sandbox`` hook passes it."""
    ctx = RolloutContext(
        spec=agentrl.spec(env_id),
        engine=ScriptedEngine(tokenizer, replies),
        fmt=chatml,
        config=agentrl.RolloutConfig(env_kwargs={"sandbox": sandbox, **env_kwargs}),
        tokenizer_fingerprint="test",
        model_name="scripted",
    )
    traj = await run_trajectory(ctx, task, group_id="g", sample_index=0, seed=1)
    traj.validate()
    return traj


# -- contract and data ----------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", IDS)
def test_check_env(env_id):
    agentrl.check_env(env_id)  # no sandbox needed for the contract and an empty answer
    spec = agentrl.spec(env_id)
    assert "sandbox" in spec.tags and wants_sandbox(spec.entry_point)
    assert env_id in {s.id for s in agentrl.registered()}  # found through the entry points


def test_wants_sandbox():
    assert wants_sandbox(PythonMathEnv) and wants_sandbox(CodeTestsEnv)
    assert not wants_sandbox(CalcEnv)


def test_python_math_tasks_are_deterministic_and_gradable():
    env = PythonMathEnv(num_tasks=120)
    tasks = env.tasks("train", seed=3)
    assert [t.id for t in tasks] == [
        t.id for t in PythonMathEnv(num_tasks=120).tasks("train", seed=3)
    ]
    assert {t.level for t in tasks} == set(LEVELS)
    assert not {t.id for t in tasks} & {t.id for t in env.tasks("eval", seed=3)}
    for t in tasks:
        assert t.answer and answers_match(t.answer, t.answer), t
    with pytest.raises(ValueError):
        PythonMathEnv(levels=[9])


def _episode(task, text: str) -> agentrl.Episode:
    return agentrl.Episode(
        task=task, messages=[agentrl.Message("assistant", text)], tool_calls=[], num_turns=1
    )


async def test_python_math_grades_off_the_event_loop(monkeypatch):
    """The grader is pure CPU: python-math-v0 runs it in a worker thread, so the loop keeps
    serving while it runs and a reward deadline gives up on it instead of waiting. The fake
    grader below returns only once the loop has set it free (or after 10 s, when the loop was
    blocked: run on the loop, it could never be set free)."""
    env = PythonMathEnv(levels=[3])
    task = env.tasks("train")[0]
    started, release = threading.Event(), threading.Event()
    freed: list[bool] = []

    def grader(response: str, expected: str) -> float:
        started.set()
        freed.append(release.wait(10))
        return grade_math(response, expected)

    monkeypatch.setattr(python_math, "grade_math", grader)
    rewards = []
    async with anyio.create_task_group() as tg:

        async def score() -> None:
            rewards.append(await env.reward(_episode(task, rf"\boxed{{{task.answer}}}")))

        tg.start_soon(score)
        assert await anyio.to_thread.run_sync(started.wait, 10)
        release.set()  # the loop runs while the grader does
    assert freed == [True] and rewards[0].total == 1.0

    started.clear()
    release.clear()
    with anyio.CancelScope() as deadline:
        async with anyio.create_task_group() as tg:
            tg.start_soon(score)
            assert await anyio.to_thread.run_sync(started.wait, 10)
            deadline.cancel()  # the rollout's reward deadline passes while the grader runs
    assert deadline.cancelled_caught and len(rewards) == 1  # given up on, not waited for
    release.set()


def test_code_tasks_data():
    names = [t.name for t in TASKS]
    assert len(names) == len(set(names)) >= 20
    env = CodeTestsEnv()
    train, evaluation = env.tasks("train"), env.tasks("eval")
    assert len(train) + len(evaluation) == len(TASKS) and len(evaluation) >= 4
    assert not {t.id for t in train} & {t.id for t in evaluation}
    for task in TASKS:
        assert task.visible and len(task.hidden) >= 4
        assert not {t.call for t in task.visible} & {t.call for t in task.hidden}
    assert extract_code("x\n```python\na = 1\n```\ny\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("no code") is None


async def test_reference_solutions_pass_and_stubs_fail(tmp_path):
    """Validates the shipped literals: each reference passes every test; a stub does not."""
    async with local_pool(tmp_path, size=2) as pool:
        scores: dict[str, tuple[float, float]] = {}

        async def one(task) -> None:
            tests = [*task.visible, *task.hidden]
            good = await run_unit_tests(pool, task.reference, tests)
            stub = await run_unit_tests(pool, f"def {task.name}(*args):\n    return None\n", tests)
            scores[task.name] = (good.fraction, stub.fraction)

        async with anyio.create_task_group() as tg:
            for task in TASKS:
                tg.start_soon(one, task)
    bad = {name: s for name, s in scores.items() if s[0] != 1.0 or s[1] >= 0.5}
    assert not bad, f"reference/stub scores off: {bad}"


async def test_fewshot_tool_outputs_are_what_the_tool_returns(tmp_path):
    """The worked examples show exactly what ``run_python`` returns for their code."""
    from agentrl.envs.python_math import fewshot_messages

    env = PythonMathEnv()
    shots = fewshot_messages()
    async with local_pool(tmp_path) as pool:
        env.sandbox = SandboxLease(pool, env_id="python-math-v0")
        for call_msg, tool_msg in zip(shots[1::4], shots[2::4], strict=True):
            body = json.loads(call_msg.content.split("\n")[1])
            assert await env.run_python(**body["arguments"]) == tool_msg.content
    for answer_msg, tool_msg in zip(shots[3::4], shots[2::4], strict=True):
        printed = tool_msg.content.rsplit("\n", 1)[-1]
        assert grade_math(answer_msg.content, printed) == 1.0


# -- glue -----------------------------------------------------------------------------------------


async def test_open_sandbox_runner_and_lease(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown sandbox"):
        async with open_sandbox_runner("nope"):
            pass
    lease = SandboxLease(None, env_id="x-v0")
    with pytest.raises(agentrl.SandboxError, match="--sandbox local"):
        await lease.run(RunRequest(language="python", code="print(1)"))
    with scratch_root() as scratch:
        await _lease_over_capacity(tmp_path, scratch)


async def _lease_over_capacity(tmp_path, scratch):
    config = tmp_path / "pool.json"
    backend = {"type": "local", "scratch_root": str(scratch)}
    config.write_text(json.dumps({"backend": backend, "size": 1, "max_queue": 0}))
    async with open_sandbox_runner(str(config)) as runner:
        assert isinstance(runner, SandboxRunner)
        lease = SandboxLease(runner, env_id="x-v0")
        slow = RunRequest(language="python", code="import time; time.sleep(0.5); print(1)")
        results = []

        async def run() -> None:
            results.append(await lease.run(slow))

        async with anyio.create_task_group() as tg:  # over capacity: waits, retries, runs
            for _ in range(3):
                tg.start_soon(run)
        assert [r.stdout for r in results] == ["1\n"] * 3 and lease.busy_waits >= 1
        lease.close()
        with pytest.raises(agentrl.SandboxError, match="closed"):
            await lease.run(slow)
    assert not list(scratch.iterdir())


# -- scripted trajectories through the real state machine -----------------------------------------


async def test_python_math_trajectory(tmp_path, chatml, tokenizer):
    env = PythonMathEnv(levels=[3])
    task = env.tasks("train")[0]
    async with local_pool(tmp_path) as pool:
        replies = [
            call("run_python", code="print(sum(i * i for i in range(1, 11)))"),
            call("run_python", code="import time\ntime.sleep(60)"),
            f"So the answer is \\boxed{{{int(task.answer):,}}}.<|im_end|>",
        ]
        traj = await trajectory(
            chatml, tokenizer, "python-math-v0", task, replies, pool, program_timeout_s=3.0
        )
        assert traj.status == "done", traj.error
        assert traj.reward == 1.0 and traj.reward_breakdown == {"correct": 1.0, "format": 1.0}
        first, second = traj.tool_calls
        assert first.ok and first.output == "status: ok\nstdout:\n385"
        assert second.ok and second.output.startswith("status: timeout")
        wrong = [call("run_python", code="print(1)"), "\\boxed{1}<|im_end|>"]
        traj = await trajectory(chatml, tokenizer, "python-math-v0", task, wrong, pool)
        assert traj.reward == 0.0 and traj.tool_calls[0].output.endswith("1")


async def test_code_tests_trajectory(tmp_path, chatml, tokenizer):
    env = CodeTestsEnv()
    task = next(t for t in env.tasks("train") if t.id == "code-digit_sum")
    reference = next(t for t in TASKS if t.name == "digit_sum").reference
    wrong = "def digit_sum(n):\n    return n % 10\n"
    async with local_pool(tmp_path) as pool:
        replies = [
            call("run_tests", code=wrong),
            f"```python\n{reference}```<|im_end|>",
        ]
        traj = await trajectory(chatml, tokenizer, "code-tests-v0", task, replies, pool)
        assert traj.status == "done", traj.error
        assert traj.reward == 1.0 and traj.reward_breakdown["hidden_pass_rate"] == 1.0
        feedback = traj.tool_calls[0].output
        assert feedback.startswith("1/2 tests passed") and "expected 6, got 3" in feedback
        # the answer is the final code block; a hack that exits before the tests scores 0
        hack = "import sys\nsys.exit(0)\n"
        replies = [f"```python\n{hack}```<|im_end|>"]
        traj = await trajectory(chatml, tokenizer, "code-tests-v0", task, replies, pool)
        assert traj.status == "done" and traj.reward == 0.0
        # no code block: the last code sent to run_tests is the answer
        replies = [call("run_tests", code=reference), "Done.<|im_end|>"]
        traj = await trajectory(chatml, tokenizer, "code-tests-v0", task, replies, pool)
        assert traj.reward == 1.0
