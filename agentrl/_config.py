"""Rollout configuration (pydantic: people write it; every field documented, extras refused)."""

from __future__ import annotations

import difflib
import reprlib
import types
import typing
from typing import Any

import pydantic
import pydantic_core

from ._errors import ConfigError

ROLLOUT_LEGACY_VALUES: dict[str, Any] = {"max_tool_output_chars": None}
"""``RolloutConfig`` fields added after rollouts and runs were made with this package, each with
the value that reproduces them (a recorded configuration that lacks one ran with that value)."""


class NumbersNotBools(pydantic.BaseModel):
    """A base for settings people write: ``true`` where a number is due is refused, naming the
    field (pydantic reads it as 1, so ``tasks_per_step: yes`` trained one task a step)."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        errors = []
        for name, field in cls.model_fields.items():
            key = field.alias or name
            value = data.get(key)
            if isinstance(value, bool) and _numeric(field.annotation):
                errors.append(
                    {
                        "type": pydantic_core.PydanticCustomError(
                            "bool_not_number", "a number is due here, not a boolean"
                        ),
                        "loc": (key,),
                        "input": value,
                    }
                )
        if errors:
            raise pydantic_core.ValidationError.from_exception_data(cls.__name__, errors)
        return data


def _numeric(annotation: Any) -> bool:
    """Whether a field takes numbers only (``int``, ``float``, either or None)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in _UNIONS else ()
    options = options or (annotation,)
    return all(o in (int, float, type(None)) for o in options) and any(
        o in (int, float) for o in options
    )


_UNIONS = (typing.Union, types.UnionType)


class RolloutConfig(NumbersNotBools):
    """How trajectories are generated. ``None`` means "the environment's default"."""

    model_config = pydantic.ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    max_turns: int | None = pydantic.Field(None, ge=1)
    """Assistant turns per trajectory (default: the env spec's ``max_turns``)."""
    max_new_tokens: int | None = pydantic.Field(None, ge=1)
    """Tokens the model may sample per turn (default: the env spec's ``max_new_tokens``)."""
    max_context_tokens: int | None = pydantic.Field(None, ge=16)
    """Total tokens per trajectory (default: the engine's context window)."""
    temperature: float = pydantic.Field(1.0, ge=0.0)
    """Sampling temperature. RL default 1.0: the sampling distribution is the trained one."""
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this (1: off).
    Logprobs are recorded before any filtering."""
    top_k: int = -1
    """Keep the k most likely tokens (-1: off)."""
    min_p: float = pydantic.Field(0.0, ge=0.0, le=1.0)
    """Drop tokens below this fraction of the most likely token's probability (0: off)."""
    seed: int = 0
    """Base seed; each trajectory derives its own from (seed, task id, sample index)."""
    group_size: int = pydantic.Field(1, ge=1)
    """Samples per task (G of the group estimators); a group shares one prompt. Training with a
    group estimator needs >= 2 and defaults to 4 when the config names none."""
    concurrency: int = pydantic.Field(16, ge=1)
    """Trajectories in flight at once, counted until their episode ends: scoring (the env's
    ``reward()``, a sandbox-backed verifier) runs outside this limit, so a slow verifier does
    not keep other trajectories from generating."""
    turn_timeout_s: float = pydantic.Field(300.0, gt=0)
    """Deadline for one generate call. Past it the trajectory ends with ``status="error"``,
    ``where="engine"`` (a stalled or overloaded engine: the turn's answer is unknown, so the
    trajectory is not scored)."""
    tool_timeout_s: float = pydantic.Field(10.0, gt=0)
    """Deadline for one tool call, unless the tool's own ``timeout_s`` or the environment's
    ``tool_timeout_s`` attribute sets one (the tool's wins over the environment's)."""
    trajectory_timeout_s: float = pydantic.Field(1800.0, gt=0)
    """Wall-clock deadline for a whole trajectory (``reward`` and ``close`` run after it, under
    their own deadlines)."""
    env_timeout_s: float = pydantic.Field(60.0, gt=0)
    """Deadline for each call into the environment other than tools and the verifier: ``reset``,
    ``turn_reward``, ``respond``, ``close``. Past it the trajectory ends with ``status="error"``
    and an error whose ``where`` names the call; the rest of the batch goes on."""
    reward_timeout_s: float = pydantic.Field(600.0, gt=0)
    """Deadline for the verifier (``reward``); generous because verifiers that run tests in a
    sandbox can be slow. Past it the trajectory ends with ``status="error"``, ``where="reward"``."""
    tool_error_budget: int = pydantic.Field(3, ge=0)
    """A trajectory ends (``tool_error_budget``) after more failed tool calls than this."""
    max_tool_argument_bytes: int = pydantic.Field(16_384, ge=64)
    """Tool-call argument text above this size is refused (``oversize_arguments``)."""
    max_tool_output_chars: int | None = pydantic.Field(1 << 20, ge=256)
    """A tool result longer than this is cut to its first this-many characters, with a note
    saying so, before it is tokenized or recorded: a tool that returns hundreds of megabytes
    would otherwise hold the event loop while the tokenizer runs, take gigabytes, and write
    itself into ``trajectories.jsonl``. ``null``: no cap (what a training run made before the
    cap existed resumes with)."""
    tool_threads: int = pydantic.Field(8, ge=1)
    """Threads shared by all synchronous tool calls of one rollout (a call past its deadline
    gives its thread's slot back at once; waiting for a slot is not part of any deadline)."""
    max_abandoned_threads: int = pydantic.Field(32, ge=1)
    """Python cannot stop a thread: a sync tool or env hook past its deadline runs on, abandoned.
    While this many abandoned threads of the process still run, new sync calls are refused and
    their trajectories end with an error, instead of threads piling up and starving the rest."""
    tool_processes: int = pydantic.Field(4, ge=1)
    """Worker processes shared by the calls of ``@agentrl.tool(isolation="process")`` tools of
    one rollout (started on first use; a worker past its deadline is killed and replaced)."""
    use_sessions: bool = True
    """Open an engine session per trajectory so KV survives tool waits."""
    env_kwargs: dict[str, Any] = pydantic.Field(default_factory=dict)
    """Keyword arguments for the environment factory (e.g. calc-v0's ``levels``)."""

    @pydantic.model_validator(mode="after")
    def _check_top_k(self) -> RolloutConfig:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        return self


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdict = 6
SHORT_REPR_CHARS = 120
"""The longest value an error message shows (a value past it is cut, its elision marked)."""


def short_repr(value: Any) -> str:
    """``repr(value)`` for an error message: long strings, deep or long containers and huge
    numbers shortened (``'aaa...aaa'``, ``[1, 2, ...]``) without building the whole repr."""
    text = _REPR.repr(value)
    if len(text) > SHORT_REPR_CHARS:
        half = SHORT_REPR_CHARS // 2 - 2
        text = f"{text[:half]}...{text[-half:]}"
    return text


def _model_at(model: type[pydantic.BaseModel], path: tuple[Any, ...]) -> Any:
    """The pydantic model a field path leads to inside ``model`` (None past a union of models,
    a list or a dict)."""
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        options = [field.annotation, *typing.get_args(field.annotation)]
        found = [o for o in options if isinstance(o, type) and issubclass(o, pydantic.BaseModel)]
        if len(found) != 1:
            return None
        model = found[0]
    return model


def _did_you_mean(model: type[pydantic.BaseModel] | None, loc: tuple[Any, ...]) -> str:
    """``; did you mean 'temperature'?`` for an unknown field close to one of its model's."""
    inner = _model_at(model, loc[:-1]) if model is not None and loc else None
    if inner is None or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(inner.model_fields), n=1, cutoff=0.7)
    return f"; did you mean {close[0]!r}?" if close else ""


def describe_errors(
    exc: pydantic.ValidationError,
    where: str = "",
    model: type[pydantic.BaseModel] | None = None,
) -> str:
    """Each error of ``exc`` as ``dotted.field: message (got value)``, ``where`` prefixed; values
    shown shortened (``short_repr``). Given the ``model`` validated, an unknown field close to a
    known one says which."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in (*([where] if where else []), *err["loc"]))
        message = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = isinstance(value, dict) or short_repr(value) in message
        got = "" if shown else f" (got {short_repr(value)})"
        named = not loc or message.startswith(f"{loc} ")  # "device must be ...": named already
        if err["type"] == "extra_forbidden":
            got += _did_you_mean(model, tuple(err["loc"]))
        parts.append(f"{message}{got}" if named else f"{loc}: {message}{got}")
    return "; ".join(parts)


def validate_config(model: type[pydantic.BaseModel], data: Any, *, where: str = "") -> Any:
    """Validate ``data``; raise ConfigError naming each offending field (dotted, under ``where``)
    and value."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError("invalid config: " + describe_errors(exc, where, model)) from None
