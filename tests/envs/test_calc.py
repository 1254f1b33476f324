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
from agentrl.envs.calc import MAX_BITS, CalcEnv, final_answer, parse_number, safe_eval

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


# -- the reward's answer parsing ---------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    ["1e999999999", "1e-999999999", "2.5E+99999999999", "1e1234", "9" * 1234, "1/" + "9" * 1234,
     "1e" + "0" * 500 + "99999999"],
    ids=lambda answer: answer if len(answer) < 20 else f"{answer[:4]}...{len(answer)}-chars",
)  # fmt: skip
def test_huge_numbers_in_an_answer_are_refused_from_their_text(answer):
    """``Fraction('1e999999999')`` computes 10**999999999: hours of CPU holding the GIL."""
    started = time.thread_time()
    assert parse_number(answer) is None
    assert time.thread_time() - started < 0.5


def test_answers_within_the_caps_are_exact():
    assert parse_number("1e1233") == 10**1233
    assert parse_number(" 1,234. ") == 1234
    assert parse_number("-3/4") == Fraction(-3, 4)
    assert parse_number("2.5e-3") == Fraction(1, 400)
    assert parse_number("1_000") is None and parse_number("\u0661\u0660") is None


def _episode(text: str) -> agentrl.Episode:
    task = agentrl.Task(id="t", prompt="What is 6 * 7?", answer="42")
    return agentrl.Episode(
        task=task, messages=[agentrl.Message("assistant", text)], tool_calls=[], num_turns=1
    )


# ~480k characters each: a lazy ``<answer>(.*?)</answer>`` took ~4.6 s on "<answer>" * 8000, so
# minutes on these; the two scans take milliseconds
@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<answer>" * 60_000, None),
        ("</answer>" * 60_000, None),
        ("<answer>42</answer>" + "<answer>" * 60_000, "42"),
        ("x" * 480_000 + "<answer> 42 </answer>", "42"),
        ("<answer>a<answer>42</answer>", "a<answer>42"),  # the first tag, as before
    ],
    ids=["unclosed", "closing-only", "first-then-unclosed", "long-then-answer", "nested"],
)
async def test_the_answer_is_found_in_one_pass(text, answer):
    started = time.perf_counter()
    assert final_answer(text) == answer
    reward = await CalcEnv().reward(_episode(text))
    assert reward.breakdown["correct"] == (1.0 if answer == "42" else 0.0)
    assert time.perf_counter() - started < 10.0  # generous: minutes when quadratic
