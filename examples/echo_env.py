"""The README's example: a 15-line environment, dry-run on the tiny model."""

import agentrl
from agentrl import Message, Task


@agentrl.env("echo-v0", max_turns=2, max_new_tokens=32)
class Echo:
    def tasks(self, split, *, seed=0):
        return [Task(id=f"{split}-{i}", prompt=f"Say {i}.", answer=str(i)) for i in range(8)]

    async def reset(self, task):
        return [Message("system", "Use the shout tool, then answer."), Message("user", task.prompt)]

    @agentrl.tool
    def shout(self, text: str) -> str:
        """Upper-case some text."""
        return text.upper()

    async def reward(self, episode):
        return float(episode.task.answer in episode.final_text)

    async def close(self): ...


if __name__ == "__main__":
    result = agentrl.rollout(
        "echo-v0", model="tiny-random", n=2, config=agentrl.RolloutConfig(group_size=2)
    )
    for traj in result.trajectories:
        print(
            traj.id,
            traj.status,
            traj.termination_reason,
            "reward",
            traj.reward,
            "model tokens",
            sum(traj.loss_mask),
            "of",
            len(traj.token_ids),
        )
