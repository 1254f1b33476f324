"""The boundary checker: prove accumulated token ids equal a fresh render of the conversation.

The conversation is re-rendered from its messages through the chat template in one go, with
each assistant message replaced by a sentinel. Non-model text between sentinels is tokenized and
compared **by id** with the trajectory; the sampled ids are spliced in for model spans, whose
decoded text must equal the assistant message **as text** (BPE may legally tokenize the same
text differently from what the model sampled, so model spans are never compared by id).

The sentinels carry a nonce drawn afresh for each check, and the rendered text must hold each
exactly once: no conversation can contain them (a tool asked to echo an earlier fixed marker,
``\\x1fAGENTRL-MODEL-1\\x1f``, echoes text that matches no sentinel).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from .._types import Message, Trajectory
from ._template import TemplateFormat

_SENTINEL = "\x1fAGENTRL-MODEL-{nonce}-{k}\x1f"


@dataclass(frozen=True)
class BoundaryReport:
    ok: bool
    position: int | None = None
    """Token index of the first divergence (None when ok)."""
    expected: str | None = None
    actual: str | None = None
    source: str | None = None
    """Span source of the actual token at ``position``."""
    message: str = ""

    def __str__(self) -> str:
        return "ok" if self.ok else self.message


def _model_turns(traj: Trajectory) -> list[tuple[int, int]]:
    """(start, end) of each assistant turn's model tokens, in order."""
    turns: list[tuple[int, int]] = []
    current: int | None = None
    for span in traj.spans:
        if span.source != "model":
            current = None
            continue
        if current is not None and turns and turns[-1][1] == span.start:
            turns[-1] = (turns[-1][0], span.end)
        else:
            turns.append((span.start, span.end))
        current = span.turn
    return turns


def check_boundary(fmt: TemplateFormat, traj: Trajectory) -> BoundaryReport:
    """Compare ``traj.token_ids`` with a re-render of ``traj.messages``; report the first
    divergence (position, both token strings). An id the tokenizer does not have (a file
    someone else wrote) is reported as such: decoding it would raise."""
    vocab = len(fmt.tokenizer)
    for i, token in enumerate(traj.token_ids):
        if not 0 <= token < vocab:
            return BoundaryReport(
                False,
                position=i,
                message=f"token id {token} at position {i} is not in the tokenizer's "
                f"vocabulary [0, {vocab})",
            )
    messages = traj.messages
    # assistant messages inside the prompt (few-shot examples) are prompt text, not model turns
    assistant_idx = [
        i for i, m in enumerate(messages) if m.role == "assistant" and i >= traj.prompt_messages
    ]
    turns = _model_turns(traj)
    if len(turns) != len(assistant_idx):
        return BoundaryReport(
            False,
            message=f"{len(turns)} model turns in the ids but {len(assistant_idx)} assistant "
            "messages",
        )
    nonce = secrets.token_hex(16)  # unknown to whoever wrote the conversation
    sentinels = [_SENTINEL.format(nonce=nonce, k=k) for k in range(len(assistant_idx))]
    placeholder: list[Message] = list(messages)
    for k, i in enumerate(assistant_idx):
        placeholder[i] = Message("assistant", sentinels[k])
    add_gen = bool(messages) and messages[-1].role != "assistant"
    text = fmt.render_text(placeholder, add_gen)
    for k, sentinel in enumerate(sentinels):
        if text.count(sentinel) != 1:
            what = "dropped" if sentinel not in text else "repeated"
            return BoundaryReport(False, message=f"template {what} assistant message {k}")

    expected: list[int] = []
    pos = 0
    for k, (start, end) in enumerate(turns):
        sentinel = sentinels[k]
        at = text.find(sentinel, pos)
        if at < 0:
            return BoundaryReport(False, message=f"template dropped assistant message {k}")
        piece = text[pos:at]
        expected.extend(fmt.encode(piece))
        model_ids = traj.token_ids[start:end]
        content = fmt.assistant_content(model_ids)
        want = messages[assistant_idx[k]].content
        if content != want:
            return BoundaryReport(
                False,
                position=start,
                expected=want[:80],
                actual=content[:80],
                source="model",
                message=f"model span of turn {k} at token {start} decodes to {content[:80]!r}, "
                f"but the assistant message is {want[:80]!r}",
            )
        expected.extend(model_ids)
        pos = at + len(sentinel)
        # A sampled stop token that *is* the template's closing token is not re-emitted.
        if model_ids and model_ids[-1] in fmt.stop_token_ids:
            stop_text = fmt.decode([model_ids[-1]])
            if text.startswith(stop_text, pos):
                pos += len(stop_text)
    expected.extend(fmt.encode(text[pos:]))

    actual = traj.token_ids
    n = min(len(expected), len(actual))
    for i in range(n):
        if expected[i] != actual[i]:
            return _divergence(fmt, traj, i, expected[i], actual[i])
    if len(expected) != len(actual):
        i = n
        exp = expected[i] if i < len(expected) else None
        act = actual[i] if i < len(actual) else None
        return _divergence(fmt, traj, i, exp, act)
    return BoundaryReport(True)


def _divergence(
    fmt: TemplateFormat, traj: Trajectory, i: int, exp: int | None, act: int | None
) -> BoundaryReport:
    def tok(t: int | None) -> str:
        return "<end>" if t is None else f"{t} {fmt.decode([t])!r}"

    source = next((s.source for s in traj.spans if s.start <= i < s.end), None)
    return BoundaryReport(
        False,
        position=i,
        expected=tok(exp),
        actual=tok(act),
        source=source,
        message=f"trajectory {traj.id}: first divergence at token {i} ({source} span): "
        f"re-render has {tok(exp)}, trajectory has {tok(act)}",
    )
