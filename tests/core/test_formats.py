"""Chat formats: Hermes tool-call parsing, template deltas on the real SmolLM2 tokenizer, and the
boundary checker (which must find the first divergence, and only real ones)."""

from __future__ import annotations

import inspect
import json

import msgspec
import pytest
from fakes import ScriptedEngine
from loop_probes import calc_context

import agentrl
from agentrl import Message
from agentrl._rollout import run_trajectory
from agentrl._types import GenerateResult
from agentrl.formats import (
    ChatFormat,
    ParsedCall,
    Piece,
    TemplateFormat,
    check_boundary,
    parse_hermes,
)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 2"}}\n</tool_call>'
ANSWER = "<answer>5</answer><|im_end|>"

ENDOFTEXT, IM_START, IM_END, NL = 0, 1, 2, 198
TOOL_HEADER = [IM_START, 19324, NL]  # <|im_start|>tool\n
ASSISTANT_HEADER = [IM_START, 520, 9531, NL]  # <|im_start|>assistant\n


# -- Hermes parsing ------------------------------------------------------------------------------


def test_parse_valid_call():
    turn = parse_hermes(CALL)
    assert turn.content == ""
    assert turn.calls == [ParsedCall("calculator", '{"expression": "3 + 2"}')]
    assert turn.has_calls


def test_parse_multiple_calls_and_content_outside():
    text = (
        "Let me compute.\n"
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        "and then\n"
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>\n'
        "done"
    )
    turn = parse_hermes(text)
    assert [c.name for c in turn.calls] == ["a", "b"]
    assert [json.loads(c.arguments) for c in turn.calls] == [{"x": 1}, {}]
    assert all(c.error is None for c in turn.calls)
    assert "<tool_call>" not in turn.content and "name" not in turn.content
    assert turn.content.startswith("Let me compute.") and turn.content.endswith("done")
    assert "and then" in turn.content


def test_parse_no_calls():
    turn = parse_hermes("  <answer>5</answer>\n")
    assert turn.calls == [] and not turn.has_calls and turn.content == "<answer>5</answer>"


def test_parse_unterminated_final_call():
    """A turn cut by max tokens or a stop string still yields its last call."""
    text = 'first <tool_call>{"name": "a", "arguments": {}}</tool_call> then '
    text += '<tool_call>\n{"name": "b", "arguments": {"y": "z"}}\n'
    turn = parse_hermes(text)
    assert [(c.name, c.error) for c in turn.calls] == [("a", None), ("b", None)]
    assert json.loads(turn.calls[1].arguments) == {"y": "z"}
    assert turn.content == "first  then"


def test_parse_unterminated_truncated_json():
    turn = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expr')
    (call,) = turn.calls
    assert call.error is not None and "not valid JSON" in call.error


@pytest.mark.parametrize(
    ("body", "name", "error"),
    [
        ("{not json}", "", "tool call is not valid JSON"),
        ('{"arguments": {}}', "", "tool call has no string 'name'"),
        ('{"name": 3, "arguments": {}}', "", "tool call has no string 'name'"),
        ('{"name": "", "arguments": {}}', "", "tool call has no string 'name'"),
        ('["calculator"]', "", "must be a JSON object"),
        ("", "", "empty <tool_call> block"),
        ('{"name": "a", "arguments": {}, "id": 1}', "a", "unexpected keys in tool call: ['id']"),
    ],
)
def test_parse_malformed_calls(body, name, error):
    (call,) = parse_hermes(f"<tool_call>\n{body}\n</tool_call>").calls
    assert call.name == name
    assert call.error is not None and error in call.error


def test_parse_arguments_as_string_and_missing():
    (call,) = parse_hermes(
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
    ).calls
    assert call == ParsedCall("a", '{"x": 1}')  # a double-encoded string is passed through
    (call,) = parse_hermes('<tool_call>{"name": "a"}</tool_call>').calls
    assert call == ParsedCall("a", "{}")


def test_parse_keeps_unicode_arguments():
    (call,) = parse_hermes(
        '<tool_call>{"name": "a", "arguments": {"q": "7×6 😀"}}</tool_call>'
    ).calls
    assert json.loads(call.arguments) == {"q": "7×6 😀"} and "7×6 😀" in call.arguments


def test_parse_caps_the_number_of_calls():
    one = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    turn = parse_hermes(one * 5, max_calls=3)
    assert len(turn.calls) == 4
    assert [c.error for c in turn.calls[:3]] == [None] * 3
    assert turn.calls[3].error == "more than 3 tool calls in one turn"


# -- TemplateFormat on the real tokenizer ------------------------------------------------------


def test_token_ids_the_design_relies_on(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ċ"])
    assert ids == [ENDOFTEXT, IM_START, IM_END, NL]


def test_stop_ids_and_strings(chatml):
    assert chatml.stop_token_ids == (ENDOFTEXT, IM_END)
    assert chatml.stop_strings == ("</tool_call>",)
    assert chatml.name == "chatml-hermes"


def test_turn_close_text(chatml):
    assert chatml.turn_close_text == "<|im_end|>\n"


def test_close_turn_after_sampled_im_end(chatml):
    model_ids = [*chatml.encode("hi"), IM_END]
    piece = chatml.close_turn(model_ids, stopped=True)
    assert piece == Piece([NL], "template")


def test_close_turn_without_a_stop(chatml):
    piece = chatml.close_turn(chatml.encode("one two three"), stopped=False)
    assert piece == Piece([IM_END, NL], "template")
    assert chatml.decode(piece.token_ids) == "<|im_end|>\n"


def test_close_turn_after_endoftext(chatml):
    piece = chatml.close_turn([*chatml.encode("hi"), ENDOFTEXT], stopped=True)
    assert piece == Piece([IM_END, NL], "template")


def test_close_turn_of_an_empty_turn(chatml):
    assert chatml.close_turn([], stopped=False).token_ids == [IM_END, NL]
    assert chatml.close_turn([], stopped=True).token_ids == [IM_END, NL]


def test_render_tool_observation(chatml):
    pieces = chatml.render_observation([Message("tool", "84")])
    assert [p.source for p in pieces] == ["template", "tool", "template"]
    assert pieces[0].token_ids == TOOL_HEADER
    assert chatml.decode(pieces[0].token_ids) == "<|im_start|>tool\n"
    assert chatml.decode(pieces[1].token_ids) == "84"
    assert pieces[1].token_ids == chatml.encode("84")
    assert pieces[2].token_ids == [IM_END, NL, *ASSISTANT_HEADER]
    assert chatml.decode(pieces[2].token_ids) == "<|im_end|>\n<|im_start|>assistant\n"


def test_render_two_tools_and_a_user_turn(chatml, tokenizer):
    messages = [Message("tool", "1"), Message("tool", "two words"), Message("user", "go on")]
    pieces = chatml.render_observation(messages)
    assert [p.source for p in pieces] == [
        "template",
        "tool",
        "template",
        "tool",
        "template",
        "prompt",
        "template",
    ]
    assert [chatml.decode(p.token_ids) for p in pieces if p.source != "template"] == [
        "1",
        "two words",
        "go on",
    ]
    text = chatml.decode([t for p in pieces for t in p.token_ids])
    assert text == (
        "<|im_start|>tool\n1<|im_end|>\n<|im_start|>tool\ntwo words<|im_end|>\n"
        "<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    )
    # the pieces are exactly what the template renders after a closed assistant turn
    before = [Message("user", "U"), Message("assistant", "A")]
    full = tokenizer.apply_chat_template(
        _dicts([*before, *messages]), tokenize=False, add_generation_prompt=True
    )
    head = tokenizer.apply_chat_template(_dicts(before), tokenize=False)
    assert [t for p in pieces for t in p.token_ids] == chatml.encode(full[len(head) :])


@pytest.mark.parametrize(
    ("messages", "contents"),
    [
        ([Message("tool", "tool")], [("tool", "tool")]),
        ([Message("tool", "o")], [("tool", "o")]),
        ([Message("user", "user")], [("prompt", "user")]),
        ([Message("tool", "assistant"), Message("tool", "")], [("tool", "assistant")]),
        ([Message("tool", " 84\n")], [("tool", " 84\n")]),
    ],
)
def test_content_is_attributed_even_when_it_looks_like_the_template(chatml, messages, contents):
    """A tool output such as "tool" also occurs in the role header; the header stays template."""
    pieces = chatml.render_observation(messages)
    assert pieces[0].token_ids[:2] == [IM_START, chatml.encode(messages[0].role)[0]]
    assert pieces[0].source == "template"
    got = [(p.source, chatml.decode(p.token_ids)) for p in pieces if p.source != "template"]
    assert got == contents


def test_template_format_follows_the_chat_format_protocol():
    """Other formats are written against ``ChatFormat``: it must say what the runtime and the
    boundary checker actually call."""
    methods = [n for n, v in vars(ChatFormat).items() if callable(v) and not n.startswith("_")]
    assert {"prepare", "render_prompt", "render_text", "decode", "encode"} <= set(methods)
    for name in methods:
        want = list(inspect.signature(getattr(ChatFormat, name)).parameters)
        got = list(inspect.signature(getattr(TemplateFormat, name)).parameters)
        assert got == want, name


def _dicts(messages):
    return [{"role": m.role, "content": m.content} for m in messages]


def test_render_observation_needs_messages(chatml):
    with pytest.raises(agentrl.FormatError):
        chatml.render_observation([])


def test_render_prompt(chatml, tokenizer):
    messages = [Message("system", "S"), Message("user", "What is 3 + 2?")]
    piece = chatml.render_prompt(messages)
    assert piece.source == "prompt"
    assert piece.token_ids[0] == IM_START and piece.token_ids[-4:] == ASSISTANT_HEADER
    rendered = tokenizer.apply_chat_template(
        _dicts(messages), tokenize=True, add_generation_prompt=True
    )
    if not isinstance(rendered, list):  # transformers 5 returns a BatchEncoding
        rendered = rendered["input_ids"]
    assert piece.token_ids == list(rendered)
    with pytest.raises(agentrl.FormatError, match="must end with a non-assistant message"):
        chatml.render_prompt([*messages, Message("assistant", "5")])
    with pytest.raises(agentrl.FormatError):
        chatml.render_prompt([])


def test_prepare_declares_tools_in_the_system_message(chatml):
    schema = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
    msgs = chatml.prepare([Message("system", "Be exact.  "), Message("user", "q")], [schema])
    assert msgs[0].content.startswith("Be exact.\n\n# Tools")
    assert json.dumps(schema) in msgs[0].content and "<tool_call>" in msgs[0].content
    msgs = chatml.prepare([Message("user", "q")], [schema])
    assert [m.role for m in msgs] == ["system", "user"]
    assert chatml.prepare([Message("user", "q")], []) == [Message("user", "q")]


def test_assistant_content_drops_only_a_final_stop(chatml):
    ids = chatml.encode("a b")
    assert chatml.assistant_content([*ids, IM_END]) == "a b"
    assert chatml.assistant_content([*ids, ENDOFTEXT]) == "a b"
    assert chatml.assistant_content(ids) == "a b"
    assert chatml.assistant_content([IM_END, *ids]) == "<|im_end|>a b"


# -- the boundary checker ------------------------------------------------------------------------


async def _rollout(fmt, engine, **cfg):
    ctx = calc_context(fmt, engine, **cfg)
    task = agentrl.Task(id="t0", prompt="What is 3 + 2?", answer="5")
    traj = await run_trajectory(ctx, task, group_id="g", sample_index=0, seed=1)
    traj.validate()
    assert traj.status != "error", traj.error
    return traj


@pytest.fixture
async def tool_traj(chatml, tokenizer):
    """Spans: prompt, model (call), close, tool header, "5", close + header, model, "\\n"."""
    traj = await _rollout(chatml, ScriptedEngine(tokenizer, [CALL, ANSWER]))
    assert [s.source for s in traj.spans] == [
        "prompt",
        "model",
        "template",
        "template",
        "tool",
        "template",
        "model",
        "template",
    ]
    return traj


def _replace_id(traj, index, new_id):
    ids = list(traj.token_ids)
    assert ids[index] != new_id
    ids[index] = new_id
    return msgspec.structs.replace(traj, token_ids=ids)


@pytest.mark.anyio
async def test_sentinel_like_text_in_the_conversation_is_not_a_model_turn(chatml, tokenizer):
    """The checker once marked assistant turns with a fixed ``\\x1fAGENTRL-MODEL-k\\x1f``: that
    text in a prompt or a tool's output (a tool asked to echo it) was taken for the turn and
    reported a divergence in a correct trajectory. The markers now carry a fresh nonce."""
    ctx = calc_context(chatml, ScriptedEngine(tokenizer, [CALL, ANSWER]))
    fake = "\x1fAGENTRL-MODEL-0\x1f"  # the first turn's old marker, in the prompt
    task = agentrl.Task(id="t0", prompt=f"What is 3 + 2? {fake}", answer="5")
    traj = await run_trajectory(ctx, task, group_id="g", sample_index=0, seed=1)
    assert traj.status != "error" and fake in traj.messages[traj.prompt_messages - 1].content
    report = check_boundary(chatml, traj)
    assert report.ok, report.message


@pytest.mark.anyio
async def test_boundary_passes_on_a_real_rollout(chatml, tool_traj):
    report = check_boundary(chatml, tool_traj)
    assert report.ok and report.position is None and str(report) == "ok"


@pytest.mark.anyio
@pytest.mark.parametrize(("span_index", "offset"), [(0, 5), (2, 0), (3, 1), (4, 0), (5, 3), (7, 0)])
async def test_boundary_finds_a_flipped_non_model_token(chatml, tool_traj, span_index, offset):
    span = tool_traj.spans[span_index]
    index = span.start + offset
    assert index < span.end
    old = tool_traj.token_ids[index]
    new = 11 if old != 11 else 12
    report = check_boundary(chatml, _replace_id(tool_traj, index, new))
    assert not report.ok
    assert report.position == index
    assert report.source == span.source
    assert report.expected == f"{old} {chatml.decode([old])!r}"
    assert report.actual == f"{new} {chatml.decode([new])!r}"
    assert f"first divergence at token {index}" in report.message


@pytest.mark.anyio
async def test_boundary_finds_missing_and_extra_tokens(chatml, tool_traj):
    n = len(tool_traj.token_ids)
    short = msgspec.structs.replace(tool_traj, token_ids=tool_traj.token_ids[:-1])
    report = check_boundary(chatml, short)
    assert not report.ok and report.position == n - 1 and report.actual == "<end>"
    longer = msgspec.structs.replace(tool_traj, token_ids=[*tool_traj.token_ids, NL])
    report = check_boundary(chatml, longer)
    assert not report.ok and report.position == n and report.expected == "<end>"


@pytest.mark.anyio
async def test_boundary_model_text_mismatch(chatml, tool_traj):
    messages = list(tool_traj.messages)
    k = next(
        i
        for i, m in enumerate(messages)
        if m.role == "assistant" and i >= tool_traj.prompt_messages
    )
    messages[k] = Message("assistant", messages[k].content + " extra")
    report = check_boundary(chatml, msgspec.structs.replace(tool_traj, messages=messages))
    first_model = next(s for s in tool_traj.spans if s.source == "model")
    assert not report.ok
    assert report.position == first_model.start and report.source == "model"
    assert "model span of turn 0" in report.message


@pytest.mark.anyio
async def test_boundary_edited_fewshot_turn_is_a_prompt_divergence(chatml, tool_traj):
    messages = list(tool_traj.messages)
    k = next(i for i, m in enumerate(messages) if m.role == "assistant")
    assert k < tool_traj.prompt_messages  # calc-v0's first few-shot example
    messages[k] = Message("assistant", messages[k].content + " extra")
    report = check_boundary(chatml, msgspec.structs.replace(tool_traj, messages=messages))
    assert not report.ok and report.source == "prompt"


@pytest.mark.anyio
async def test_boundary_flipped_model_token_is_a_text_mismatch(chatml, tool_traj):
    second_model = [s for s in tool_traj.spans if s.source == "model"][1]
    report = check_boundary(chatml, _replace_id(tool_traj, second_model.start + 1, 11))
    assert not report.ok
    assert report.position == second_model.start and report.source == "model"
    assert "model span of turn 1" in report.message


@pytest.mark.anyio
async def test_boundary_counts_assistant_messages(chatml, tool_traj):
    n = tool_traj.prompt_messages
    messages = tool_traj.messages[:n] + [
        m for m in tool_traj.messages[n:] if m.role != "assistant" or "answer" not in m.content
    ]
    report = check_boundary(chatml, msgspec.structs.replace(tool_traj, messages=messages))
    assert not report.ok
    assert report.message == "2 model turns in the ids but 1 assistant messages"


class _CloseWithoutNewline(TemplateFormat):
    """Broken on purpose: closes a turn with ``<|im_end|>`` but no ``\\n``."""

    def close_turn(self, model_ids, stopped):
        ids = list(super().close_turn(model_ids, stopped).token_ids)
        if ids and ids[-1] == NL:
            ids.pop()
        return Piece(ids, "template")


class _ToolHeaderWithoutNewline(TemplateFormat):
    """Broken on purpose: ``<|im_start|>tool`` without the ``\\n`` before the content."""

    def render_observation(self, messages):
        first, *rest = super().render_observation(messages)
        assert first.token_ids[-1] == NL
        return [Piece(first.token_ids[:-1], first.source), *rest]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("broken", "where", "actual_source"),
    [
        (_CloseWithoutNewline, lambda spans: spans[2].end, "template"),
        (_ToolHeaderWithoutNewline, lambda spans: spans[3].end, "tool"),
    ],
)
async def test_boundary_catches_a_broken_format(chatml, tokenizer, broken, where, actual_source):
    fmt = broken(tokenizer)
    traj = await _rollout(fmt, ScriptedEngine(tokenizer, [CALL, ANSWER]))
    report = check_boundary(chatml, traj)
    assert not report.ok
    assert report.position == where(traj.spans)
    assert report.expected == f"{NL} {chr(10)!r}"
    assert report.source == actual_source
    assert report.actual == f"{traj.token_ids[report.position]} " + repr(
        chatml.decode([traj.token_ids[report.position]])
    )


class _IdsEngine(ScriptedEngine):
    """Returns fixed sampled ids (as a real engine may: not what BPE would produce)."""

    def __init__(self, tokenizer, replies_ids):
        super().__init__(tokenizer, ["unused"])
        self.replies_ids = replies_ids

    async def generate(self, input_ids, sampling, session=None):
        call = len(self.calls)
        self.calls.append(list(input_ids))
        ids = self.replies_ids[min(call, len(self.replies_ids) - 1)]
        return GenerateResult(
            token_ids=list(ids),
            logprobs=[-1.0] * len(ids),
            finish_reason="stop",
            matched_stop=ids[-1],
            prompt_tokens=len(input_ids),
            weight_version=self.weight_version,
        )


@pytest.mark.anyio
async def test_boundary_compares_model_spans_as_text(chatml, tokenizer):
    hel, lo = tokenizer.convert_tokens_to_ids(["Ġhel", "lo"])
    sampled = [hel, lo, IM_END]
    assert chatml.decode([hel, lo]) == " hello"
    assert chatml.encode(" hello") != [hel, lo]  # BPE would say it differently
    traj = await _rollout(chatml, _IdsEngine(tokenizer, [sampled]))
    (model,) = [s for s in traj.spans if s.source == "model"]
    assert traj.token_ids[model.start : model.end] == sampled  # kept exactly as sampled
    assert traj.messages[-1] == Message("assistant", " hello")
    report = check_boundary(chatml, traj)
    assert report.ok, report.message
