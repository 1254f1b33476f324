"""Tools: typed Python functions the model may call.

``@agentrl.tool`` turns a function or method with annotated parameters into a ``ToolSpec`` whose
JSON schema comes from pydantic. At rollout time ``invoke_tool`` validates the model's argument
text and runs the tool under a deadline. Nothing a model writes can raise out of here: a bad call
becomes a ``ToolCallRecord`` with ``ok=False`` and a clear observation for the model.

Every call has a deadline: the tool's own ``timeout_s``, else its environment's
``tool_timeout_s`` attribute, else the caller's default (``RolloutConfig.tool_timeout_s``). An
async tool past its deadline is cancelled. A sync tool runs in a daemon thread, which Python
cannot stop: past its deadline the call is recorded as ``tool_timeout`` and the thread is left
to finish on its own (it never keeps the process from exiting).
"""

from __future__ import annotations

import contextvars
import inspect
import json
import numbers
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pydantic

from ._errors import ToolError
from ._types import ToolCallRecord

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
    fn: Callable[..., Any], name: str | None, description: str | None, timeout_s: float | None
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
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolError(f"tool {tool_name!r}: *args/**kwargs are not allowed ({p.name})")
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
    )


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Mark a (sync or async) function or method as a tool. Usable bare or with options."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, TOOL_ATTR, _build_spec(f, name, description, timeout_s))
        return f

    return decorate(fn) if fn is not None else decorate


def tool_spec(obj: Any) -> ToolSpec:
    spec = getattr(obj, TOOL_ATTR, None)
    if not isinstance(spec, ToolSpec):
        raise ToolError(f"{obj!r} is not decorated with @agentrl.tool")
    return spec


def collect_tools(env: Any) -> dict[str, BoundTool]:
    """Tools of an environment instance: decorated methods plus anything in ``env.tools``."""
    found: dict[str, BoundTool] = {}
    for attr in dir(type(env)):
        raw = inspect.getattr_static(type(env), attr, None)
        raw = getattr(raw, "__func__", raw)
        spec = getattr(raw, TOOL_ATTR, None)
        if isinstance(spec, ToolSpec):
            found[spec.name] = BoundTool(spec, getattr(env, attr))
    for item in getattr(env, "tools", None) or ():
        spec = tool_spec(item)
        if spec.name in found:
            raise ToolError(f"tool name {spec.name!r} is defined twice on {type(env).__name__}")
        found[spec.name] = BoundTool(spec, item)
    return found


def env_tool_timeout(env: Any) -> float | None:
    """The environment's default tool deadline (its ``tool_timeout_s`` attribute), if any."""
    value = getattr(env, "tool_timeout_s", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ToolError(f"{type(env).__name__}.tool_timeout_s must be a number > 0, got {value!r}")
    return float(value)


async def _run_in_daemon_thread(
    fn: Callable[[], Any], limiter: anyio.CapacityLimiter | None, name: str
) -> Any:
    """``fn()`` in a new daemon thread, at most ``limiter``'s capacity at once. Cancelling the
    caller abandons the thread (its slot is released; it runs on and never blocks exit: anyio's
    own worker threads are not daemons, so a tool that never returns would hang the process at
    exit on asyncio)."""
    limiter = limiter or anyio.to_thread.current_default_thread_limiter()
    async with limiter:
        done = anyio.Event()
        outcome: dict[str, Any] = {}
        token = anyio.lowlevel.current_token()
        context = contextvars.copy_context()

        def target() -> None:
            try:
                outcome["value"] = context.run(fn)
            except BaseException as exc:  # delivered to the caller (SystemExit included)
                outcome["error"] = exc
            try:
                anyio.from_thread.run_sync(done.set, token=token)
            except Exception:  # the event loop is gone: nobody waits for this call any more
                pass

        threading.Thread(target=target, name=f"agentrl tool {name}", daemon=True).start()
        await done.wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


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
            parts.append(f"argument '{loc}': {err['msg']} (got {err.get('input')!r})")
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
) -> ToolCallRecord:
    """Validate and run one call. Never raises for anything the model wrote.

    The deadline is the tool's own ``timeout_s``, else ``timeout_s``, else 10 s. Sync tools run
    in a daemon thread under ``limiter`` (anyio's default limiter, 40 threads, when None); past
    the deadline the thread is abandoned, not killed (Python cannot stop a thread)."""
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
    value: Any = None
    try:
        # move_on_after, not fail_after: a TimeoutError the tool raises itself is its own error
        with anyio.move_on_after(deadline) as scope:
            if bound.spec.is_async:
                value = await bound.call(**kwargs)
            else:
                value = await _run_in_daemon_thread(lambda: bound.call(**kwargs), limiter, name)
    except (Exception, SystemExit) as exc:
        return fail("tool_exception", f"{type(exc).__name__}: {exc}")
    if scope.cancelled_caught:
        return fail("tool_timeout", f"tool {name!r} did not finish within {deadline:g} s")
    return ToolCallRecord(
        turn=turn,
        name=name,
        arguments=raw,
        ok=True,
        output=_observation_text(value),
        latency_s=time.perf_counter() - started,
    )
