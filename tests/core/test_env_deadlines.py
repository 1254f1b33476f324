"""Every call into environment code has a deadline: reset, turn_reward, respond, reward, close
(tools: test_tools.py, test_tool_isolation.py). A hook that never returns ends its own
trajectory with an error naming the call and the setting; the rest of the batch finishes."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from fakes import ScriptedEngine

import agentrl
from agentrl._rollout import RolloutContext
from agentrl._runner import run_groups

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]

ANSWER = "<answer>5</answer><|im_end|>"
HOOKS = ("reset", "turn_reward", "respond", "reward", "close")
HANG_S = 8.0
"""How long a hanging hook hangs: far past its deadline (1-1.2 s) and the batch's bound (5 s)."""
RELEASE = threading.Event()
"""Set at the end of each test: a blocked sync hook's thread then ends."""


@agentrl.env("hook-deadlines-v0", max_turns=2, max_new_tokens=32, tags=("test",))
class HookDeadlinesEnv:
    """On task ``t1`` the hook named ``hang`` never returns: ``mode="async"`` awaits forever,
    ``mode="sync"`` is a plain function that blocks its thread. Other tasks behave."""

    def __init__(self, hang: str = "reward", mode: str = "async") -> None:
        self.hang, self.mode, self.task = hang, mode, None
        if mode == "sync":  # a sync hook replaces the async one of the same name
            setattr(self, hang, self._blocking)

    def _blocking(self, *args):
        if self.hang == "reset":
            self.task = args[0]
        if self.task is not None and self.task.id == "t1":
            RELEASE.wait(HANG_S)
        return {
            "reset": lambda: [agentrl.Message("user", self.task.prompt)],
            "turn_reward": lambda: 0.25,
            "reward": lambda: 0.75,
        }.get(self.hang, lambda: None)()

    async def _maybe_hang(self, hook: str) -> None:
        if self.hang == hook and self.task is not None and self.task.id == "t1":
            await anyio.sleep(HANG_S)  # "forever" for these tests, bounded if a deadline fails

    def tasks(self, split: str = "train", *, seed: int = 0) -> list[agentrl.Task]:
        prefix = "t" if split == "train" else "e"
        return [
            agentrl.Task(id=f"{prefix}{i}", prompt="What is 3 + 2?", answer="5") for i in range(3)
        ]

    async def reset(self, task):
        self.task = task
        await self._maybe_hang("reset")
        return [agentrl.Message("system", "Answer."), agentrl.Message("user", task.prompt)]

    async def turn_reward(self, episode) -> float:
        await self._maybe_hang("turn_reward")
        return 0.5

    async def respond(self, message):
        await self._maybe_hang("respond")
        return None

    async def reward(self, episode) -> float:
        await self._maybe_hang("reward")
        return 1.0

    async def close(self) -> None:
        await self._maybe_hang("close")


def _ctx(chatml, tokenizer, **kwargs):
    return RolloutContext(
        spec=agentrl.spec("hook-deadlines-v0"),
        engine=ScriptedEngine(tokenizer, [ANSWER]),
        fmt=chatml,
        config=agentrl.RolloutConfig(
            env_timeout_s=1.0, reward_timeout_s=1.2, concurrency=3, env_kwargs=kwargs
        ),
        tokenizer_fingerprint="test",
        model_name="scripted",
    )


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("hook", HOOKS)
async def test_a_hook_that_never_returns_ends_only_its_trajectory(chatml, tokenizer, hook, mode):
    RELEASE.clear()
    ctx = _ctx(chatml, tokenizer, hang=hook, mode=mode)
    started = time.perf_counter()
    try:
        with anyio.fail_after(20):
            trajs = await run_groups(ctx, ctx.spec.make().tasks("train"))
    finally:
        RELEASE.set()
    assert time.perf_counter() - started < 5
    by_task = {t.task_id: t for t in trajs}
    assert len(by_task) == 3
    for other in ("t0", "t2"):  # the rest of the batch was not held up
        assert by_task[other].status == "done" and by_task[other].error is None
        assert by_task[other].reward == (0.75 if (hook, mode) == ("reward", "sync") else 1.0)
    stuck = by_task["t1"]
    setting, value = ("reward_timeout_s", 1.2) if hook == "reward" else ("env_timeout_s", 1.0)
    assert stuck.error is not None, stuck
    assert stuck.error.where == hook and stuck.error.type == "EnvError"
    assert stuck.error.message == (
        f"hook-deadlines-v0: {hook}() did not finish within {value:g} s "
        f"(rollout.{setting} = {value:g})"
    )
    if hook == "close":  # the episode and its reward were complete: the trajectory is kept
        assert stuck.status == "done" and stuck.reward == 1.0 and stuck.num_turns == 1
        assert stuck.turn_rewards == [0.5]
    else:
        assert stuck.status == "error" and stuck.reward is None


async def test_sync_hooks_run_off_the_event_loop(chatml, tokenizer):
    """A sync hook runs in a thread: a normal one works like an async one."""
    RELEASE.set()
    ctx = _ctx(chatml, tokenizer, hang="reward", mode="sync")
    trajs = await run_groups(ctx, ctx.spec.make().tasks("train"))
    assert [t.status for t in trajs] == ["done"] * 3
    assert [t.reward for t in trajs] == [0.75] * 3  # the sync verifier's value


def test_deadline_settings_are_validated():
    with pytest.raises(Exception, match="env_timeout_s"):
        agentrl.RolloutConfig(env_timeout_s=0)
    with pytest.raises(Exception, match="reward_timeout_s"):
        agentrl.RolloutConfig(reward_timeout_s=-1)
    defaults = agentrl.RolloutConfig()
    assert defaults.reward_timeout_s >= defaults.env_timeout_s > 0
