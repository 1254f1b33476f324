"""Verifiers: the math grader, the stdin/stdout judge, and the unit-test harness — including the
reward hacks against the harness, each asserted to score 0 on every backend."""

from __future__ import annotations

import json
import time
from fractions import Fraction

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.sandboxes import (
    StdioCase,
    UnitTest,
    answers_match,
    extract_answer,
    grade_math,
    judge_stdio,
    outputs_match,
    parse_number,
    render_report,
    run_unit_tests,
    values_equal,
)
from agentrl.sandboxes._types import RunResult
from agentrl.sandboxes._verify_unittest import MARKER, parse_output

# -- math grader ----------------------------------------------------------------------------------

EQUAL = [
    ("0.5", "1/2"),
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac{1}{2}", "1/2"),
    (r"\tfrac{3}{4}", "0.75"),
    (r"$\boxed{\frac12}$", "0.5"),
    (r"\frac{\frac{1}{2}}{3}", "1/6"),
    (r"\frac{-1}{2}", "-0.5"),
    (r"-\frac{1}{2}", "-1/2"),
    ("50%", "0.5"),
    ("50%", "50"),
    (r"12.5\%", "1/8"),
    ("1,234", "1234"),
    ("1{,}234", "1234"),
    (r"1\,234", "1234"),
    ("$1,000.50$", "1000.5"),
    ("-1,234", "-1234"),
    (r"\left(-3\right)", "-3"),
    ("−3", "-3"),
    ("x = 5", "5"),
    ("12 apples", "12"),
    (r"12 \text{ apples}", "12"),
    ("3", "3.0"),
    ("3.", "3"),
    ("0.50", "0.5"),
    ("2^{10}", "1024"),
    (r"3 \times 10^{2}", "300"),
    ("1e3", "1000"),
    ("1.5e-3", "0.0015"),
    ("0.33", "1/3"),  # rounded to the places written
    ("0.6667", "2/3"),
    ("-0.33", "-1/3"),
    ("0.0041", "1/243"),  # two significant digits
    (r"33.33\%", "1/3"),  # a percentage keeps its own places: 0.3333
    ("0.33%", "1/3"),  # 0.33% is also 0.33 (the percent rule), which rounds 1/3
    ("1e400", "10e399"),  # the largest exponent a number may have
    (r"\boxed{42}", "42"),
    ("x+1", "x + 1"),  # not numeric: normalized text
]
NOT_EQUAL = [
    ("0.3", "1/3"),  # one place is not enough
    ("0.666", "2/3"),  # wrongly rounded
    ("0.49", "1/2"),  # exactly representable: must be exact
    ("0.00", "1/256"),  # zero rounds nothing
    ("0.00", "1/243"),
    ("0.00", "0.004"),
    ("0.004", "1/243"),  # one significant digit is not enough
    ("0.12", "1/8"),  # 1/8 has a terminating expansion: 0.125 exactly
    ("0.13", "1/8"),
    ("3.14", "3.14159"),  # an expected decimal is given exactly
    ("3.14", r"\frac{314159}{100000}"),
    (r"33.00\%", "1/3"),  # as a fraction 0.3300: four places, wrong in the fourth
    (r"33.3\%", "1/3"),  # one place written
    ("0.1 + 0.23", "1/3"),  # rounding is for a decimal the model wrote, not an expression
    ("1,2", "12"),  # not a thousands separator
    ("2 1/2", "2.5"),  # mixed numbers are not supported
    ("abc", "5"),
    ("5", "abc"),
    ("", "5"),
    ("1/0", "1"),
    (")))", "1"),
    ("(" * 300 + "1", "1"),
    ("9" * 5000, "1"),
    ("10^10^10", "1"),
    ("2^{100000}", "1"),
    ("1.2.3", "1"),
    ("-5", "5"),
]


@pytest.mark.parametrize(("got", "want"), EQUAL)
def test_equivalent_forms_match(got, want):
    assert answers_match(got, want), (got, want)
    assert grade_math(f"So the answer is <answer>{got}</answer>", want) == 1.0


@pytest.mark.parametrize(("got", "want"), NOT_EQUAL)
def test_different_or_garbage_do_not_match(got, want):
    assert not answers_match(got, want), (got, want)


def test_extract_answer():
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert extract_answer(r"\boxed{a{b}c} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_answer(r"unbalanced \boxed{1") is None
    assert extract_answer("no answer here") is None
    assert grade_math("The result is 42.", "42") == 0.0  # an answer must be marked
    assert grade_math(r"first \boxed{41}, finally \boxed{42}", "42") == 1.0


def test_answer_extraction_semantics():
    """The last ``<answer>`` that a ``</answer>`` follows, up to the first ``</answer>`` after
    it (any case); else the last ``\\boxed{}`` whose braces balance."""
    assert extract_answer("<answer>a<answer>b</answer>") == "b"
    assert extract_answer("<answer>5</answer> and a stray </answer>") == "5"
    assert extract_answer("<ANSWER>7</Answer> then <answer>unclosed") == "7"
    assert extract_answer("</answer><answer>") is None
    assert extract_answer(r"<answer>x</answer> \boxed{y}") == "x"  # a tag wins over a box
    assert extract_answer(r"\boxed{\boxed{1}}") == "1"
    assert extract_answer(r"\boxed{a} \boxed{b") == "a"
    assert extract_answer(r"\fbox {c} }}} \boxed") == "c"
    assert extract_answer("{" * 10 + r"\boxed{d}" + "}" * 3) == "d"


# Each ~200k-480k characters. With the quadratic scans these took minutes (``"\\boxed{" * 8000``
# took 22 s, ``"<answer>" * 8000`` 4.6 s); one pass over the text takes milliseconds.
HOSTILE = {
    "unclosed boxes": ("\\boxed{" * 60_000, None),
    "unclosed fboxes": ("\\fbox{" * 60_000, None),
    "unclosed answer tags": ("<answer>" * 60_000, None),
    "closing tags only": ("</answer>" * 60_000, None),
    "open tags then one close": ("<answer>" * 60_000 + "1</answer>", "1"),
    "one box, unclosed braces": ("\\boxed" + "{" * 400_000, None),
    "boxes, one balanced": ("\\boxed{1}" + "\\boxed{" * 60_000, "1"),
    "spaces after boxed": (("\\boxed" + " " * 50) * 8_000, None),
}


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_answer_extraction_is_linear_in_hostile_text(case):
    text, expected = HOSTILE[case]
    started = time.perf_counter()
    assert extract_answer(text) == expected
    assert grade_math(text, "42") == 0.0
    # a generous bound: one pass takes milliseconds, the quadratic scans took minutes
    assert time.perf_counter() - started < 10.0


@pytest.mark.parametrize(
    "number",
    ["1e999999999", "1e-999999999", "1.5E+99999999999", "0e999999999", "1e401", "1e-401",
     "1e2000000", "1e" + "0" * 500 + "5000000", "9" * 401, "0." + "0" * 400 + "1"],
    ids=lambda number: number if len(number) < 20 else f"{number[:4]}...{len(number)}-chars",
)  # fmt: skip
def test_huge_exponents_and_digit_counts_are_not_numbers(number):
    """Refused from the text, before a Fraction is made: ``Fraction('1e999999999')`` computes
    10**999999999 (hours of CPU holding the GIL)."""
    started = time.thread_time()  # CPU time: a stall of a loaded machine is not counted
    assert parse_number(number) is None
    assert grade_math(rf"\boxed{{{number}}}", "42") == 0.0
    assert not answers_match(number, "42")
    assert time.thread_time() - started < 0.5


def test_numbers_within_the_caps_are_exact():
    assert parse_number("1e400") == (10**400, False)
    assert parse_number("1e-400") == (Fraction(1, 10**400), False)
    assert parse_number("2.5e-3") == (Fraction(1, 400), False)
    assert parse_number("1e" + "0" * 500 + "3") == (1000, False)  # leading zeros of an exponent
    assert parse_number("9" * 400) == (int("9" * 400), False)


def test_powers_are_refused_before_they_are_computed():
    started = time.thread_time()
    assert parse_number("(9" + "9" * 300 + ")^{64}") is None
    assert parse_number("((9^{64})^{64})^{64}") is None
    assert time.thread_time() - started < 0.5


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 12), st.integers(0, 12), st.integers(-(10**6), 10**6), st.integers(2, 7))
def test_rounding_never_accepts_a_wrong_decimal_for_a_terminating_answer(twos, fives, n, places):
    """An expected value with a terminating decimal expansion must be given exactly."""
    want = Fraction(n, 2**twos * 5**fives)
    got = f"{float(want):.{places}f}"
    assert answers_match(got, str(want)) == (Fraction(got) == want), (got, want)


def test_percent_and_rounding_can_be_turned_off():
    assert parse_number("50%") == (parse_number("50")[0], True)
    assert answers_match("0.33", "1/3", allow_rounding=False) is False


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.text(max_size=50))
def test_grader_never_raises(got, want):
    assert grade_math(got, want) in (0.0, 1.0)
    assert answers_match(got, want) in (True, False)


@settings(max_examples=200, deadline=None)
@given(st.fractions(max_denominator=1000).filter(lambda f: abs(f) < 10**9))
def test_fraction_forms_round_trip(value):
    forms = [
        f"{value.numerator}/{value.denominator}",
        rf"\frac{{{value.numerator}}}{{{value.denominator}}}",
    ]
    if value.denominator == 1:
        forms.append(f"{value.numerator:,}")
    for form in forms:
        assert answers_match(form, str(value)), form


# -- stdin/stdout comparison ----------------------------------------------------------------------


def test_outputs_match_whitespace_and_tolerance():
    assert outputs_match("1 2\n3\n", " 1  2 3 ")
    assert not outputs_match("1 2", "1 2 3")
    assert not outputs_match("0.333", "0.3333333")
    assert outputs_match("0.333", "0.3333333", float_tol=1e-3)
    assert outputs_match("1000.1", "1000.0", float_tol=1e-3)  # relative for large values
    assert not outputs_match("abc", "abd", float_tol=1.0)
    assert outputs_match("nan", "nan", float_tol=1.0)  # equal strings match as text
    assert not outputs_match("inf", "1e308", float_tol=1.0)


@pytest.mark.parametrize(
    ("got", "want", "tol", "match"),
    [
        # integers are exact, whatever the tolerance
        ("1000000000000000001", "1000000000000000000", 1e-12, False),
        ("9007199254740993", "9007199254740992", 1e-15, False),
        ("999999", "1000000", 1e-6, False),
        ("1.0", "1", 1e-6, False),
        ("1000000", "1000000", 1e-6, True),
        # only ASCII decimal literals are numbers
        ("1_0", "10", 1e-9, False),
        ("1_0.0", "10.0", 1e-9, False),
        ("\u0661\u0660", "10", 1e-9, False),
        ("\u0661\u0660.0", "10.0", 1e-9, False),
        ("\uff11.0", "1.0", 1e-9, False),  # a fullwidth digit
        (" 10.0 ", "10.0", 1e-9, True),
        ("infinity", "1e308", 1.0, False),
        # a float expected: the tolerance applies, an integer or exponent form on either side
        ("0.3333334", "0.3333333", 1e-6, True),
        ("100000", "1e5", 1e-9, True),
        ("1E5", "100000.0", 1e-9, True),
        ("-2.5e-3", "-0.0025", 1e-12, True),
        ("10", "10.0", 1e-9, True),
        ("10.5", "10.0", 1e-3, False),
    ],
)
def test_the_float_tolerance_is_for_ascii_float_literals(got, want, tol, match):
    assert outputs_match(got, want, float_tol=tol) is match


# -- unit-test harness: parsing and comparison (no sandbox) ---------------------------------------

ADD_TESTS = [
    UnitTest("add(1, 2)", 3),
    UnitTest("add(10, 5)", 15),
    UnitTest("add(-4, -7)", -11),
    UnitTest("add(100, 23)", 123),
]
GOOD_ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return a - b\n"


def test_values_equal_is_strict():
    assert values_equal(3, 3) and not values_equal(True, 1) and not values_equal(1, True)
    assert values_equal(2, 2.0) and not values_equal(2.0, 2)
    assert not values_equal([1, 2], (1, 2)) and values_equal((1, [2]), (1, [2]))
    assert values_equal({"a": [1.0000001]}, {"a": [1.0]}, float_tol=1e-6)
    assert not values_equal({"a": 1}, {"a": 1, "b": 2}) and not values_equal(None, 0)
    assert values_equal(float("nan"), float("nan"))


def test_values_equal_keeps_integers_exact_under_a_tolerance():
    assert not values_equal(999999, 1000000, float_tol=1e-6)
    assert not values_equal(10**18 + 1, 10**18, float_tol=1e-12)
    assert not values_equal(2.0, 2, float_tol=1e-9) and values_equal(2, 2, float_tol=1e-9)
    assert values_equal(2, 2.0000000001, float_tol=1e-9)  # an int for a float, within it
    assert not values_equal(10**400, 1.0, float_tol=1e-6)  # past a float's range: no error


def _summary(nonce: str, results: list, n: int | None = None) -> str:
    body = {"n": len(results) if n is None else n, "results": results, "stdout": "", "stderr": ""}
    return f"\n{MARKER} {nonce} {json.dumps(body)}\n"


def test_parse_output_requires_nonce_last_line_and_every_result():
    tests = ADD_TESTS[:2]
    ok = [{"status": "value", "repr": "3"}, {"status": "value", "repr": "15"}]
    good = parse_output(RunResult("ok", stdout=_summary("n1", ok)), tests, "n1")
    assert (good.status, good.passed, good.fraction) == ("ok", 2, 1.0)
    cases = {
        "wrong nonce": RunResult("ok", stdout=_summary("other", ok)),
        "not last": RunResult("ok", stdout=_summary("n1", ok) + "more\n"),
        "missing result": RunResult("ok", stdout=_summary("n1", ok[:1])),
        "count lies": RunResult("ok", stdout=_summary("n1", ok[:1], n=2)),
        "no output": RunResult("timeout"),
        "not json": RunResult("ok", stdout=f"{MARKER} n1 {{all passed}}\n"),
    }
    for name, result in cases.items():
        report = parse_output(result, tests, "n1")
        assert report.status == "no_result" and report.fraction == 0.0, name
    unknown = [{"status": "passed"}, {"status": "value", "repr": "object()"}]
    report = parse_output(RunResult("ok", stdout=_summary("n1", unknown)), tests, "n1")
    assert report.status == "ok" and report.passed == 0
    assert [o.status for o in report.outcomes] == ["protocol_error", "not_a_literal"]
    assert parse_output(RunResult("sandbox_error", error="boom"), tests, "n1").infrastructure_failed


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.sampled_from(["ok", "timeout", "nonzero_exit", "oom"]))
def test_parse_output_never_raises(stdout, status):
    nonce = "abc"
    for text in (stdout, f"{MARKER} {nonce} {stdout}"):
        report = parse_output(RunResult(status, stdout=text), ADD_TESTS, nonce)
        assert report.status in ("no_result", "ok") and report.fraction == 0.0


def test_parse_output_truncated_and_exceptions():
    tests = [UnitTest("f()", [1] * 10), UnitTest("g()", raises="ValueError"), UnitTest("h()", 1)]
    items = [
        {"status": "value", "repr": "[1, 1", "truncated": True},
        {"status": "exception", "exc_type": "ValueError", "message": "bad"},
        {"status": "exception", "exc_type": "ValueError", "message": "bad"},
    ]
    report = parse_output(RunResult("ok", stdout=_summary("n", items)), tests, "n")
    assert [o.status for o in report.outcomes] == ["truncated", "passed", "exception"]
    assert report.passed == 1


# -- unit-test harness in real sandboxes ----------------------------------------------------------

# Each hack is a WRONG solution (add returns a - b) plus an attempt to get credit anyway.
HACKS: dict[str, str] = {
    "sys.exit before tests": "import sys\nsys.exit(0)\n" + WRONG_ADD,
    "os._exit before tests": "import os\nos._exit(0)\n" + WRONG_ADD,
    "os._exit inside the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "SystemExit inside the call": "def add(a, b):\n    raise SystemExit(0)\n",
    "KeyboardInterrupt inside the call": "def add(a, b):\n    raise KeyboardInterrupt\n",
    "fake summary on stdout": (
        "import json\n"
        "fake = json.dumps({'n': 4, 'results': [{'status': 'value', 'repr': '3'}] * 4})\n"
        "for nonce in ['0' * 32, 'x']:\n"
        "    print(f'\\n" + MARKER + " {nonce} {fake}')\n"
        "import sys\nprint('" + MARKER + "', file=sys.stderr)\n" + WRONG_ADD
    ),
    "fake summary through the parent's stdout, then kill it": (
        "import os, json, signal\n"
        "fake = json.dumps({'n': 4, 'results': [{'status': 'value', 'repr': '3'}] * 4})\n"
        "try:\n"
        "    with open(f'/proc/{os.getppid()}/fd/1', 'w') as f:\n"
        "        f.write('\\n" + MARKER + " ' + '0' * 32 + ' ' + fake + '\\n')\n"
        "except OSError:\n    pass\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n" + WRONG_ADD
    ),
    "steal the nonce from the parent": (
        "import os, re, json, signal\n"
        "ppid = os.getppid()\nfound = set()\n"
        "for name in ('environ', 'cmdline', 'mem', 'fd/0'):\n"
        "    try:\n"
        "        with open(f'/proc/{ppid}/{name}', 'rb') as f:\n"
        "            data = f.read(1 << 20)\n"
        "        found |= set(re.findall(rb'[0-9a-f]{32}', data))\n"
        "    except OSError:\n        pass\n"
        "fake = json.dumps({'n': 4, 'results': [{'status': 'value', 'repr': '3'}] * 4})\n"
        "try:\n"
        "    with open(f'/proc/{ppid}/fd/1', 'w') as out:\n"
        "        for nonce in found:\n"
        "            out.write('\\n" + MARKER + " ' + nonce.decode() + ' ' + fake + '\\n')\n"
        "except OSError:\n    pass\n"
        "os.kill(ppid, signal.SIGKILL)\n" + WRONG_ADD
    ),
    "patch repr, json and print": (
        "import builtins, json\n"
        "builtins.repr = lambda x: \"'passed'\"\n"
        'json.dumps = lambda *a, **k: \'{"i": 0, "status": "pass"}\'\n'
        "builtins.print = lambda *a, **k: None\n" + WRONG_ADD
    ),
    "patch unittest and assert machinery": (
        "import unittest, builtins\n"
        "unittest.TestCase.assertEqual = lambda *a, **k: None\n"
        "builtins.AssertionError = type('Nope', (Exception,), {})\n" + WRONG_ADD
    ),
    "always-equal object": (
        "class Eq:\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Eq()\n"
    ),
    "always-equal int subclass": (
        "class I(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return I(0)\n"
    ),
    "repr that raises": (
        "class R:\n    def __repr__(self):\n        raise RuntimeError('no')\n"
        "def add(a, b):\n    return R()\n"
    ),
    "forge result lines on the result fd": (
        "import os, sys, json\nfd = int(sys.argv[2])\n"
        "for i in range(4):\n"
        "    os.write(fd, (json.dumps({'i': i, 'status': 'passed'}) + '\\n').encode())\n"
        "os._exit(0)\n"
    ),
    "garbage on the result fd": (
        "import os, sys\nos.write(int(sys.argv[2]), b'garbage\\n' * 1000)\n" + WRONG_ADD
    ),
    "replace the json module": (
        "import sys, types\nsys.modules['json'] = types.SimpleNamespace(dumps=lambda o: 'ok')\n"
        + WRONG_ADD
    ),
    "delete and rewrite files": (
        "import os\n"
        "for root in ('.', '..', '/tmp'):\n"
        "    try:\n"
        "        for name in os.listdir(root):\n"
        "            path = os.path.join(root, name)\n"
        "            try:\n"
        "                os.remove(path)\n"
        "            except OSError:\n"
        "                pass\n"
        "    except OSError:\n        pass\n"
        "open('test_solution.py', 'w').write('assert True')\n" + WRONG_ADD
    ),
    "atexit fake summary": (
        "import atexit\n"
        "atexit.register(lambda: print('" + MARKER + " ' + '0' * 32 + ' {}'))\n" + WRONG_ADD
    ),
    "daemon that prints later": (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(0.5)\n"
        "        for fd in (1, 2):\n"
        "            try:\n"
        "                os.write(fd, b'\\n" + MARKER + " x {}\\n')\n"
        "            except OSError:\n"
        "                pass\n"
        "    os._exit(0)\n" + WRONG_ADD
    ),
    "flood stdout and stderr": (
        "import sys\nsys.stdout.write('x' * 3_000_000)\nsys.stderr.write('y' * 3_000_000)\n"
        + WRONG_ADD
    ),
    "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + WRONG_ADD,
    "stop the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n" + WRONG_ADD,
    "hang at import": "while True:\n    pass\n",
}


async def _score(runner, code: str, tests=ADD_TESTS, **kw) -> float:
    kw.setdefault("timeout_s", 8.0)
    kw.setdefault("per_test_timeout_s", 1.0)
    return (await run_unit_tests(runner, code, tests, **kw)).fraction


@pytest.mark.anyio
async def test_harness_scores_correct_partial_and_hanging_solutions(sandbox_backend):
    partial = "def add(a, b):\n    return a + b if a > 0 else 0\n"
    hangs_once = "def add(a, b):\n    while a == 10:\n        pass\n    return a + b\n"
    noisy = "import sys\nprint('hello')\nprint('x', file=sys.stderr)\n" + GOOD_ADD
    async with sandbox_backend.open(size=2) as pool:
        good = await run_unit_tests(pool, GOOD_ADD, ADD_TESTS)
        assert (good.status, good.passed, good.total) == ("ok", 4, 4), good
        assert await _score(pool, WRONG_ADD) == 0.0
        assert await _score(pool, partial) == 0.75
        report = await run_unit_tests(pool, noisy, ADD_TESTS)
        assert report.fraction == 1.0 and "hello" in report.stdout and "x" in report.stderr
        started = time.monotonic()
        report = await run_unit_tests(pool, hangs_once, ADD_TESTS, per_test_timeout_s=1.0)
        assert report.passed == 3 and report.outcomes[1].status == "timeout", report
        assert time.monotonic() - started < 8
        raises = [UnitTest("div(1, 0)", raises="ZeroDivisionError"), UnitTest("div(6, 3)", 2.0)]
        div = "def div(a, b):\n    return a / b\n"
        assert await _score(pool, div, raises) == 1.0
        text = render_report(await run_unit_tests(pool, WRONG_ADD, ADD_TESTS[:1]))
        assert "FAIL add(1, 2): expected 3, got -1" in text


@pytest.mark.anyio
async def test_reward_hacks_score_zero(sandbox_backend):
    scores: dict[str, float] = {}
    statuses: dict[str, str] = {}

    async def one(pool, name: str, code: str) -> None:
        report = await run_unit_tests(pool, code, ADD_TESTS, timeout_s=6.0, per_test_timeout_s=1.0)
        scores[name] = report.fraction
        statuses[name] = f"{report.status}/{report.run_status}"

    with anyio.fail_after(240):
        async with sandbox_backend.open(size=3, max_queue=64, queue_timeout_s=200) as pool:
            async with anyio.create_task_group() as tg:
                for name, code in HACKS.items():
                    tg.start_soon(one, pool, name, code)
            assert await _score(pool, GOOD_ADD) == 1.0  # still serving, still grading
    cheated = {name: (score, statuses[name]) for name, score in scores.items() if score != 0.0}
    assert not cheated, f"hacks that got credit: {cheated}"
    assert len(scores) == len(HACKS)


@pytest.mark.anyio
async def test_stdio_judge(sandbox_backend):
    code = "a, b = map(float, input().split())\nprint(a / b)\n"
    cases = [
        StdioCase("1 3\n", "0.333333"),
        StdioCase("10 4\n", "2.5"),
        StdioCase("1 0\n", "inf"),
    ]
    async with sandbox_backend.open(size=2) as pool:
        exact = await judge_stdio(pool, code, cases)
        tolerant = await judge_stdio(pool, code, cases, float_tol=1e-5)
    assert [c.passed for c in exact.cases] == [False, True, False]
    assert [c.passed for c in tolerant.cases] == [True, True, False]
    # passed / total: the same division as 2 / 3, so the same float
    assert tolerant.cases[2].status == "nonzero_exit" and tolerant.fraction == 2 / 3


@pytest.mark.anyio
@pytest.mark.parametrize("sandbox_backend", ["local"], indirect=True)
async def test_a_solution_the_sandbox_refuses_is_a_harness_error(sandbox_backend):
    """A solution too large for ``memory_mb`` is refused before anything runs (the pool raises
    ``InvalidRequest``); the unit-test verifier reports it, it does not raise."""
    async with sandbox_backend.open(size=1) as pool:
        solution = "def add(a, b):\n    return a + b\n" + "#" * (9 << 20)
        report = await run_unit_tests(pool, solution, ADD_TESTS, memory_mb=16)
        assert report.status == "harness_error" and report.passed == 0, report
        assert "memory_mb=16" in (report.error or "")
        assert pool.statistics().execs == 0
