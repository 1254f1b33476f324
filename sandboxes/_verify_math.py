"""Math answer grader: pure Python, no sandbox, never raises.

``grade_math(response, expected)`` finds the final answer in a model's text (the last
``<answer>…</answer>``: the last opening tag that a closing tag follows, up to the first closing
tag after it, any case; else the last ``\\boxed{…}`` whose braces balance) and compares it with
the expected answer. Finding it is one pass over the text, whatever the text.
Both sides are parsed into exact rationals, so equivalent forms compare equal::

    0.5 == 1/2 == \\frac{1}{2} == \\dfrac{1}{2} == $\\boxed{\\frac12}$ == 50%
    1,234 == 1234      -3 == \\left(-3\\right) == −3      x = 5 == 5      12 apples == 12

Accepted: integers, decimals, scientific notation, fractions ``a/b``, ``\\frac``/``\\dfrac``/
``\\tfrac`` (nested), ``\\boxed{}``, ``$…$``/``\\(…\\)``, ``\\left``/``\\right``, thousands
separators (``1,234``, ``1{,}234``, ``1\\,234``), unicode minus, ``\\cdot``/``\\times``/``\\div``,
``^`` powers with small integer exponents, a trailing unit word or ``\\text{…}``, and
percentages (``50%`` matches 50 and 0.5). A number written with more than ``MAX_DIGITS``
digits or an exponent beyond ±``MAX_DIGITS`` is not a number (refused from its text, before
any arithmetic), nor is an expression that would compute a numerator or denominator of more
than ``MAX_DIGITS`` digits.

Rounding (``allow_rounding``, on by default): a decimal the model wrote matches an expected
value it does not equal only when all of these hold —

- the expected value has no terminating decimal expansion (its reduced denominator has a prime
  factor other than 2 and 5: 1/3, 5/36 — never 1/8 or 3.14159, which must be given exactly);
- the answer is one decimal number with at least two decimal places (``0.33``, ``-0.6667``);
- it is not zero and has at least two significant digits (``0.00`` and ``0.004`` round nothing);
- it is within half a unit of its last place: ``|answer - expected| <= 0.5 * 10**-places``.

A percentage keeps its own places when read as a fraction: ``33.33%`` is 0.3333 (four places)
and matches 1/3, ``33.00%`` does not. (``0.33%`` matches 1/3 through the percent rule, exactly
as ``0.33`` does: the window is never wider than the places written.)

Anything that is not a number falls back to a normalized string comparison; garbage is simply
"not equal".
"""

from __future__ import annotations

import ast
import re
from collections import deque
from fractions import Fraction

MAX_ANSWER_CHARS = 1000
MAX_DIGITS = 400
"""The most digits a number may be written with, the largest exponent magnitude it may have,
and the most digits of any numerator or denominator an expression computes."""
_MAX_EXPONENT = 64

_OPEN_TAG_RE = re.compile(r"<answer>", re.IGNORECASE)
_CLOSE_TAG_RE = re.compile(r"</answer>", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_BRACE_RE = re.compile(r"[{}]")
_THOUSANDS_RE = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])")
_UNIT_TAIL_RE = re.compile(r"^(.*?\d\)?)\s*[A-Za-z][A-Za-z .]*$")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the ``{…}`` group opening at ``text[start]`` and the index after it.
    A scan to the group's end: used on answers (at most ``MAX_ANSWER_CHARS``), never on a
    whole response."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """For each ``{`` with a matching ``}``, the index of that ``}``: one pass with a stack."""
    closing: dict[int, int] = {}
    opened: list[int] = []
    for match in _BRACE_RE.finditer(text):
        if match.group() == "{":
            opened.append(match.start())
        elif opened:
            closing[opened.pop()] = match.start()
    return closing


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``) with balanced braces; linear in
    the text (the braces are matched once, not scanned again from every box)."""
    closing = _closing_braces(text)
    best = None
    for match in _BOXED_RE.finditer(text):
        end = closing.get(match.end())
        if end is not None:
            best = (match.end() + 1, end)
    return text[best[0] : best[1]] if best else None


def _last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>`` that a ``</answer>`` follows, up to the first
    ``</answer>`` after it; each tag is looked for once (a lazy ``<answer>(.*?)</answer>`` tries
    every opening tag against the rest of the text: quadratic on ``"<answer>" * n``)."""
    last_close = deque(_CLOSE_TAG_RE.finditer(text), maxlen=1)
    if not last_close:
        return None
    opening = deque(_OPEN_TAG_RE.finditer(text, 0, last_close[0].start()), maxlen=1)
    if not opening:
        return None
    close = _CLOSE_TAG_RE.search(text, opening[0].end())
    assert close is not None  # the last closing tag follows it
    return text[opening[0].end() : close.start()]


def extract_answer(text: str) -> str | None:
    """The final answer in a model's response: the last ``<answer>`` tag, else the last
    ``\\boxed{}``; ``None`` when there is neither."""
    try:
        tag = _last_answer_tag(text)
        if tag is not None:
            return tag.strip()
        return _last_boxed(text)
    except Exception:
        return None


def _frac_to_ascii(text: str) -> str:
    """``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``, ``\\frac12``) → ``((a)/(b))``, nested."""
    out = []
    i = 0
    pattern = re.compile(r"\\[dt]?frac\s*")
    while True:
        match = pattern.search(text, i)
        if match is None:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i : match.start()])
        j = match.end()
        args = []
        for _ in range(2):
            while j < len(text) and text[j] == " ":
                j += 1
            group = _braced(text, j)
            if group is not None:
                args.append(_frac_to_ascii(group[0]))
                j = group[1]
            elif j < len(text) and text[j].isalnum():
                args.append(text[j])  # \frac12: single-character arguments
                j += 1
            else:
                raise ValueError("malformed \\frac")
        out.append(f"(({args[0]})/({args[1]}))")
        i = j


def _strip_wrappers(text: str) -> str:
    text = text.strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        text = boxed
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left + right):
            text = text[len(left) : len(text) - len(right)].strip()
    return text.strip().rstrip(".").strip()


def _latex_to_ascii(text: str) -> tuple[str, bool]:
    """Rewrite simple LaTeX into an arithmetic expression; also whether it was a percentage."""
    text = _strip_wrappers(text).replace("$", "")
    text = re.sub(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}", r" \1 ", text)
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", " "),
        ("{,}", ","),
        ("\\cdot", "*"),
        ("\\times", "*"),
        ("\\div", "/"),
        ("\\%", "%"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("°", ""),
        ("−", "-"),  # unicode minus
        ("×", "*"),
        ("÷", "/"),
        ("\u2009", ""),
        ("\u202f", ""),
    ):
        text = text.replace(old, new)
    text = _frac_to_ascii(text)
    if "=" in text:  # "x = 5" → "5"
        text = text.rsplit("=", 1)[1]
    text = text.strip()
    percent = text.endswith("%")
    if percent:
        text = text[:-1].strip()
    unit = _UNIT_TAIL_RE.match(text)  # "12 apples", "5 dollars"
    if unit and not re.search(r"[A-Za-z]", unit.group(1)):
        text = unit.group(1)
    text = _THOUSANDS_RE.sub(lambda m: m.group(0).replace(",", ""), text)
    text = text.replace("{", "(").replace("}", ")").replace("^", "**")
    return text, percent


def _apply(op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    """One exact arithmetic step, refusing huge results and huge exponents."""
    if isinstance(op, ast.Add):
        value = left + right
    elif isinstance(op, ast.Sub):
        value = left - right
    elif isinstance(op, ast.Mult):
        value = left * right
    elif isinstance(op, ast.Div):
        if right == 0:
            raise ValueError("division by zero")
        value = left / right
    elif isinstance(op, ast.Pow):
        if right.denominator != 1 or abs(right) > _MAX_EXPONENT or (left == 0 and right < 0):
            raise ValueError("unsupported exponent")
        bits = max(left.numerator.bit_length(), left.denominator.bit_length())
        if bits * abs(int(right)) > 4 * MAX_DIGITS + 64:  # estimated before it is computed
            raise ValueError("number too large")
        value = left ** int(right)
    else:
        raise ValueError(f"unsupported operator {type(op).__name__}")
    if len(str(value.numerator)) > MAX_DIGITS or len(str(value.denominator)) > MAX_DIGITS:
        raise ValueError("number too large")
    return value


_NUMBER_RE = re.compile(r"(?:(\d+)\.?(\d*)|\.(\d+))(?:[eE]([+-]?\d+))?")


def _number(match: re.Match[str]) -> Fraction:
    """The exact value of one number of ``_NUMBER_RE``. Its digits and exponent are read from
    the text and refused past ``MAX_DIGITS`` before anything is computed:
    ``Fraction("1e999999999")`` would compute 10**999999999 (hours, holding the GIL)."""
    whole, fraction, fraction_only, exponent = match.groups()
    fraction = fraction or fraction_only or ""
    digits = (whole or "") + fraction
    if len(digits) > MAX_DIGITS:
        raise ValueError("too many digits")
    power = 0
    if exponent:
        magnitude = exponent.lstrip("+-").lstrip("0") or "0"
        if len(magnitude) > len(str(MAX_DIGITS)) or int(magnitude) > MAX_DIGITS:
            raise ValueError("exponent too large")
        power = -int(magnitude) if exponent.startswith("-") else int(magnitude)
    power -= len(fraction)
    mantissa = int(digits)
    return Fraction(mantissa * 10**power) if power >= 0 else Fraction(mantissa, 10**-power)


def _parse_expression(text: str) -> Fraction:
    """Exact value of an arithmetic expression; numbers are read from their text (no floats)."""
    if not text or len(text) > MAX_ANSWER_CHARS:
        raise ValueError("empty or too long")
    if not re.fullmatch(r"[0-9eE.+\-*/() ]+", text):
        raise ValueError("not arithmetic")
    numbers: list[Fraction] = []

    def name(match: re.Match[str]) -> str:
        numbers.append(_number(match))
        return f" _n{len(numbers) - 1} "

    tree = ast.parse(_NUMBER_RE.sub(name, text).strip(), mode="eval")

    def evaluate(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return evaluate(node.body)
        if isinstance(node, ast.Name) and re.fullmatch(r"_n\d+", node.id):
            return numbers[int(node.id[2:])]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = evaluate(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            return _apply(node.op, evaluate(node.left), evaluate(node.right))
        raise ValueError(f"unsupported element {type(node).__name__}")

    return evaluate(tree)


def parse_number(text: str) -> tuple[Fraction, bool] | None:
    """``(value, is_percent)`` for a numeric answer written in any supported form, else None."""
    try:
        if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
            return None
        expression, percent = _latex_to_ascii(text)
        return _parse_expression(expression), percent
    except Exception:  # garbage is "not a number", never an error
        return None


def _normalize_text(text: str) -> str:
    text = _strip_wrappers(text)
    text = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\s*\{([^{}]*)\}", r"\1", text)
    for old in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", " ", "\n", "\t"):
        text = text.replace(old, "")
    return text.lower()


_DECIMAL_RE = re.compile(r"[+-]?(\d*)\.(\d+)")


def _terminates(value: Fraction) -> bool:
    """Whether ``value`` has a terminating decimal expansion (a denominator of 2s and 5s)."""
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    return denominator == 1


def _rounds_to(written: str, got: Fraction, want: Fraction, shift: int = 0) -> bool:
    """Is ``got`` — the decimal ``written``, divided by ``10**shift`` (2 for a percentage read
    as a fraction) — ``want`` rounded to the places written? Only for a ``want`` with no
    terminating expansion, at least two places and two significant digits written, and a
    non-zero ``got`` within half a unit of its last place."""
    match = _DECIMAL_RE.fullmatch(written.strip())
    if match is None or len(match.group(2)) < 2 or got == 0 or _terminates(want):
        return False
    if len((match.group(1) + match.group(2)).lstrip("0")) < 2:
        return False
    places = len(match.group(2)) + shift
    return abs(want - got) * 10**places <= Fraction(1, 2)


def answers_match(got: str, want: str, *, allow_rounding: bool = True) -> bool:
    """Do two answers denote the same value (or, when not numeric, the same normalized text)?"""
    try:
        if not isinstance(got, str) or not isinstance(want, str):
            return False
        if len(got) > MAX_ANSWER_CHARS or not got.strip():
            return False
        parsed_got, parsed_want = parse_number(got), parse_number(want)
        if parsed_got is not None and parsed_want is not None:
            (g, g_pct), (w, w_pct) = parsed_got, parsed_want
            got_values = {g: 0, g / 100: 2} if g_pct else {g: 0}  # value -> places it adds
            want_values = {w, w / 100} if w_pct else {w}
            if got_values.keys() & want_values:
                return True
            if allow_rounding:
                written = _latex_to_ascii(got)[0]
                return any(
                    _rounds_to(written, value, wv, shift)
                    for value, shift in got_values.items()
                    for wv in want_values
                )
            return False
        if parsed_got is not None or parsed_want is not None:
            return False
        normalized = _normalize_text(got)
        return bool(normalized) and normalized == _normalize_text(want)
    except Exception:
        return False


def grade_math(response: str, expected: str, *, allow_rounding: bool = True) -> float:
    """1.0 when the final answer in ``response`` equals ``expected``, else 0.0 (never raises)."""
    answer = extract_answer(response) if isinstance(response, str) else None
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, expected, allow_rounding=allow_rounding) else 0.0
