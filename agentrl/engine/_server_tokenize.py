"""SGLang's ``/tokenize`` and ``/detokenize`` (also under ``/v1/``), with the served tokenizer.

``/tokenize`` takes ``prompt`` (a string or a list of strings) or chat ``messages`` (rendered
with the tokenizer's chat template and the generation prompt; ``tools`` are passed to the
template unless ``tool_choice`` is ``"none"``) and ``add_special_tokens``; it answers
``{"tokens", "count", "max_model_len"}``, lists of them for a list of prompts. ``/detokenize``
takes ``tokens`` (ids, or a list of id lists) and ``skip_special_tokens`` and answers
``{"text"}``. As in SGLang, other fields (``model``...) are accepted and ignored. An id outside
the vocabulary is a 400 naming it (SGLang 0.5.17 answers 500 there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ._server_generate import BadRequest, ModelFacts


class WireTokenizeReq(msgspec.Struct, omit_defaults=True):
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_special_tokens: bool = True


class WireDetokenizeReq(msgspec.Struct, omit_defaults=True):
    tokens: list[int | list[int]]
    """Ids, or a list of id lists (checked: not both)."""
    skip_special_tokens: bool = True


tokenize_decoder = msgspec.json.Decoder(WireTokenizeReq)
detokenize_decoder = msgspec.json.Decoder(WireDetokenizeReq)


def tokenize(req: WireTokenizeReq, facts: ModelFacts) -> dict[str, Any]:
    tokenizer, max_model_len = facts.tokenizer, facts.max_context
    if req.messages is not None:
        facts.check_text([str(m.get("content") or "") for m in req.messages], "messages", True)
        tools = None if req.tool_choice == "none" else req.tools
        # every field the template may render counts (a role or a tool schema too), and so
        # does what it renders: checked before the template runs, then before tokenizing
        facts.check_text(_strings([req.messages, tools]), "messages and tools", batch=False)
        try:
            text = tokenizer.apply_chat_template(
                req.messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a template that cannot render these messages
            raise BadRequest(
                f"messages cannot be rendered by the chat template: {exc}", "messages"
            ) from None
        facts.check_text([text], "the rendered messages", batch=False)
        # as apply_chat_template(tokenize=True): the template writes the special tokens
        tokens: Any = tokenizer.encode(text, add_special_tokens=False)
        count: Any = len(tokens)
    elif req.prompt is None:
        raise BadRequest("/tokenize needs 'prompt' or 'messages'", "prompt")
    elif isinstance(req.prompt, str):
        facts.check_text([req.prompt], "prompt", batch=False)
        tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        count = len(tokens)
    else:
        facts.check_text(req.prompt, "prompt", batch=True)
        tokens = [
            tokenizer.encode(p, add_special_tokens=req.add_special_tokens) for p in req.prompt
        ]
        count = [len(t) for t in tokens]
    return {"tokens": tokens, "count": count, "max_model_len": max_model_len}


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value (keys included), without recursion (any depth)."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, Mapping):
            found.extend(k for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return found


def detokenize(req: WireDetokenizeReq, tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    if any(isinstance(t, list) != batch for t in req.tokens):
        raise BadRequest("tokens must be a list of ids or a list of id lists, not both", "tokens")
    rows: list[list[int]] = req.tokens if batch else [req.tokens]  # type: ignore[assignment,list-item]
    for row in rows:
        bad = next((t for t in row if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadRequest(
                f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens"
            )
    texts = [tokenizer.decode(row, skip_special_tokens=req.skip_special_tokens) for row in rows]
    return {"text": texts if batch else texts[0]}
