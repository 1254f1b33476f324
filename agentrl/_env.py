"""The environment contract.

An environment is any object with these hooks; agentrl owns the loop that calls them
(generate → parse tool calls → run tools → append → … → reward). Environments see and return
``Message`` objects and never touch tokens. One instance serves one trajectory: the runtime calls
the registered factory once per trajectory, so per-trajectory state (a sandbox lease, a simulated
user's memory) lives on ``self``. ``tasks()`` is called on a separate instance.

This is a Protocol, not a base class (no implementation inheritance): a plain class with the
right methods is an environment. Tools are methods (or functions listed in ``tools``) decorated
with ``@agentrl.tool``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from ._types import Message, TerminationReason, ToolCallRecord

Split = Literal["train", "eval"]


class Task(msgspec.Struct, frozen=True):
    """A unit of work an environment hands out. ``id`` is unique within (env, split)."""

    id: str
    """Unique within (env, split); trajectories record it as ``task_id``."""
    prompt: str
    """What the user asks (the env's ``reset`` turns it into messages)."""
    answer: str = ""
    """The reference answer the verifier compares against ('' when there is none)."""
    level: int = 0
    """Difficulty level (envs with a curriculum filter tasks by it)."""
    meta: dict[str, str] = msgspec.field(default_factory=dict)
    """Anything else the env wants to carry to its verifier."""


class Reward(msgspec.Struct):
    """A verifier's verdict: the scalar the learner uses plus named parts for logging."""

    total: float
    """The trajectory's reward: what the learner uses."""
    breakdown: dict[str, float] = msgspec.field(default_factory=dict)
    """Named parts (e.g. correctness, format), saved on the trajectory as
    ``reward_breakdown`` for logging; they need not sum to ``total``."""


class Episode(msgspec.Struct):
    """What the verifier (``reward``) and per-turn hooks see: the conversation so far."""

    task: Any
    """The task being solved (what ``tasks()`` returned)."""
    messages: list[Message]
    """The whole conversation: the prompt messages, then assistant turns and observations."""
    tool_calls: list[ToolCallRecord]
    """Every tool call so far, in order."""
    num_turns: int
    """Assistant turns so far."""
    termination_reason: TerminationReason | None = None
    """Why the episode ended (None while it runs)."""
    truncated: bool = False
    """The episode was cut by a budget (turns, tokens, context, deadline), not finished."""
    prompt_messages: int = 0
    """How many leading ``messages`` came from ``reset`` (few-shot turns are not the model's)."""

    @property
    def model_messages(self) -> list[Message]:
        """Assistant messages the model wrote in this episode (never few-shot examples)."""
        return [m for m in self.messages[self.prompt_messages :] if m.role == "assistant"]

    @property
    def final_text(self) -> str:
        """The last assistant message the model wrote ('' if it never answered)."""
        written = self.model_messages
        return written[-1].content if written else ""


@runtime_checkable
class Env(Protocol):
    """Hooks an environment implements. ``close`` is optional (nothing to release without
    it), and so are ``respond`` and ``turn_reward``."""

    def tasks(self, split: Split, *, seed: int = 0) -> Sequence[Any]:
        """Deterministic tasks for ``split`` (each with a unique ``id: str``)."""
        ...

    async def reset(self, task: Any) -> list[Message]:
        """Start an episode: return the system prompt and the first user turn."""
        ...

    async def reward(self, episode: Episode) -> float | Reward:
        """The verifier: score the finished episode."""
        ...

    async def close(self) -> None:
        """Release per-trajectory resources. Called exactly once, even after errors."""
        ...


@runtime_checkable
class Responder(Protocol):
    async def respond(self, message: Message) -> list[Message] | None:
        """Non-tool feedback on an assistant message without tool calls (e.g. a simulated
        user). ``None`` ends the episode."""
        ...


@runtime_checkable
class TurnRewarder(Protocol):
    async def turn_reward(self, episode: Episode) -> float:
        """Reward for the turn that just ended (default 0.0 when not implemented)."""
        ...
