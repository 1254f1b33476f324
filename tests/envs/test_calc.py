"""calc-v0's evaluator: exact arithmetic whose every intermediate result is bounded, so no
expression a model writes can hold the GIL (and freeze the event loop) for long."""

from __future__ import annotations

import time
from fractions import Fraction

import anyio
import pytest
from loop_probes import heartbeat

import agentrl
from agentrl._tools import collect_tools, invoke_tool
from agentrl.envs.calc import MAX_BITS, safe_eval

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]

# Each exponent is within the per-exponent bound (|n| <= 64); nested, the result would have
# ~13 million bits: about 3 s of big-integer work in one C call, holding the GIL throughout.
NESTED = [
    "(((9**64)**64)**64)**16",
    "((((9**64)**64)**64)**64)**64",
    "(((2**64)**64)**64)*(((2**64)**64)**64)",
    "((9**64)**64)**-64",
    "(1/((9**64)**64))**64",
]


@pytest.mark.parametrize("expression", NESTED)
def test_nested_powers_are_refused_before_they_are_computed(expression):
    started = time.thread_time()  # CPU time: a stall of a loaded machine is not counted
    with pytest.raises(ValueError, match=f"a result exceeds {MAX_BITS} bits"):
        safe_eval(expression)
    assert time.thread_time() - started < 0.1


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(12 + 3) * 4", Fraction(60)),
        ("2**64", Fraction(2**64)),
        ("(2**63)**64", Fraction(2**4032)),  # near the bound
        ("7 / 2", Fraction(7, 2)),
        ("2**-3", Fraction(1, 8)),
        ("9" * 150, Fraction(int("9" * 150))),
    ],
)
def test_results_within_the_bound_are_exact(expression, value):
    assert safe_eval(expression) == value


def test_a_result_just_past_the_bound_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        safe_eval("(2**63)**64 * 2**64")


async def test_the_calculator_answers_nested_powers_quickly_and_the_loop_stays_responsive():
    env = agentrl.make("calc-v0")
    tools = collect_tools(env)
    gaps: list[float] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat, gaps, stop)
        await anyio.sleep(0.05)
        started = time.perf_counter()
        record = await invoke_tool(  # computed, it would hold the GIL (the loop) ~20 s
            tools, "calculator", {"expression": "(((9**64)**64)**64)**64"}, turn=0, timeout_s=2.0
        )
        elapsed = time.perf_counter() - started
        await anyio.sleep(0.05)
        stop.set()
    assert record.error_kind == "tool_exception", record
    assert f"a result exceeds {MAX_BITS} bits" in record.output
    # bounds far below the ~20 s a computed power takes, far above a loaded machine's stalls
    assert elapsed < 8.0 and max(gaps) < 8.0, (elapsed, max(gaps))
