"""Tools: typed Python functions the model may call.

``@agentrl.tool`` turns a function or method with annotated parameters into a ``ToolSpec`` whose
JSON schema comes from pydantic. At rollout time ``invoke_tool`` validates the model's argument
text and runs the tool under a deadline. Nothing a model writes can raise out of here: a bad call
becomes a ``ToolCallRecord`` with ``ok=False`` and a clear observation for the model.

Every call has a deadline: the tool's own ``timeout_s``, else its environment's
``tool_timeout_s`` attribute, else the caller's default (``RolloutConfig.tool_timeout_s``). The
deadline measures the tool's own running time, never a wait for a free thread or worker. Where
a tool runs (``isolation``):

- async tools run on the event loop and are cancelled at their deadline (so they must never
  block: a blocking async tool freezes every trajectory and cannot be cancelled);
- sync tools (``isolation="thread"``, the default) run in a daemon thread, which Python cannot
  stop: past its deadline the call is ``tool_timeout``, the thread is abandoned (it gives its
  slot back at once, runs on, and never keeps the process from exiting) and counted; past
  ``max_abandoned`` abandoned threads still running, new calls raise ``ToolError`` (the
  trajectory fails loudly instead of every later call timing out);
- ``isolation="process"`` tools (module-level sync functions) run in a worker process that is
  killed at the deadline (``_tool_process.py``): for code that may hold the GIL or never end.

Whatever a tool raises is its own failure, recorded as ``tool_exception``: ``BaseException``s
too (``SystemExit``, anything a sync tool raises in its thread, an ``asyncio.CancelledError``
an async tool raised while nobody cancelled its caller). Three propagate out of an async tool:
a cancellation of the calling task (a trajectory deadline, a failing sibling), a
``KeyboardInterrupt`` (it runs in the main thread, where a user's Ctrl-C lands), and
``GeneratorExit`` (the calling coroutine is being closed: it must not go on).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_type_hints

import anyio
import pydantic

from ._config import short_repr
from ._config_file import unreadable_json
from ._errors import ToolError
from ._threads import ThreadTimeout, TooManyAbandonedThreads, run_in_daemon_thread
from ._tool_process import (
    ToolException,
    ToolProcesses,
    WorkerFailed,
    WorkerTimeout,
    open_tool_processes,
)
from ._types import ToolCallRecord

Isolation = Literal["thread", "process"]

TOOL_ATTR = "__agentrl_tool__"
DEFAULT_TOOL_TIMEOUT_S = 10.0
DEFAULT_MAX_ARGUMENT_BYTES = 16_384
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True)
class ToolSpec:
    """A tool's contract: what the model is told (name, description, parameters) and how to
    run it. ``fn`` is unbound for methods; ``bind`` attaches an instance."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema (object) of the arguments."""
    fn: Callable[..., Any]
    args_model: type[pydantic.BaseModel]
    is_async: bool
    timeout_s: float | None
    is_method: bool
    isolation: Isolation = "thread"
    """Where a sync tool runs: a daemon thread, or a worker process killed at the deadline."""

    def schema(self) -> dict[str, Any]:
        """OpenAI/Hermes-style function schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class BoundTool:
    spec: ToolSpec
    call: Callable[..., Any]


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """First paragraph as the description; Google-style ``Args:`` lines as parameter docs."""
    doc = inspect.cleandoc(doc or "")
    parts = doc.split("\n\n")
    description = " ".join(parts[0].split()) if parts and parts[0] else ""
    params: dict[str, str] = {}
    in_args = False
    current = None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            if not stripped:
                continue
            m = re.match(r"^(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", stripped)
            if m and line.startswith((" ", "\t")) is not False:
                current = m[1]
                params[current] = m[2]
            elif stripped.endswith(":") and not line.startswith((" ", "\t")):
                in_args = False
            elif current:
                params[current] += " " + stripped
    return description, params


def _build_spec(
    fn: Callable[..., Any],
    name: str | None,
    description: str | None,
    timeout_s: float | None,
    isolation: Isolation = "thread",
) -> ToolSpec:
    tool_name = name or fn.__name__
    if not _NAME_RE.match(tool_name):
        raise ToolError(f"tool name {tool_name!r} must match {_NAME_RE.pattern}")
    if timeout_s is not None and timeout_s <= 0:
        raise ToolError(f"tool {tool_name!r}: timeout_s must be > 0, got {timeout_s}")
    sig = inspect.signature(fn)
    try:
        hints = get_type_hints(fn)
    except Exception as exc:
        raise ToolError(f"tool {tool_name!r}: cannot resolve annotations: {exc}") from exc
    doc_description, param_docs = _parse_docstring(fn.__doc__ or "")
    fields: dict[str, Any] = {}
    params = list(sig.parameters.values())
    is_method = bool(params) and params[0].name in ("self", "cls")
    if is_method:
        params = params[1:]
    _check_isolation(fn, tool_name, isolation, is_method)
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolError(f"tool {tool_name!r}: *args/**kwargs are not allowed ({p.name})")
        if p.kind == p.POSITIONAL_ONLY:
            raise ToolError(
                f"tool {tool_name!r}: positional-only parameters are not allowed ({p.name}): "
                "a tool is called with the model's arguments by name"
            )
        if p.name not in hints:
            raise ToolError(f"tool {tool_name!r}: parameter {p.name!r} needs a type annotation")
        default = ... if p.default is p.empty else p.default
        fields[p.name] = (
            hints[p.name],
            pydantic.Field(default, description=param_docs.get(p.name)),
        )
    try:
        args_model = pydantic.create_model(
            f"{tool_name}_args",
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
        parameters = args_model.model_json_schema()
    except Exception as exc:
        raise ToolError(f"tool {tool_name!r}: cannot build an argument schema: {exc}") from exc
    for p in params:
        if p.default is not p.empty:
            _check_default(tool_name, p.name, hints[p.name], p.default)
    parameters.pop("title", None)
    for prop in parameters.get("properties", {}).values():
        prop.pop("title", None)
    return ToolSpec(
        name=tool_name,
        description=description or doc_description or tool_name,
        parameters=parameters,
        fn=fn,
        args_model=args_model,
        is_async=inspect.iscoroutinefunction(fn),
        timeout_s=timeout_s,
        is_method=is_method,
        isolation=isolation,
    )


def _check_default(tool_name: str, param: str, annotation: Any, default: Any) -> None:
    """A default is what the tool receives when the model leaves the argument out: it must be a
    value of the parameter's type, validated as the model's arguments are (so ``Path = "."`` or
    ``float = 1`` pass, ``int = "x"`` does not)."""
    try:
        pydantic.TypeAdapter(annotation).validate_python(default)
    except pydantic.ValidationError as exc:
        reason = "; ".join(err["msg"] for err in exc.errors())
        raise ToolError(
            f"tool {tool_name!r}: the default of parameter {param!r} does not match its "
            f"annotation: {reason} (got {short_repr(default)})"
        ) from None
    except Exception as exc:
        raise ToolError(
            f"tool {tool_name!r}: cannot check the default of parameter {param!r}: {exc}"
        ) from exc


def _check_isolation(fn: Callable[..., Any], name: str, isolation: Any, is_method: bool) -> None:
    if isolation not in ("thread", "process"):
        raise ToolError(
            f"tool {name!r}: isolation must be 'thread' or 'process', got {short_repr(isolation)}"
        )
    if isolation != "process":
        return
    if inspect.iscoroutinefunction(fn):
        raise ToolError(
            f"tool {name!r}: isolation='process' is for sync functions (an async tool runs on "
            "the event loop and is cancelled at its deadline)"
        )
    if is_method or "<locals>" in fn.__qualname__:
        raise ToolError(
            f"tool {name!r}: isolation='process' needs a module-level function (it is pickled "
            "by name into a worker process; a method's instance or a closure cannot follow it)"
        )


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    isolation: Literal["thread", "process"] = "thread",
) -> Any:
    """Mark a (sync or async) function or method as a tool. Usable bare or with options:
    ``timeout_s`` (its own deadline), ``isolation="process"`` (a module-level sync function run
    in a worker process that is killed at the deadline; arguments and result are pickled)."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, TOOL_ATTR, _build_spec(f, name, description, timeout_s, isolation))
        return f

    return decorate(fn) if fn is not None else decorate


def tool_spec(obj: Any) -> ToolSpec:
    spec = getattr(obj, TOOL_ATTR, None)
    if not isinstance(spec, ToolSpec):
        raise ToolError(f"{obj!r} is not decorated with @agentrl.tool")
    return spec


def collect_tools(env: Any) -> dict[str, BoundTool]:
    """Tools of an environment instance: decorated methods plus anything in ``env.tools``."""
    cls = type(env).__name__
    found: dict[str, BoundTool] = {}
    where: dict[str, str] = {}

    def add(spec: ToolSpec, call: Callable[..., Any], defined_by: str) -> None:
        if spec.name in found:
            if found[spec.name].spec is spec:  # one function under two attribute names
                return
            raise ToolError(
                f"tool name {spec.name!r} is defined twice on {cls}: by {where[spec.name]} and "
                f"by {defined_by} (give one of them another name=)"
            )
        found[spec.name] = BoundTool(spec, call)
        where[spec.name] = defined_by

    for attr in dir(type(env)):
        raw = inspect.getattr_static(type(env), attr, None)
        raw = getattr(raw, "__func__", raw)
        spec = getattr(raw, TOOL_ATTR, None)
        if isinstance(spec, ToolSpec):
            add(spec, getattr(env, attr), f"method {attr!r}")
    for item in getattr(env, "tools", None) or ():
        spec = tool_spec(item)
        add(spec, item, f"{getattr(item, '__qualname__', spec.name)!r} in {cls}.tools")
    return found


def env_tool_timeout(env: Any) -> float | None:
    """The environment's default tool deadline (its ``tool_timeout_s`` attribute), if any."""
    value = getattr(env, "tool_timeout_s", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ToolError(
            f"{type(env).__name__}.tool_timeout_s must be a number > 0, got {short_repr(value)}"
        )
    return float(value)


def _describe_exception(exc: BaseException) -> str:
    """``Type: message`` of what a tool raised, even when its ``str()`` fails too."""
    try:
        message = str(exc)
    except Exception as error:
        message = f"<str() of the exception raised {type(error).__name__}>"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _observation_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _validation_message(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(arguments)"
        if err["type"] == "extra_forbidden":
            parts.append(f"unexpected argument '{loc}'")
        elif err["type"] == "missing":
            parts.append(f"missing required argument '{loc}'")
        else:
            parts.append(f"argument '{loc}': {err['msg']} (got {short_repr(err.get('input'))})")
    return "; ".join(parts)


async def invoke_tool(
    tools: dict[str, BoundTool],
    name: str,
    arguments: str | dict[str, Any],
    *,
    turn: int,
    timeout_s: float | None = None,
    max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
    limiter: anyio.CapacityLimiter | None = None,
    max_abandoned: int | None = None,
    processes: ToolProcesses | None = None,
) -> ToolCallRecord:
    """Validate and run one call. Never raises for anything the model wrote; raises
    ``ToolError`` when ``max_abandoned`` abandoned tool threads still run (the process is
    degraded: that is the runtime's failure, not the model's).

    The deadline is the tool's own ``timeout_s``, else ``timeout_s``, else 10 s, and counts the
    tool's running time only. Sync tools run in a daemon thread under ``limiter`` (anyio's
    default limiter, 40 threads, when None); past the deadline the thread is abandoned, not
    killed (Python cannot stop a thread). ``isolation="process"`` tools run in ``processes``
    (a one-call pool when None); past the deadline their worker is killed."""
    started = time.perf_counter()
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)

    def fail(kind: str, message: str) -> ToolCallRecord:
        return ToolCallRecord(
            turn=turn,
            name=name,
            arguments=raw,
            ok=False,
            output=f"Error ({kind}): {message}",
            error_kind=kind,
            latency_s=time.perf_counter() - started,
        )

    bound = tools.get(name)
    if bound is None:
        available = ", ".join(sorted(tools)) or "none"
        return fail("unknown_tool", f"no tool named {name!r}; available tools: {available}")
    if len(raw.encode()) > max_argument_bytes:
        return fail(
            "oversize_arguments",
            f"arguments are {len(raw.encode())} bytes; the limit is {max_argument_bytes}",
        )
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return fail("invalid_arguments", f"arguments are not valid JSON: {exc.msg}")
        except (ValueError, RecursionError) as exc:  # too deep, or a number too long to read
            return fail("invalid_arguments", f"arguments cannot be read: {unreadable_json(exc)}")
    else:
        parsed = arguments
    if not isinstance(parsed, dict):
        return fail(
            "invalid_arguments",
            f"arguments must be a JSON object, got {type(parsed).__name__}",
        )
    try:
        validated = bound.spec.args_model.model_validate(parsed)
    except pydantic.ValidationError as exc:
        return fail("invalid_arguments", _validation_message(exc))
    kwargs = {k: getattr(validated, k) for k in type(validated).model_fields}
    deadline = bound.spec.timeout_s or timeout_s or DEFAULT_TOOL_TIMEOUT_S
    try:
        value = await _run(bound, kwargs, deadline, limiter, max_abandoned, processes)
    except _Timeout as exc:
        return fail("tool_timeout", f"tool {name!r} did not finish within {deadline:g} s{exc.note}")
    except TooManyAbandonedThreads as exc:
        raise ToolError(str(exc)) from None
    except WorkerFailed as exc:
        return fail("tool_exception", _describe_exception(exc))
    except ToolException as exc:
        return fail("tool_exception", str(exc))
    except _RaisedInThread as exc:
        return fail("tool_exception", _describe_exception(exc.raised))
    except Exception as exc:
        return fail("tool_exception", _describe_exception(exc))
    except BaseException as exc:
        if _propagates(exc):
            raise
        return fail("tool_exception", _describe_exception(exc))
    try:
        output = _observation_text(value)
    except Exception as exc:  # e.g. a result whose __str__ raises
        return fail(
            "tool_exception",
            f"the result of tool {name!r} cannot be turned into text: {_describe_exception(exc)}",
        )
    return ToolCallRecord(
        turn=turn,
        name=name,
        arguments=raw,
        ok=True,
        output=output,
        latency_s=time.perf_counter() - started,
    )


def _propagates(exc: BaseException) -> bool:
    """Whether a ``BaseException`` out of an async tool is not the tool's own failure: a
    cancellation of the calling task, a ``KeyboardInterrupt`` (the tool runs in the main
    thread, where a user's Ctrl-C lands), or ``GeneratorExit`` (the calling coroutine is being
    closed; one that went on would be a ``RuntimeError``). Anything else (``SystemExit``) is
    recorded."""
    if isinstance(exc, KeyboardInterrupt | GeneratorExit):
        return True
    cancelled = anyio.get_cancelled_exc_class()
    if isinstance(exc, BaseExceptionGroup):
        if exc.subgroup(cancelled) is None:
            return False
    elif not isinstance(exc, cancelled):
        return False  # e.g. an asyncio.CancelledError on trio: an ordinary exception there
    if cancelled is not asyncio.CancelledError:
        return True  # trio.Cancelled has no public constructor: only a cancellation raises it
    # a tool may raise CancelledError itself; it is a cancellation only when one was requested
    task = asyncio.current_task()
    return (task is not None and task.cancelling() > 0) or (
        anyio.current_effective_deadline() == -math.inf  # an enclosing scope is cancelled
    )


class _RaisedInThread(Exception):
    """A sync tool raised a ``BaseException`` in its worker thread: never a cancellation or a
    Ctrl-C of the caller, whatever its type (``KeyboardInterrupt``, ``CancelledError``)."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(raised)
        self.raised = raised


class _Timeout(Exception):
    def __init__(self, note: str = "") -> None:
        self.note = note


async def _run(
    bound: BoundTool,
    kwargs: dict[str, Any],
    deadline: float,
    limiter: anyio.CapacityLimiter | None,
    max_abandoned: int | None,
    processes: ToolProcesses | None,
) -> Any:
    spec = bound.spec
    if spec.is_async:
        # move_on_after, not fail_after: a TimeoutError the tool raises itself is its own error
        with anyio.move_on_after(deadline) as scope:
            value = await bound.call(**kwargs)
        if scope.cancelled_caught:
            raise _Timeout()
        return value
    if spec.isolation == "process":
        try:
            if processes is not None:
                return await processes.call(spec.fn, kwargs, timeout_s=deadline)
            async with open_tool_processes(1) as pool:
                return await pool.call(spec.fn, kwargs, timeout_s=deadline)
        except WorkerTimeout:
            raise _Timeout(" (its worker process was killed)") from None

    def call_in_thread() -> Any:
        try:
            return bound.call(**kwargs)
        except Exception:
            raise
        except BaseException as exc:  # re-raised in the caller it would read as its own
            raise _RaisedInThread(exc) from exc

    try:
        return await run_in_daemon_thread(
            call_in_thread,
            name=f"tool {spec.name}",
            timeout_s=deadline,
            limiter=limiter,
            max_abandoned=max_abandoned,
            cap_setting="rollout.max_abandoned_threads",
        )
    except ThreadTimeout:
        raise _Timeout() from None
