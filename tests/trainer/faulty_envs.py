"""Environments that fail or take their time, for the commands' error and Ctrl-C tests.
Importable as ``faulty_envs:<id>`` with ``tests/trainer`` on the path.

- ``slow-v0``: 300 one-turn tasks whose verifier takes 0.25 s (a rollout long enough to
  interrupt), reward 1.0 with a breakdown.
- ``broken-reward-v0``: its verifier raises on every trajectory (a bug in the env).
"""

from __future__ import annotations

import anyio

import agentrl
from agentrl import Episode, Message, Reward, Task


class _OneTurn:
    def tasks(self, split: str = "train", *, seed: int = 0) -> list[Task]:
        offset = 0 if split == "train" else 10**6
        return [Task(id=f"{split}-{offset + i}", prompt="Say a word.") for i in range(300)]

    async def reset(self, task: Task) -> list[Message]:
        return [Message("system", "Be brief."), Message("user", task.prompt)]

    async def close(self) -> None:
        return None


@agentrl.env("slow-v0", max_turns=1, max_new_tokens=4, tags=("test",))
class SlowEnv(_OneTurn):
    async def reward(self, episode: Episode) -> Reward:
        await anyio.sleep(0.25)
        return Reward(1.0, breakdown={"answered": 1.0, "length": float(len(episode.final_text))})


@agentrl.env("broken-reward-v0", max_turns=1, max_new_tokens=4, tags=("test",))
class BrokenRewardEnv(_OneTurn):
    async def reward(self, episode: Episode) -> float:
        return score(episode.final_text)


def score(text: str) -> float:
    return {"expected": 1.0}[text]  # a verifier bug: KeyError on every answer
