"""The scripted engine: an ``Engine`` that replays a file of assistant turns.

It exists to exercise an environment's tools end to end without a model that calls them
(``agentrl rollout --env calc-v0 --engine scripted:turns.yaml``): each trajectory's k-th generate
call answers with the k-th turn of its script. Token-in/token-out stays honest, so masks, spans and
the boundary check see what a real model would produce:

- a turn's text is tokenized with the model's tokenizer (``add_special_tokens=False``), and those
  ids are returned as the sampled tokens;
- generation obeys the request like a real engine: it stops at a stop id or a stop string
  (``</tool_call>``: the runtime then closes the turn with template tokens) and cuts at
  ``max_new_tokens`` (``finish_reason="length"``);
- a turn whose text runs out ends with the chat template's end-of-turn token (``<|im_end|>`` in
  ChatML), as a chat model samples it (``finish_reason="stop"``); a turn may also write it.

Logprobs are **synthetic**: 0.0 for every token (probability 1, as if the script were the
policy). Trajectories from this engine test environments and masks; they are not samples of any
model and must not be trained on: each says so (``info["logprobs"] = "synthetic"``, from the
engine's ``synthetic_logprobs``).

File formats (``read_script``): YAML, either a list of turns (one script for every trajectory),
a mapping ``{turns: [...]}``, or ``{scripts: [{match: TEXT, turns: [...]}, ...]}`` where the
first script whose ``match`` occurs in a trajectory's prompt is used (a script without ``match``
is the fallback); or JSONL, one turn per line (a JSON string or ``{"text": ...}``). Every text
must be valid Unicode: a JSON or YAML escape of half a surrogate pair (``"\\ud800"``) is
refused when the file is read, naming its line.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import pydantic
import torch

from agentrl._config import short_repr
from agentrl._config_file import decode_utf8, load_json, read_config_file
from agentrl._errors import ConfigError, EngineError
from agentrl._types import GenerateResult, SamplingParams

SYNTHETIC_LOGPROB = 0.0
"""The logprob the scripted engine reports for every token it returns."""


def _valid_unicode(text: str) -> str:
    """``text`` unchanged when it can be encoded (and so tokenized); a lone surrogate cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text is not valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at "
            f"character {exc.start + 1} (half of a pair, e.g. a \\u{ord(text[exc.start]):04x} "
            "escape without its partner)"
        ) from None
    return text


Text = Annotated[str, pydantic.AfterValidator(_valid_unicode)]


class Script(pydantic.BaseModel):
    """The assistant turns of one trajectory."""

    model_config = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)

    match: Text | None = None
    """Use this script for trajectories whose prompt contains this text (None: the fallback
    for prompts no other script matches)."""
    turns: list[Text] = pydantic.Field(min_length=1)
    """The assistant's turns in order: plain text, which may hold tool calls
    (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the Hermes format)."""


class ScriptFile(pydantic.BaseModel):
    """What a scripted-engine file holds: one or more scripts."""

    model_config = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)

    scripts: list[Script] = pydantic.Field(min_length=1)
    """Tried in order: the first whose ``match`` occurs in the prompt, else the first without
    ``match``."""


def read_script(path: str | Path) -> ScriptFile:
    """Parse a YAML or JSONL script file; ``ConfigError`` naming the file and the line (and
    the field) of a bad entry."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no such script file: {file}")
    # implied: how many leading parts of a ScriptFile location the file does not spell (its
    # short forms: a list of turns, {turns: ...}); locate: the line of a location's value
    locate: Callable[[tuple[Any, ...]], int | None]
    if file.suffix == ".jsonl":
        turns, turn_lines = _read_jsonl_turns(file)
        data: Any = {"scripts": [{"turns": turns}]}
        implied = 3
        locate = functools.partial(_jsonl_line, turn_lines)
    else:
        data = read_config_file(file, what="script file")
        if isinstance(data, list):
            data, implied = {"scripts": [{"turns": data}]}, 3
        elif isinstance(data, dict) and "turns" in data:
            data, implied = {"scripts": [data]}, 2
        else:
            implied = 0
        locate = functools.partial(_yaml_line, file, implied)
    try:
        return ScriptFile.model_validate(data)
    except pydantic.ValidationError as exc:
        lines = sorted({n for err in exc.errors() if (n := locate(tuple(err["loc"])))})
        where = f"{file}:{lines[0]}" if len(lines) == 1 else str(file)
        if len(lines) > 1:
            where += f": lines {', '.join(map(str, lines))}"
        raise ConfigError(f"{where}: invalid script: {_describe(exc, implied)}") from None


def _describe(exc: pydantic.ValidationError, implied: int) -> str:
    """``describe_errors`` with each location spelled as the file spells it: ``turn N`` in a
    list of turns (YAML or JSONL), ``turns.N`` or ``scripts.N.turns.M`` in a mapping."""
    parts = []
    for err in exc.errors():
        path = tuple(err["loc"])[implied:]
        if path and isinstance(path[0], int):
            loc = ".".join([f"turn {path[0] + 1}", *map(str, path[1:])])
        else:
            loc = ".".join(map(str, path))
        message = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        got = "" if isinstance(value, dict) else f" (got {short_repr(value)})"
        parts.append(f"{loc}: {message}{got}" if loc else f"{message}{got}")
    return "; ".join(parts)


def _read_jsonl_turns(file: Path) -> tuple[list[str], list[int]]:
    """The turns of a JSONL script and the line of each."""
    turns: list[str] = []
    lines: list[int] = []
    for lineno, line in enumerate(decode_utf8(file.read_bytes(), str(file)).splitlines(), 1):
        if not line.strip():
            continue
        item = load_json(line, f"{file}:{lineno}")
        if isinstance(item, dict) and set(item) == {"text"}:
            item = item["text"]
        if not isinstance(item, str):
            raise ConfigError(
                f'{file}:{lineno}: expected a turn (a JSON string or {{"text": ...}}), '
                f"got {line.strip()[:80]}"
            )
        turns.append(item)
        lines.append(lineno)
    return turns, lines


def _jsonl_line(turn_lines: list[int], loc: tuple[Any, ...]) -> int | None:
    """The line of the turn a ``ScriptFile`` error location (``scripts.0.turns.N``) names."""
    index = loc[3] if len(loc) > 3 else None
    return turn_lines[index] if isinstance(index, int) else None


def _yaml_line(file: Path, implied: int, loc: tuple[Any, ...]) -> int | None:
    """The line of the value a ``ScriptFile`` error location names in a YAML file, or of the
    nearest value above it that the file has. ``implied``: how many leading parts of the
    location the file does not spell (its short forms: a list of turns, ``{turns: ...}``)."""
    import yaml

    try:  # the file parsed already: this only finds where its values are
        node = yaml.compose(file.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    for key in loc[implied:]:
        if isinstance(node, yaml.SequenceNode) and isinstance(key, int):
            if not 0 <= key < len(node.value):
                break
            node = node.value[key]
        elif isinstance(node, yaml.MappingNode):
            values = [v for k, v in node.value if getattr(k, "value", None) == key]
            if not values:
                break
            node = values[0]
        else:
            break
    return None if node is None else int(node.start_mark.line) + 1


class _Trajectory:
    """Where one trajectory is in its script."""

    __slots__ = ("script", "turn")

    def __init__(self, script: Script) -> None:
        self.script = script
        self.turn = 0


class ScriptedEngine:
    """An ``Engine`` whose every trajectory replays a script (see the module docs).

    ``tokenizer``: the model's (its ids are what the engine returns); ``end_of_turn``: the token
    that closes an assistant turn (default: the chat template's, e.g. ``<|im_end|>``).
    Trajectories are told apart by session when the caller opens one (the runtime does), else by
    their context: a call whose context extends an earlier answer continues that trajectory."""

    synthetic_logprobs = True
    """What this engine returns as logprobs is not a model's (the runtime marks its
    trajectories)."""

    def __init__(
        self,
        tokenizer: Any,
        script: ScriptFile | Sequence[str],
        *,
        max_context: int = 8192,
        end_of_turn: int | None = None,
    ) -> None:
        if not isinstance(script, ScriptFile):
            script = ScriptFile(scripts=[Script(turns=list(script))])
        self.tokenizer = tokenizer
        self.script = script
        self._max_context = max_context
        self._end_of_turn = _end_of_turn(tokenizer) if end_of_turn is None else end_of_turn
        self._weight_version = 0
        self._ids = itertools.count()
        self._sessions: dict[str, _Trajectory | None] = {}
        self._answers: dict[int, dict[tuple[int, ...], _Trajectory]] = {}
        self._closed = False

    @classmethod
    def from_file(
        cls, path: str | Path, model: str | Path, *, max_context: int | None = None
    ) -> ScriptedEngine:
        """The engine for a script file and a model (registered name or HF folder): the model's
        tokenizer and context window; its weights are never loaded."""
        from transformers import AutoConfig, AutoTokenizer

        from agentrl._models import resolve_model

        script = read_script(path)
        folder = resolve_model(model)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if max_context is None:
            config = AutoConfig.from_pretrained(folder)
            max_context = int(getattr(config, "max_position_embeddings", 8192))
        return cls(tokenizer, script, max_context=max_context)

    # -- the Engine protocol ------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def max_context(self) -> int:
        return self._max_context

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> GenerateResult:
        if self._closed:
            raise EngineError("the scripted engine is closed")
        if len(input_ids) >= self._max_context:
            raise EngineError(
                f"context of {len(input_ids)} tokens leaves no room (max_context "
                f"{self._max_context})"
            )
        state = self._trajectory(input_ids, session)
        turns = state.script.turns
        if state.turn >= len(turns):
            raise EngineError(
                f"the script has {len(turns)} turn(s); this trajectory asks for turn "
                f"{state.turn + 1} (its last turn ended with a tool call or the env replied)"
            )
        text = turns[state.turn]
        state.turn += 1
        room = min(sampling.max_new_tokens, self._max_context - len(input_ids))
        ids, finish, matched = self._emit(text, sampling, room)
        if session is None:  # the next call of this trajectory will extend this answer
            self._answers.setdefault(len(input_ids) + len(ids), {})[(*input_ids, *ids)] = state
        return GenerateResult(
            token_ids=ids,
            logprobs=[SYNTHETIC_LOGPROB] * len(ids),
            finish_reason=finish,
            matched_stop=matched,
            prompt_tokens=len(input_ids),
            weight_version=self._weight_version,
        )

    async def open_session(self, capacity_tokens: int | None = None) -> str:
        session = f"scripted-{next(self._ids)}"
        self._sessions[session] = None
        return session

    async def close_session(self, session_id: str) -> None:
        if self._sessions.pop(session_id, False) is False:
            raise EngineError(f"unknown session {session_id!r}")

    async def update_weights(self, version: int, source: str | dict[str, torch.Tensor]) -> None:
        self._weight_version = version  # there are no weights: only the version moves

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> ScriptedEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals ----------------------------------------------------------------------------

    def _trajectory(self, input_ids: list[int], session: str | None) -> _Trajectory:
        if session is not None:
            if session not in self._sessions:
                raise EngineError(f"unknown session {session!r}")
            state = self._sessions[session]
            if state is None:
                state = self._sessions[session] = self._start(input_ids)
            return state
        for length in sorted(self._answers, reverse=True):  # the longest earlier answer
            if length <= len(input_ids):
                found = self._answers[length].get(tuple(input_ids[:length]))
                if found is not None:
                    return _copy(found)
        return self._start(input_ids)

    def _start(self, input_ids: list[int]) -> _Trajectory:
        prompt = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        fallback = None
        for script in self.script.scripts:
            if script.match is None:
                fallback = fallback or script
            elif script.match in prompt:
                return _Trajectory(script)
        if fallback is None:
            wanted = ", ".join(repr(s.match) for s in self.script.scripts)
            raise EngineError(f"no script matches this prompt (matches: {wanted})")
        return _Trajectory(fallback)

    def _emit(
        self, text: str, sampling: SamplingParams, room: int
    ) -> tuple[list[int], str, int | str | None]:
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self._end_of_turn is not None and (not ids or ids[-1] not in sampling.stop_token_ids):
            ids.append(self._end_of_turn)  # a chat model ends its turn with this token
        out: list[int] = []
        for token in ids:
            if len(out) >= room:
                return out, "length", None
            out.append(token)
            if token in sampling.stop_token_ids:
                return out, "stop", token
            if sampling.stop:
                decoded = self.tokenizer.decode(out, skip_special_tokens=False)
                hit = next((s for s in sampling.stop if s in decoded), None)
                if hit is not None:
                    return out, "stop", hit
        return out, "stop", None


def _copy(state: _Trajectory) -> _Trajectory:
    """Trajectories that answered alike so far (a group's samples) share a context, not a
    future: each continues from its own copy."""
    copy = _Trajectory(state.script)
    copy.turn = state.turn
    return copy


def _end_of_turn(tokenizer: Any) -> int | None:
    """The first token of the chat template's text after an assistant message (``<|im_end|>``
    in ChatML), or the tokenizer's EOS."""
    from agentrl.formats import get_format

    try:
        fmt = get_format("chatml-hermes", tokenizer)
        ids = fmt.encode(fmt.turn_close_text)
    except Exception:
        ids = []
    if ids:
        return int(ids[0])
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if isinstance(eos, int) else None
