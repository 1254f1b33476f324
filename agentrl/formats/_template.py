"""A chat format driven by the tokenizer's own chat template (HF Jinja).

Everything the runtime appends between model turns is *derived from the template once* (by
rendering probe conversations and taking differences), never hand-written per model, and the
boundary checker re-renders whole conversations through the same template to prove it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import FormatError
from .._types import Message
from ._base import ParsedTurn, Piece
from ._hermes import CLOSE, hermes_tools_block, parse_hermes

_PROBE_CONTENT = "\x1fAGENTRL-PROBE\x1f"


def _as_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.content}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


class TemplateFormat:
    """Hermes tool calls inside a tokenizer's chat template (ChatML for SmolLM2).

    Tool schemas are declared in the system message (the SmolLM2 template has no tool support);
    tool results are rendered as role ``tool`` messages by the template.
    """

    known_divergences: tuple[str, ...] = ()

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str = "chatml-hermes",
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] = (CLOSE,),
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise FormatError(f"tokenizer {type(tokenizer).__name__} has no chat template")
        self.tokenizer = tokenizer
        self.name = name
        if stop_token_ids is None:
            stop_token_ids = _default_stop_ids(tokenizer)
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.stop_strings = tuple(stop_strings)
        self._turn_close_text = self._derive_turn_close()

    # -- rendering -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                _as_dicts(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:
            raise FormatError(f"{self.name}: chat template failed: {exc}") from exc

    def prepare(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
    ) -> list[Message]:
        """Declare ``tools`` in the system message (added if the env gave none)."""
        msgs = list(messages)
        if not tools:
            return msgs
        block = hermes_tools_block(tools)
        if msgs and msgs[0].role == "system":
            msgs[0] = Message("system", msgs[0].content.rstrip() + "\n\n" + block)
        else:
            msgs.insert(0, Message("system", block))
        return msgs

    def render_prompt(self, messages: Sequence[Message]) -> Piece:
        if not messages or messages[-1].role == "assistant":
            raise FormatError(f"{self.name}: a prompt must end with a non-assistant message")
        return Piece(self.encode(self.render_text(messages, True)), "prompt")

    def _derive_turn_close(self) -> str:
        probe = [Message("system", "S"), Message("user", "U")]
        text = self.render_text([*probe, Message("assistant", _PROBE_CONTENT)], False)
        at = text.rfind(_PROBE_CONTENT)
        if at < 0:
            raise FormatError(f"{self.name}: the template drops assistant content")
        return text[at + len(_PROBE_CONTENT) :]

    @property
    def turn_close_text(self) -> str:
        """Template text after an assistant message's content (``<|im_end|>\\n`` in ChatML)."""
        return self._turn_close_text

    def close_turn(self, model_ids: Sequence[int], stopped: bool) -> Piece:
        close = self._turn_close_text
        if stopped and model_ids:
            stop_text = self.decode([model_ids[-1]])
            if stop_text and close.startswith(stop_text):
                close = close[len(stop_text) :]
        return Piece(self.encode(close) if close else [], "template")

    def render_observation(self, messages: Sequence[Message]) -> list[Piece]:
        """Pieces for ``messages`` (tool results, user turns) + the next assistant header."""
        if not messages:
            raise FormatError(f"{self.name}: render_observation needs at least one message")
        probe = [
            Message("system", "S"),
            Message("user", "U"),
            Message("assistant", _PROBE_CONTENT),
        ]
        before = self.render_text(probe, False)
        after = self.render_text([*probe, *messages], True)
        if not after.startswith(before):
            raise FormatError(
                f"{self.name}: the template re-renders earlier turns when a message is added; "
                "declare this divergence in the format"
            )
        delta = after[len(before) :]
        # character ranges of each message's content inside the delta, located through a render
        # with unique placeholders (searching for the content itself can hit the role header,
        # e.g. a tool output "tool")
        marks = [f"{_PROBE_CONTENT}{i}\x1f" for i in range(len(messages))]
        marked = self.render_text(
            [*probe, *(Message(m.role, k, m.name) for m, k in zip(messages, marks, strict=True))],
            True,
        )[len(before) :]
        ranges: list[tuple[int, int, str]] = []
        shift = 0
        for m, mark in zip(messages, marks, strict=True):
            at = marked.find(mark)
            if at < 0 or delta[at + shift : at + shift + len(m.content)] != m.content:
                raise FormatError(f"{self.name}: cannot locate a {m.role} message in its render")
            if m.content:
                ranges.append((at + shift, at + shift + len(m.content), _content_source(m)))
            shift += len(m.content) - len(mark)
        enc = self.tokenizer(delta, add_special_tokens=False, return_offsets_mapping=True)
        pieces: list[Piece] = []
        for tok_id, (start, _end) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
            source = "template"
            for lo, hi, src in ranges:
                if lo <= start < hi:
                    source = src
                    break
            if pieces and pieces[-1].source == source:
                pieces[-1].token_ids.append(tok_id)
            else:
                pieces.append(Piece([tok_id], source))  # type: ignore[arg-type]
        return pieces

    # -- parsing -----------------------------------------------------------------------------
    def assistant_content(self, model_ids: Sequence[int]) -> str:
        ids = list(model_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def parse(self, text: str) -> ParsedTurn:
        return parse_hermes(text)


def _content_source(message: Message) -> str:
    return "tool" if message.role == "tool" else "prompt"


def _default_stop_ids(tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for attr in ("eos_token_id",):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            ids.append(value)
    for token in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if token in tokenizer.get_vocab() and isinstance(tid, int):
            ids.append(tid)
    return sorted(set(ids))
