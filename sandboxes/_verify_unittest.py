"""Python unit-test harness: run model code against hidden tests so that only correct code passes.

A hidden test is a call (``add(2, 3)``, optionally after ``setup`` statements) and the value it
must produce (or the exception it must raise). The expected values never enter the sandbox: the
in-sandbox harness (``_harness.py``) only reports what each call produced, and the comparison
happens here, on plain values parsed with ``ast.literal_eval``. What the model's code can do in
the sandbox — exit early (``sys.exit``/``os._exit``), patch ``repr``/``json``/``assert``/the
runner, print a fake summary, delete or rewrite files, kill its parent, hang, flood the output —
can only make tests fail. The summary must be the last line of stdout and carry this run's nonce
(a fresh ``secrets.token_hex`` the model's process never sees), and it must hold a result for
every hidden test, else the run scores 0.

``run_unit_tests(runner, code, tests)`` returns a ``UnitTestReport``: ``fraction`` is the reward;
``render_report`` formats it as feedback for visible tests.
"""

from __future__ import annotations

import ast
import json
import math
import secrets
from functools import cache
from pathlib import Path
from typing import Any, Literal

import msgspec

from ._protocol import SandboxRunner
from ._types import MAX_OUTPUT_LIMIT_BYTES, InvalidRequest, RunRequest, RunResult

MARKER = "AGENTRL-HARNESS-RESULT"
ReportStatus = Literal["ok", "no_result", "harness_error", "sandbox_error"]


class UnitTest(msgspec.Struct, frozen=True):
    """One hidden (or visible) test: evaluate ``call`` after ``setup``; expect ``expected``."""

    call: str
    """A Python expression using the solution's names, e.g. ``"add(2, 3)"``."""
    expected: Any = None
    """A value built from literals (int, float, str, bytes, bool, None, list, tuple, dict, set)."""
    setup: str = ""
    """Statements run first in the test's fresh namespace (e.g. ``"s = Stack(); s.push(1)"``)."""
    raises: str | None = None
    """The exception type name the call must raise instead of returning (``"ValueError"``)."""
    float_tol: float | None = None
    """Relative and absolute tolerance for expected floats (exact when None); an expected int
    is always exact."""
    name: str = ""


class UnitTestOutcome(msgspec.Struct):
    call: str
    passed: bool
    status: str
    """passed, wrong_value, exception, timeout, crashed, import_error, deadline, protocol_error,
    not_a_literal, truncated."""
    got: str | None = None
    expected: str | None = None
    message: str | None = None


class UnitTestReport(msgspec.Struct):
    status: ReportStatus
    """ok: every test ran (pass or fail); no_result: the run produced no valid summary (the
    program's fault: counts as 0); harness_error / sandbox_error: the infrastructure failed."""
    passed: int
    total: int
    outcomes: list[UnitTestOutcome] = msgspec.field(default_factory=list)
    error: str | None = None
    stdout: str = ""
    stderr: str = ""
    run_status: str = ""
    """The sandbox's status for the harness run."""

    @property
    def fraction(self) -> float:
        """Share of tests passed (the reward); 0.0 when nothing valid came back."""
        return self.passed / self.total if self.total and self.status == "ok" else 0.0

    @property
    def infrastructure_failed(self) -> bool:
        return self.status in ("harness_error", "sandbox_error")


@cache
def harness_source() -> str:
    """Source of the in-sandbox harness (sent as the program's code)."""
    return (Path(__file__).with_name("_harness.py")).read_text()


def build_request(
    code: str,
    tests: list[UnitTest],
    nonce: str,
    *,
    module: str = "solution",
    timeout_s: float = 10.0,
    per_test_timeout_s: float = 2.0,
    memory_mb: int = 512,
    repr_limit: int = 65536,
    files: dict[str, str] | None = None,
) -> RunRequest:
    """The sandbox request that runs ``tests`` against ``code`` (written as ``module``.py)."""
    if not module.isidentifier():
        raise ValueError(f"module must be an identifier, got {module!r}")
    margin = max(0.5, 0.1 * timeout_s)
    payload = {
        "nonce": nonce,
        "source": harness_source(),
        "module": module,
        "tests": [{"setup": t.setup, "call": t.call} for t in tests],
        "deadline_s": max(0.1, timeout_s - margin),
        "per_test_timeout_s": per_test_timeout_s,
        "repr_limit": repr_limit,
    }
    output_limit = min(MAX_OUTPUT_LIMIT_BYTES, 2 * len(tests) * (repr_limit + 4096) + 65536)
    return RunRequest(
        language="python",
        code=harness_source(),
        stdin=json.dumps(payload),
        files={**(files or {}), f"{module}.py": code},
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        output_limit_bytes=output_limit,
    )


def _literal(text: str) -> tuple[bool, Any]:
    if text in ("nan", "inf", "-inf"):
        return True, float(text)
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def values_equal(got: Any, want: Any, float_tol: float | None = None) -> bool:
    """Strict structural equality on plain values (``True`` is not ``1``; a list is not a
    tuple); an int is accepted for a float; floats exact unless ``float_tol``; an expected int
    is always exact (a tolerance would make 999999 equal 1000000 at 1e-6)."""
    if isinstance(want, bool) or want is None:
        return type(got) is type(want) and got == want
    if isinstance(want, float):
        if isinstance(got, bool) or type(got) not in (int, float):
            return False
        if math.isnan(want):
            return isinstance(got, float) and math.isnan(got)
        if float_tol is None:
            return got == want
        try:
            return math.isclose(got, want, rel_tol=float_tol, abs_tol=float_tol)
        except OverflowError:  # an int past a float's range is no answer to a float
            return False
    if type(got) is not type(want):
        return False
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(
            values_equal(g, w, float_tol) for g, w in zip(got, want, strict=True)
        )
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(
            values_equal(got[k], want[k], float_tol) for k in want
        )
    return bool(got == want)


_HARNESS_FAILURES = frozenset({"timeout", "deadline", "crashed", "protocol_error", "import_error"})


def _judge(test: UnitTest, item: Any) -> UnitTestOutcome:
    expected = f"raises {test.raises}" if test.raises else repr(test.expected)
    outcome = UnitTestOutcome(
        call=test.call, passed=False, status="protocol_error", expected=expected
    )
    if not isinstance(item, dict):
        return outcome
    status = item.get("status")
    if status == "value":
        outcome.got = str(item.get("repr", ""))[:2000]
        if item.get("truncated"):
            outcome.status = "truncated"
            return outcome
        ok, value = _literal(str(item.get("repr", "")))
        if not ok:
            outcome.status = "not_a_literal"
        elif test.raises is None and values_equal(value, test.expected, test.float_tol):
            outcome.passed, outcome.status = True, "passed"
        else:
            outcome.status = "wrong_value"
    elif status == "exception":
        exc_type, message = str(item.get("exc_type", "")), str(item.get("message", ""))
        outcome.got = f"raised {exc_type}"
        outcome.message = f"{exc_type}: {message}"[:2000]
        if test.raises is not None and exc_type == test.raises:
            outcome.passed, outcome.status = True, "passed"
        else:
            outcome.status = "exception"
    elif status in _HARNESS_FAILURES:
        outcome.status = status
        outcome.message = str(item.get("message", ""))[:2000]
    return outcome


def parse_output(result: RunResult, tests: list[UnitTest], nonce: str) -> UnitTestReport:
    """Judge the harness run: a valid summary line for this nonce, then one value per test."""
    total = len(tests)
    base = {"passed": 0, "total": total, "run_status": result.status}
    if result.status == "sandbox_error":
        return UnitTestReport(status="sandbox_error", error=result.error, **base)
    if result.status == "invalid_request":
        return UnitTestReport(status="harness_error", error=result.error, **base)
    lines = [line for line in result.stdout.split("\n") if line.strip()]
    prefix = f"{MARKER} {nonce} "
    if not lines or not lines[-1].startswith(prefix):
        why = f"the harness produced no result (sandbox status {result.status}"
        if result.stdout_truncated:
            why += ", output truncated"
        return UnitTestReport(status="no_result", error=why + ")", **base)
    try:
        summary = json.loads(lines[-1][len(prefix) :])
        items = summary["results"]
        if summary["n"] != total or not isinstance(items, list) or len(items) != total:
            raise ValueError("wrong number of results")
    except (ValueError, KeyError, TypeError) as exc:
        return UnitTestReport(
            status="no_result", error=f"unreadable harness summary: {exc}", **base
        )
    outcomes = [_judge(test, item) for test, item in zip(tests, items, strict=True)]
    stdout, stderr = str(summary.get("stdout", "")), str(summary.get("stderr", ""))
    if summary.get("error"):
        return UnitTestReport(
            status="harness_error", error=str(summary["error"]), outcomes=outcomes, **base
        )
    return UnitTestReport(
        status="ok",
        passed=sum(o.passed for o in outcomes),
        total=total,
        outcomes=outcomes,
        stdout=stdout,
        stderr=stderr,
        run_status=result.status,
    )


async def run_unit_tests(
    runner: SandboxRunner,
    code: str,
    tests: list[UnitTest],
    *,
    module: str = "solution",
    timeout_s: float = 10.0,
    per_test_timeout_s: float = 2.0,
    memory_mb: int = 512,
    files: dict[str, str] | None = None,
) -> UnitTestReport:
    """Run ``tests`` against ``code`` in one sandbox run; the report's ``fraction`` is the
    share of tests passed. Raises only what the runner raises (``PoolBusy``/``SandboxBusy``)."""
    if not tests:
        return UnitTestReport(status="ok", passed=0, total=0)
    nonce = secrets.token_hex(16)
    request = build_request(
        code,
        tests,
        nonce,
        module=module,
        timeout_s=timeout_s,
        per_test_timeout_s=per_test_timeout_s,
        memory_mb=memory_mb,
        files=files,
    )
    try:
        result = await runner.run(request)
    except InvalidRequest as exc:  # e.g. the code and files do not fit memory_mb: nothing ran
        result = RunResult(status="invalid_request", error=str(exc))
    return parse_output(result, tests, nonce)


def render_report(report: UnitTestReport, *, limit: int = 2000) -> str:
    """Feedback text for a model (visible tests): a line per test plus the program's output."""
    if report.status != "ok":
        return f"Tests did not run: {report.error or report.status}"[:limit]
    lines = [f"{report.passed}/{report.total} tests passed"]
    for o in report.outcomes:
        if o.passed:
            lines.append(f"PASS {o.call}")
        elif o.status == "wrong_value":
            lines.append(f"FAIL {o.call}: expected {o.expected}, got {o.got}")
        elif o.status == "exception":
            lines.append(f"FAIL {o.call}: expected {o.expected}, {o.message}")
        else:
            lines.append(f"FAIL {o.call}: {o.status} {o.message or ''}".rstrip())
    if report.stdout.strip():
        lines += ["stdout:", report.stdout.strip()]
    if report.stderr.strip():
        lines += ["stderr:", report.stderr.strip()]
    text = "\n".join(lines)
    return text if len(text) <= limit else text[: limit - 15] + "\n… (truncated)"
