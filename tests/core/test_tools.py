"""``@agentrl.tool``: schemas from typed signatures, and ``invoke_tool`` turning every bad call
into an observation for the model (never an exception)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import trio.testing

import agentrl
from agentrl._tools import BoundTool, collect_tools, invoke_tool, tool_spec

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]


@agentrl.tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend,
            which defaults to two.

    Returns:
        The sum.
    """
    return a + b


@agentrl.tool
async def shout(text: str, times: int = 1) -> str:
    """Upper-case text."""
    await anyio.sleep(0)
    return text.upper() * times


@agentrl.tool
def describe(values: list[float], label: str | None = None, exact: bool = False) -> dict:
    """Summarise numbers.

    Args:
        values (list[float]): Numbers to summarise.
        label: Optional name for the result.
        exact: Unused flag.
    """
    return {"label": label, "n": len(values), "total": sum(values)}


@agentrl.tool
def boom(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"boom: {reason}")


@agentrl.tool
def no_args() -> str:
    """Takes nothing."""
    return "ok"


class Counter:
    """An environment-like object with a tool method and a list of function tools."""

    tools = (add,)

    def __init__(self) -> None:
        self.count = 0

    @agentrl.tool(name="bump", description="Increase the counter.")
    def increment(self, by: int) -> int:
        self.count += by
        return self.count

    @agentrl.tool
    async def peek(self) -> str:
        """Read the counter."""
        return f"count={self.count}"

    def not_a_tool(self) -> None:
        return None


def _bound(*fns) -> dict[str, BoundTool]:
    return {tool_spec(f).name: BoundTool(tool_spec(f), f) for f in fns}


# -- decoration and schema -----------------------------------------------------------------------


def test_sync_function_schema():
    spec = tool_spec(add)
    assert (spec.name, spec.is_async, spec.is_method, spec.timeout_s) == ("add", False, False, None)
    assert spec.description == "Add two integers."
    assert spec.parameters == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first addend."},
            "b": {
                "type": "integer",
                "default": 2,
                "description": "The second addend, which defaults to two.",
            },
        },
        "required": ["a"],
        "additionalProperties": False,
    }
    assert spec.schema() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": spec.parameters,
        },
    }
    json.dumps(spec.schema())
    assert add(1) == 3  # the decorated function is still the function


def test_types_optional_and_list_schema():
    params = tool_spec(describe).parameters
    props = params["properties"]
    assert props["values"]["type"] == "array" and props["values"]["items"] == {"type": "number"}
    assert props["values"]["description"] == "Numbers to summarise."
    assert {"type": "string"} in props["label"]["anyOf"] and props["label"]["default"] is None
    assert props["exact"] == {"type": "boolean", "default": False, "description": "Unused flag."}
    assert params["required"] == ["values"]
    assert params["additionalProperties"] is False
    assert all("title" not in p for p in props.values()) and "title" not in params


def test_async_function_and_no_docstring_args():
    spec = tool_spec(shout)
    assert spec.is_async and not spec.is_method
    assert spec.description == "Upper-case text."
    assert "description" not in spec.parameters["properties"]["text"]
    assert spec.parameters["properties"]["text"] == {"type": "string"}


def test_methods_and_options():
    bump = tool_spec(Counter.increment)
    assert bump.name == "bump" and bump.description == "Increase the counter."
    assert bump.is_method and list(bump.parameters["properties"]) == ["by"]  # no self
    peek = tool_spec(Counter.peek)
    assert peek.is_method and peek.is_async and peek.parameters["properties"] == {}


def test_description_falls_back_to_the_name():
    @agentrl.tool(timeout_s=3)
    def quiet(x: int) -> int:
        return x

    spec = tool_spec(quiet)
    assert spec.description == "quiet" and spec.timeout_s == 3


def test_collect_tools_binds_methods_and_lists():
    env = Counter()
    tools = collect_tools(env)
    assert sorted(tools) == ["add", "bump", "peek"]
    assert tools["bump"].call(by=2) == 2 and env.count == 2  # bound to this instance
    assert tools["add"].call(a=1) == 3


def test_collect_tools_rejects_duplicate_names():
    @agentrl.tool(name="bump")
    def other_bump(by: int) -> int:
        return by

    class Twice(Counter):
        tools = (other_bump,)

    with pytest.raises(agentrl.ToolError, match="'bump' is defined twice"):
        collect_tools(Twice())


def test_collect_tools_rejects_two_methods_with_one_name():
    class Shouty:
        @agentrl.tool
        def shout(self, text: str) -> str:
            """Upper-case text."""
            return text.upper()

        @agentrl.tool(name="shout")
        def other(self, text: str) -> str:
            """Lower-case text."""
            return text.lower()

    with pytest.raises(
        agentrl.ToolError,
        match="tool name 'shout' is defined twice on Shouty: by method 'other' and by method "
        "'shout'",
    ):
        collect_tools(Shouty())


def test_collect_tools_names_a_method_and_a_tools_entry_of_one_name():
    @agentrl.tool(name="bump")
    def other_bump(by: int) -> int:
        return by

    class Twice(Counter):
        tools = (other_bump,)

    with pytest.raises(
        agentrl.ToolError,
        match=r"by method 'increment' and by '.*other_bump' in Twice\.tools",
    ):
        collect_tools(Twice())


def test_one_tool_under_two_attribute_names_is_one_tool():
    class Aliased(Counter):
        bump_alias = Counter.increment

    env = Aliased()
    tools = collect_tools(env)
    assert sorted(tools) == ["add", "bump", "peek"]
    assert tools["bump"].call(by=3) == 3 and env.count == 3


def test_tool_spec_of_an_undecorated_function():
    with pytest.raises(agentrl.ToolError, match="not decorated"):
        tool_spec(len)


def _missing_annotation(x):
    return x


def _star_args(x: int, *rest: int):
    return x


def _star_kwargs(x: int, **rest: int):
    return x


def _unresolvable(x: NoSuchType):  # noqa: F821 - the point of the test
    return x


def _plain(x: int) -> int:
    return x


def _positional_only(x: int, /) -> int:
    return x


class _PositionalOnlyMethod:
    def count(self, text: str, /, times: int = 1) -> int:
        return len(text) * times


def _str_default(n: int = "x") -> int:  # type: ignore[assignment]
    return n


def _float_default_for_int(n: int = 2.5) -> int:  # type: ignore[assignment]
    return n


def _wrong_list_default(values: list[int] = ["a"]) -> int:  # noqa: B006
    return len(values)


def _none_default_not_optional(label: str = None) -> str:  # type: ignore[assignment]
    return label


@pytest.mark.parametrize(
    ("fn", "options", "match"),
    [
        (_missing_annotation, {}, "parameter 'x' needs a type annotation"),
        (_star_args, {}, r"\*args/\*\*kwargs are not allowed \(rest\)"),
        (_star_kwargs, {}, r"\*args/\*\*kwargs are not allowed \(rest\)"),
        (_unresolvable, {}, "cannot resolve annotations"),
        (_plain, {"name": "bad name"}, "must match"),
        (_plain, {"name": "1abc"}, "must match"),
        (_plain, {"name": "x" * 65}, "must match"),
        (_plain, {"timeout_s": 0}, "timeout_s must be > 0"),
        (_plain, {"timeout_s": -1}, "timeout_s must be > 0"),
        (_positional_only, {}, r"positional-only parameters are not allowed \(x\)"),
        (
            _PositionalOnlyMethod.count,
            {},
            r"'count': positional-only parameters are not allowed \(text\)",
        ),
        (_str_default, {}, r"default of parameter 'n' does not match .*\(got 'x'\)"),
        (_float_default_for_int, {}, r"default of parameter 'n' does not match .*\(got 2\.5\)"),
        (_wrong_list_default, {}, r"default of parameter 'values' does not match"),
        (_none_default_not_optional, {}, r"default of parameter 'label' does not match"),
    ],
)
def test_decoration_errors(fn, options, match):
    with pytest.raises(agentrl.ToolError, match=match):
        agentrl.tool(fn, **options)
    with pytest.raises(agentrl.ToolError):
        tool_spec(fn)  # nothing was attached


def test_defaults_of_the_annotated_type_are_accepted():
    @agentrl.tool
    def options(
        ratio: float = 1,
        label: str | None = None,
        mode: Literal["fast", "slow"] = "fast",
        values: tuple[int, ...] = (),
        flag: bool = False,
    ) -> str:
        """Every default here is a value of its parameter's type."""
        return mode

    props = tool_spec(options).parameters["properties"]
    assert [props[k]["default"] for k in props] == [1, None, "fast", [], False]


def test_a_lambda_is_not_a_valid_tool_name():
    with pytest.raises(agentrl.ToolError, match="'<lambda>' must match"):
        agentrl.tool(lambda: None)


# -- invoke_tool ---------------------------------------------------------------------------------


async def test_success_with_non_str_result():
    record = await invoke_tool(_bound(add), "add", '{"a": 40}', turn=3)
    assert record.ok and record.error_kind is None
    assert record.output == "42" and record.turn == 3 and record.name == "add"
    assert record.arguments == '{"a": 40}'
    assert record.latency_s >= 0


async def test_success_dict_result_is_json_text():
    record = await invoke_tool(_bound(describe), "describe", '{"values": [1, 2.5]}', turn=0)
    assert record.ok
    assert json.loads(record.output) == {"label": None, "n": 2, "total": 3.5}


async def test_success_str_result_is_verbatim():
    record = await invoke_tool(_bound(shout), "shout", '{"text": "hi", "times": 2}', turn=0)
    assert record.ok and record.output == "HIHI"  # not JSON-quoted


async def test_dict_arguments_and_empty_argument_text():
    record = await invoke_tool(_bound(add), "add", {"a": 1, "b": 5}, turn=0)
    assert record.ok and record.output == "6" and json.loads(record.arguments) == {"a": 1, "b": 5}
    record = await invoke_tool(_bound(no_args), "no_args", "  ", turn=0)
    assert record.ok and record.output == "ok"


async def test_method_tools_run_on_their_instance():
    env = Counter()
    tools = collect_tools(env)
    record = await invoke_tool(tools, "bump", '{"by": 5}', turn=0)
    assert record.ok and record.output == "5" and env.count == 5
    record = await invoke_tool(tools, "peek", "{}", turn=0)
    assert record.ok and record.output == "count=5"


async def test_sync_tools_run_in_a_worker_thread():
    seen = []

    @agentrl.tool
    def where() -> str:
        """Report the thread."""
        seen.append(threading.get_ident())
        return "ok"

    record = await invoke_tool(_bound(where), "where", "{}", turn=0)
    assert record.ok and seen and seen[0] != threading.get_ident()


async def test_a_tool_raising_timeout_error_is_a_tool_exception():
    @agentrl.tool
    async def fetch() -> str:
        """A tool whose own I/O times out quickly."""
        raise TimeoutError("upstream did not answer")

    record = await invoke_tool(_bound(fetch), "fetch", "{}", turn=0, timeout_s=60)
    assert record.error_kind == "tool_exception"
    assert record.output == "Error (tool_exception): TimeoutError: upstream did not answer"


@pytest.mark.parametrize(
    ("name", "arguments", "kind", "message"),
    [
        ("nope", "{}", "unknown_tool", "no tool named 'nope'; available tools: add, boom, shout"),
        ("add", '{"a": 1', "invalid_arguments", "arguments are not valid JSON"),
        ("add", "[1, 2]", "invalid_arguments", "arguments must be a JSON object, got list"),
        ("add", '"a"', "invalid_arguments", "arguments must be a JSON object, got str"),
        ("add", '{"b": 1}', "invalid_arguments", "missing required argument 'a'"),
        ("add", '{"a": 1, "c": 2}', "invalid_arguments", "unexpected argument 'c'"),
        ("add", '{"a": "one"}', "invalid_arguments", "argument 'a': "),
        ("add", '{"a": [1]}', "invalid_arguments", "(got [1])"),
        ("shout", '{"text": 5}', "invalid_arguments", "argument 'text': "),
        ("boom", '{"reason": "bad"}', "tool_exception", "ValueError: boom: bad"),
        ("add", "[" * 1100 + "]" * 1100, "invalid_arguments", "cannot be read: nested too deeply"),
        ("add", '{"a": ' + "9" * 4301 + "}", "invalid_arguments", "cannot be read: Exceeds the"),
    ],
)
async def test_failures_become_observations(name, arguments, kind, message):
    record = await invoke_tool(_bound(add, shout, boom), name, arguments, turn=1)
    assert not record.ok
    assert record.error_kind == kind
    assert record.output.startswith(f"Error ({kind}): ")
    assert message in record.output
    assert record.arguments == arguments and record.name == name


async def test_no_tools_at_all():
    record = await invoke_tool({}, "add", "{}", turn=0)
    assert record.error_kind == "unknown_tool" and "available tools: none" in record.output


async def test_oversize_arguments():
    arguments = json.dumps({"a": 1, "b": 2})
    size = len(arguments.encode())
    record = await invoke_tool(_bound(add), "add", arguments, turn=0, max_argument_bytes=size - 1)
    assert record.error_kind == "oversize_arguments"
    assert f"{size} bytes; the limit is {size - 1}" in record.output
    record = await invoke_tool(_bound(add), "add", arguments, turn=0, max_argument_bytes=size)
    assert record.ok  # the limit is inclusive


async def test_oversize_counts_bytes_not_characters():
    arguments = json.dumps({"text": "é" * 10}, ensure_ascii=False)  # 10 chars, 20 bytes
    record = await invoke_tool(
        _bound(shout), "shout", arguments, turn=0, max_argument_bytes=len(arguments) + 5
    )
    assert record.error_kind == "oversize_arguments"


async def test_sync_tool_timeout_releases_the_caller():
    release = threading.Event()

    @agentrl.tool
    def blocked() -> str:
        """Waits until the test releases it."""
        release.wait(30)
        return "late"

    try:
        with anyio.fail_after(20):  # a hang here would be the bug
            record = await invoke_tool(_bound(blocked), "blocked", "{}", turn=0, timeout_s=0.05)
    finally:
        release.set()
    assert record.error_kind == "tool_timeout"
    assert record.output == "Error (tool_timeout): tool 'blocked' did not finish within 0.05 s"


def _fake_clock():
    """trio's autojump clock: sleeps take no real time. Only for async tools: sync tools run in
    threads, and the fake clock jumps while a task waits on a thread."""
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


def _assert_fake_elapsed(start: float, seconds: float) -> None:
    """The fake clock jumped to the deadline ``start + seconds``: float64 rounds that sum, and
    the difference taken here, by at most ``u (|start| + seconds)`` each."""
    u = 2.0**-53  # float64's unit roundoff
    elapsed = anyio.current_time() - start
    assert abs(elapsed - seconds) <= 2 * u * (abs(start) + seconds), elapsed


@agentrl.tool(timeout_s=1)
async def sleepy(seconds: float) -> str:
    """Sleep, then answer."""
    await anyio.sleep(seconds)
    return "awake"


@pytest.mark.parametrize("anyio_backend", [_fake_clock()])
async def test_async_tool_timeout_with_fake_clock(anyio_backend):
    tools = _bound(sleepy)
    start = anyio.current_time()
    record = await invoke_tool(tools, "sleepy", '{"seconds": 100}', turn=0)
    assert record.error_kind == "tool_timeout"
    assert record.output == "Error (tool_timeout): tool 'sleepy' did not finish within 1 s"
    _assert_fake_elapsed(start, 1.0)
    # the tool's own timeout_s beats the caller's default; under it the tool finishes
    record = await invoke_tool(tools, "sleepy", '{"seconds": 0.5}', turn=0, timeout_s=0.1)
    assert record.ok and record.output == "awake"


@pytest.mark.parametrize("anyio_backend", [_fake_clock()])
async def test_caller_timeout_and_default_with_fake_clock(anyio_backend):
    @agentrl.tool
    async def slow(seconds: float) -> str:
        """Sleep."""
        await anyio.sleep(seconds)
        return "done"

    tools = _bound(slow)
    record = await invoke_tool(tools, "slow", '{"seconds": 100}', turn=0, timeout_s=7)
    assert record.error_kind == "tool_timeout" and "within 7 s" in record.output
    start = anyio.current_time()
    record = await invoke_tool(tools, "slow", '{"seconds": 100}', turn=0)
    assert record.error_kind == "tool_timeout" and "within 10 s" in record.output
    _assert_fake_elapsed(start, 10.0)
    record = await invoke_tool(tools, "slow", '{"seconds": 9}', turn=0)
    assert record.ok and record.output == "done"


async def test_cancellation_is_not_swallowed():
    """A cancel from outside (a trajectory deadline) must propagate, not become an
    observation."""
    started = anyio.Event()
    results = []

    @agentrl.tool
    async def forever() -> str:
        """Never returns."""
        started.set()
        await anyio.sleep_forever()
        return ""

    async def call() -> None:
        results.append(await invoke_tool(_bound(forever), "forever", "{}", turn=0, timeout_s=60))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await started.wait()
        tg.cancel_scope.cancel()
    assert results == []


_NEVER_RETURNS = """
import sys, threading, time
import anyio
import agentrl
from agentrl._tools import BoundTool, invoke_tool, tool_spec

@agentrl.tool
def stuck() -> str:
    \"\"\"Never returns.\"\"\"
    threading.Event().wait()
    return ""

async def main():
    tools = {"stuck": BoundTool(tool_spec(stuck), stuck)}
    record = await invoke_tool(tools, "stuck", "{}", turn=0, timeout_s=0.2)
    print(record.error_kind, flush=True)

anyio.run(main, backend=sys.argv[1])
"""


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_sync_tool_that_never_returns_does_not_keep_the_process_alive(backend, tmp_path):
    """Python cannot stop a thread: the call is recorded as ``tool_timeout`` and its thread is
    abandoned, and an abandoned thread must not hold the process at exit (anyio's own worker
    threads are not daemons: on asyncio the interpreter waited for it forever)."""
    import subprocess
    import sys

    script = tmp_path / "never_returns.py"
    script.write_text(_NEVER_RETURNS)
    proc = subprocess.run(
        [sys.executable, str(script), backend], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tool_timeout"]


async def test_a_failing_sync_tool_still_reports_its_exception():
    @agentrl.tool
    def exits() -> str:
        """Calls sys.exit."""
        raise SystemExit(3)

    record = await invoke_tool(_bound(boom, exits), "boom", '{"reason": "x"}', turn=0)
    assert record.error_kind == "tool_exception" and "x" in record.output
    record = await invoke_tool(_bound(exits), "exits", "{}", turn=0)
    assert record.error_kind == "tool_exception" and "SystemExit: 3" in record.output


class _StrRaises:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


@agentrl.tool
def unprintable() -> str:
    """Returns an object whose str() raises."""
    return _StrRaises()  # type: ignore[return-value]


@agentrl.tool
async def unprintable_in_a_list() -> list:
    """Returns a list holding such an object (json.dumps falls back to its str())."""
    return [1, _StrRaises()]


@pytest.mark.parametrize("name", ["unprintable", "unprintable_in_a_list"])
async def test_a_result_that_cannot_become_text_is_a_tool_exception(name):
    record = await invoke_tool(_bound(unprintable, unprintable_in_a_list), name, "{}", turn=2)
    assert not record.ok and record.error_kind == "tool_exception"
    assert record.output == (
        f"Error (tool_exception): the result of tool {name!r} cannot be turned into text: "
        "RuntimeError: no text for you"
    )
    assert record.turn == 2 and record.name == name


class _ToolOwnBaseException(BaseException):
    """Not an Exception, not a cancellation: a tool's own."""


def _base_exceptions():
    return [
        KeyboardInterrupt(),
        GeneratorExit("closed"),
        asyncio.CancelledError("cancelled by the tool itself"),
        _ToolOwnBaseException("odd"),
        SystemExit(4),
    ]


@pytest.mark.parametrize("raised", _base_exceptions(), ids=lambda e: type(e).__name__)
async def test_a_sync_tool_raising_a_base_exception_is_a_tool_exception(raised):
    """A sync tool runs in a worker thread: whatever it raises there (even a
    KeyboardInterrupt or a CancelledError) is its own failure, never the caller's."""

    @agentrl.tool
    def raising() -> str:
        """Raises a BaseException."""
        raise raised

    record = await invoke_tool(_bound(raising), "raising", "{}", turn=0)
    assert not record.ok and record.error_kind == "tool_exception"
    assert record.output.startswith(f"Error (tool_exception): {type(raised).__name__}")
    assert str(raised) in record.output


@pytest.mark.parametrize(
    "raised",
    [e for e in _base_exceptions() if not isinstance(e, KeyboardInterrupt | GeneratorExit)],
    ids=lambda e: type(e).__name__,
)
async def test_an_async_tool_raising_a_base_exception_is_a_tool_exception(raised):
    """Raised by the tool's own code while nobody cancels its caller (on asyncio a
    CancelledError then ended the trajectory silently; on trio it aborted the rollout)."""

    @agentrl.tool
    async def raising() -> str:
        """Raises a BaseException."""
        await anyio.sleep(0)
        raise raised

    record = await invoke_tool(_bound(raising), "raising", "{}", turn=0)
    assert not record.ok and record.error_kind == "tool_exception"
    assert record.output.startswith(f"Error (tool_exception): {type(raised).__name__}")
    assert str(raised) in record.output
    await anyio.sleep(0)  # the calling task was not left cancelled


@pytest.mark.parametrize("raised", [KeyboardInterrupt, GeneratorExit])
async def test_a_keyboard_interrupt_or_generator_exit_in_an_async_tool_propagates(raised):
    """An async tool runs in the main thread, where a user's Ctrl-C is raised; a
    GeneratorExit there means the calling coroutine is being closed."""

    @agentrl.tool
    async def interrupted() -> str:
        """Raises KeyboardInterrupt or GeneratorExit."""
        raise raised

    with pytest.raises(raised):
        await invoke_tool(_bound(interrupted), "interrupted", "{}", turn=0)


@pytest.mark.anyio_backends("asyncio")
async def test_a_cancellation_the_tool_reraises_as_its_own_still_propagates():
    """A tool that turns the caller's cancellation into a new CancelledError (after some
    cleanup): the caller is being cancelled, so it is real and must not be recorded."""
    started = anyio.Event()
    results = []

    @agentrl.tool
    async def cleanup_then_cancel() -> str:
        """Cleans up when cancelled, then raises a fresh CancelledError."""
        started.set()
        try:
            await anyio.sleep_forever()
        except asyncio.CancelledError:
            raise asyncio.CancelledError("cleaned up") from None
        return ""

    async def call() -> None:
        results.append(
            await invoke_tool(_bound(cleanup_then_cancel), "cleanup_then_cancel", "{}", turn=0)
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await started.wait()
        tg.cancel_scope.cancel()
    assert results == []


async def test_cancelling_the_caller_of_a_sync_tool_is_not_swallowed():
    release = threading.Event()
    started = anyio.Event()
    token = anyio.lowlevel.current_token()
    results = []

    @agentrl.tool
    def blocked() -> str:
        """Waits for the test to release it."""
        anyio.from_thread.run_sync(started.set, token=token)
        release.wait(30)
        return "released"

    async def call() -> None:
        results.append(await invoke_tool(_bound(blocked), "blocked", "{}", turn=0, timeout_s=60))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await started.wait()
            tg.cancel_scope.cancel()
    finally:
        release.set()
    assert results == []


@pytest.mark.parametrize("value", [0, -1, "5", True, float("nan")])
def test_env_tool_timeout_must_be_positive(value):
    from agentrl import ToolError
    from agentrl._tools import env_tool_timeout

    env = type("Env", (), {"tool_timeout_s": value})()
    with pytest.raises(ToolError, match="Env.tool_timeout_s must be a number > 0"):
        env_tool_timeout(env)
    assert env_tool_timeout(type("Env", (), {"tool_timeout_s": 2})()) == 2.0
    assert env_tool_timeout(object()) is None


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ("[" * 1100 + "]" * 1100, "nested too deeply"),
        ('{"a": ' + "9" * 4301 + "}", "Exceeds the limit (4300 digits)"),
    ],
)
def test_a_tool_call_whose_json_cannot_become_values_is_a_parse_error(arguments, why):
    """JSON that parses as text but not into values (too deep; an integer too long to read)
    raised RecursionError / ValueError out of the parser, failing the whole trajectory (and
    blamed on the env) instead of being an observation the model learns from."""
    from agentrl.formats._hermes import parse_hermes

    turn = parse_hermes(f'<tool_call>\n{{"name": "add", "arguments": {arguments}}}\n</tool_call>')
    (call,) = turn.calls
    assert call.error and f"tool call JSON cannot be read ({why}" in call.error, call.error
