"""stdin/stdout judge: run a program on given inputs and compare its output with the expected.

Outputs are compared token by token after whitespace normalization (line breaks and runs of
spaces do not matter). With ``float_tol``, an expected token that is a float literal — ASCII
digits with a ``.`` or an exponent (``0.25``, ``-1.5e-3``, ``1E5``) — also matches a got token
that is an ASCII decimal number (an integer too) when ``|got - want| <= float_tol * max(1,
|want|)``. Everything else is compared exactly: an expected integer (``1000000`` is never
``999999``, however large or small the tolerance, and never ``1000000.0``), and any token that is
not plain ASCII (``1_0``, Arabic-Indic or fullwidth digits, ``inf``, ``nan``). A case passes
only when the program ran to a clean exit (``status == "ok"``) and its output matches.
"""

from __future__ import annotations

import math
import re

import msgspec

from ._protocol import SandboxRunner
from ._types import RunRequest


class StdioCase(msgspec.Struct, frozen=True):
    stdin: str
    expected: str


class StdioCaseVerdict(msgspec.Struct):
    passed: bool
    status: str
    """The sandbox status of the run (ok, nonzero_exit, timeout, …)."""
    reason: str = ""
    stdout: str = ""


class StdioVerdict(msgspec.Struct):
    passed: int
    total: int
    cases: list[StdioCaseVerdict]

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


_DECIMAL_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def _token_equal(got: str, want: str, float_tol: float | None) -> bool:
    if got == want:
        return True
    if float_tol is None or not any(c in want for c in ".eE"):
        return False  # no tolerance, or an expected integer (or word): exact
    if _DECIMAL_RE.fullmatch(got) is None or _DECIMAL_RE.fullmatch(want) is None:
        return False  # float() would take "1_0", "inf" and non-ASCII digits
    g, w = float(got), float(want)
    if not (math.isfinite(g) and math.isfinite(w)):
        return False
    return abs(g - w) <= float_tol * max(1.0, abs(w))


def outputs_match(got: str, want: str, *, float_tol: float | None = None) -> bool:
    """Whitespace-normalized, token-wise comparison (never raises)."""
    try:
        got_tokens, want_tokens = got.split(), want.split()
        return len(got_tokens) == len(want_tokens) and all(
            _token_equal(g, w, float_tol) for g, w in zip(got_tokens, want_tokens, strict=True)
        )
    except Exception:
        return False


async def judge_stdio(
    runner: SandboxRunner,
    code: str,
    cases: list[StdioCase],
    *,
    language: str = "python",
    float_tol: float | None = None,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    output_limit_bytes: int = 1024 * 1024,
) -> StdioVerdict:
    """Run ``code`` once per case (one batch) and compare each stdout with the expected."""
    requests = [
        RunRequest(
            language=language,  # type: ignore[arg-type]
            code=code,
            stdin=case.stdin,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            output_limit_bytes=output_limit_bytes,
        )
        for case in cases
    ]
    results = await runner.run_batch(requests) if requests else []
    verdicts = []
    for case, result in zip(cases, results, strict=True):
        if result.status != "ok":
            reason = result.error or f"exit code {result.exit_code}"
            verdicts.append(StdioCaseVerdict(False, result.status, reason, result.stdout[:2000]))
        elif outputs_match(result.stdout, case.expected, float_tol=float_tol):
            verdicts.append(StdioCaseVerdict(True, result.status, "", result.stdout[:2000]))
        else:
            verdicts.append(
                StdioCaseVerdict(False, result.status, "wrong output", result.stdout[:2000])
            )
    return StdioVerdict(sum(v.passed for v in verdicts), len(verdicts), verdicts)
