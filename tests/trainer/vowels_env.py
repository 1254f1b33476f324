"""``vowels-v0``: a test environment whose reward varies even for a random tiny model (the
share of vowels in the answer), so GRPO groups have nonzero advantages and every step moves
the weights. Importable as ``vowels_env:vowels-v0`` with ``tests/trainer`` on the path."""

from __future__ import annotations

import agentrl
from agentrl import Episode, Message, Task


@agentrl.env("vowels-v0", max_turns=1, max_new_tokens=8, tags=("test",))
class VowelsEnv:
    """Answer anything; reward = share of vowels among the answer's characters. With
    ``constant_every=k`` every k-th task rewards 0.5 whatever the answer (its groups carry no
    signal: what DAPO's dynamic sampling drops). ``fail_every=k``: the reward of every k-th
    task raises (a group of failed members); ``slow_every=k``: every k-th task's
    reward takes ``slow_s`` seconds (a straggler group)."""

    def __init__(
        self,
        num_tasks: int = 64,
        constant_every: int = 0,
        fail_every: int = 0,
        slow_every: int = 0,
        slow_s: float = 0.0,
    ) -> None:
        self.num_tasks = num_tasks
        self.constant_every = constant_every
        self.fail_every, self.slow_every, self.slow_s = fail_every, slow_every, slow_s

    def tasks(self, split: str = "train", *, seed: int = 0) -> list[Task]:
        offset = 0 if split == "train" else 10**6
        return [
            Task(id=f"{split}-{seed}-{offset + i}", prompt=f"Say a word ({seed}/{offset + i}).")
            for i in range(self.num_tasks)
        ]

    async def reset(self, task: Task) -> list[Message]:
        return [Message("system", "Be brief."), Message("user", task.prompt)]

    async def reward(self, episode: Episode) -> float:
        index = int(episode.task.id.rsplit("-", 1)[1])
        if self.slow_every and index % self.slow_every == 0:
            import anyio

            await anyio.sleep(self.slow_s)
        if self.fail_every and index % self.fail_every == 0:
            raise RuntimeError(f"reward failed on task {index}")
        if self.constant_every and index % self.constant_every == 0:
            return 0.5
        text = episode.final_text
        return sum(c in "aeiouAEIOU" for c in text) / len(text) if text else 0.0

    async def close(self) -> None:
        return None
