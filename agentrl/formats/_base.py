"""The chat-format interface: how a conversation becomes token ids, and how model text becomes
tool calls. The rollout runtime only talks to this interface, so Qwen2.5/3 or Llama-3.1 styles
plug in next to the Hermes/ChatML format SmolLM2 uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._types import Message, SpanSource


@dataclass(frozen=True)
class Piece:
    """Token ids to append and the source they are attributed to (never ``model``)."""

    token_ids: list[int]
    source: SpanSource


@dataclass(frozen=True)
class ParsedCall:
    """One tool call parsed out of model text. ``error`` is set when the call is malformed;
    ``name``/``arguments`` then hold whatever could be recovered."""

    name: str
    arguments: str
    error: str | None = None


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)


class ChatFormat(Protocol):
    """A chat format bound to a tokenizer."""

    name: str
    stop_token_ids: tuple[int, ...]
    """Ids that end an assistant turn when sampled (kept in the trajectory as model tokens)."""
    stop_strings: tuple[str, ...]
    """Strings matched on decoded text that end a turn early (e.g. ``</tool_call>``)."""
    known_divergences: tuple[str, ...]
    """Names of intended re-render differences the boundary checker tolerates."""

    def prepare(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
    ) -> list[Message]:
        """The messages with ``tools`` declared the way this format declares them."""
        ...

    def render_prompt(self, messages: Sequence[Message]) -> Piece:
        """The whole initial prompt (of prepared messages), ending with the assistant
        generation header."""
        ...

    def close_turn(self, model_ids: Sequence[int], stopped: bool) -> Piece:
        """Template ids that close an assistant turn after the sampled ``model_ids``.

        ``stopped`` is True when the last sampled id is a stop id."""
        ...

    def render_observation(self, messages: Sequence[Message]) -> list[Piece]:
        """Tool results / user feedback after a closed assistant turn, followed by the next
        assistant header: template pieces plus ``tool`` / ``prompt`` content pieces."""
        ...

    def assistant_content(self, model_ids: Sequence[int]) -> str:
        """The assistant message text for sampled ids (the final stop id is not content)."""
        ...

    def parse(self, text: str) -> ParsedTurn:
        """Split assistant text into content and tool calls."""
        ...

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The conversation as the chat template renders it (used by the boundary checker)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Tokenize a fragment without adding special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text, special tokens kept."""
        ...
