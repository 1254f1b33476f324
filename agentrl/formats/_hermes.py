"""Hermes-style tool calls: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .._config_file import unreadable_json
from ._base import ParsedCall, ParsedTurn

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def parse_hermes(text: str, *, max_calls: int = 8) -> ParsedTurn:
    """Parse every ``<tool_call>`` block; text outside the blocks is the content.

    An unterminated block at the end of the text is still parsed (a turn cut by a stop string or
    max tokens). Malformed blocks become ``ParsedCall(error=…)`` so the model gets told why.
    """
    calls: list[ParsedCall] = []
    for m in _CALL_RE.finditer(text):
        if len(calls) >= max_calls:
            calls.append(ParsedCall("", "", f"more than {max_calls} tool calls in one turn"))
            break
        body = m.group(1).strip()
        calls.append(_parse_one(body))
    content = _CALL_RE.sub("", text).strip()
    return ParsedTurn(content=content, calls=calls)


def _parse_one(body: str) -> ParsedCall:
    if not body:
        return ParsedCall("", "", "empty <tool_call> block")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParsedCall("", body, f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    except (ValueError, RecursionError) as exc:  # nested too deep, an integer of 5,000 digits
        return ParsedCall("", body, f"tool call JSON cannot be read ({unreadable_json(exc)})")
    if not isinstance(obj, dict):
        return ParsedCall("", body, "tool call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall("", body, "tool call has no string 'name'")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode; accept a JSON string
        arguments = args
    else:
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except (ValueError, RecursionError) as exc:
            return ParsedCall("", body, f"tool call JSON cannot be read ({unreadable_json(exc)})")
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return ParsedCall(name, arguments, f"unexpected keys in tool call: {sorted(extra)}")
    return ParsedCall(name, arguments)


def hermes_tools_block(tools: Sequence[dict[str, Any]]) -> str:
    """The system-prompt section that declares tools and the call syntax."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one of the following functions. "
        "Function signatures are inside <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, reply with a JSON object inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
