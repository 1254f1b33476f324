"""Math answer grader: pure Python, no sandbox, never raises.

``grade_math(response, expected)`` finds the final answer in a model's text (the last
``<answer>…</answer>``, else the last ``\\boxed{…}``) and compares it with the expected answer.
Both sides are parsed into exact rationals, so equivalent forms compare equal::

    0.5 == 1/2 == \\frac{1}{2} == \\dfrac{1}{2} == $\\boxed{\\frac12}$ == 50%
    1,234 == 1234      -3 == \\left(-3\\right) == −3      x = 5 == 5      12 apples == 12

Accepted: integers, decimals, scientific notation, fractions ``a/b``, ``\\frac``/``\\dfrac``/
``\\tfrac`` (nested), ``\\boxed{}``, ``$…$``/``\\(…\\)``, ``\\left``/``\\right``, thousands
separators (``1,234``, ``1{,}234``, ``1\\,234``), unicode minus, ``\\cdot``/``\\times``/``\\div``,
``^`` powers with small integer exponents, a trailing unit word or ``\\text{…}``, and
percentages (``50%`` matches 50 and 0.5). A decimal the model rounded to at least two places
matches an expected value that is not exactly representable (``0.33`` for 1/3) when
``allow_rounding``. Anything that is not a number falls back to a normalized string comparison;
garbage is simply "not equal".
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

MAX_ANSWER_CHARS = 1000
_MAX_EXPONENT = 64
_MAX_DIGITS = 400

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_THOUSANDS_RE = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])")
_UNIT_TAIL_RE = re.compile(r"^(.*?\d\)?)\s*[A-Za-z][A-Za-z .]*$")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the ``{…}`` group opening at ``text[start]`` and the index after it."""
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


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``) with balanced braces."""
    best = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        group = _braced(text, match.end())
        if group is not None:
            best = group[0]
    return best


def extract_answer(text: str) -> str | None:
    """The final answer in a model's response: the last ``<answer>`` tag, else the last
    ``\\boxed{}``; ``None`` when there is neither."""
    try:
        tags = _ANSWER_TAG_RE.findall(text)
        if tags:
            return tags[-1].strip()
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
        value = left ** int(right)
    else:
        raise ValueError(f"unsupported operator {type(op).__name__}")
    if len(str(value.numerator)) > _MAX_DIGITS or len(str(value.denominator)) > _MAX_DIGITS:
        raise ValueError("number too large")
    return value


_NUMBER_RE = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _parse_expression(text: str) -> Fraction:
    """Exact value of an arithmetic expression; numbers are read from their text (no floats)."""
    if not text or len(text) > MAX_ANSWER_CHARS:
        raise ValueError("empty or too long")
    if not re.fullmatch(r"[0-9eE.+\-*/() ]+", text):
        raise ValueError("not arithmetic")
    numbers: list[Fraction] = []

    def name(match: re.Match[str]) -> str:
        numbers.append(Fraction(match.group(0)))
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


def _rounds_to(got_text: str, got: Fraction, want: Fraction) -> bool:
    """Is ``got`` the decimal ``want`` rounded to the places the model wrote (at least 2)?"""
    match = re.search(r"\.(\d+)\s*%?\s*$", got_text)
    if match is None or len(match.group(1)) < 2:
        return False
    places = len(match.group(1))
    scale = Fraction(10) ** places
    if (want * scale).denominator == 1:
        return False  # exactly representable: the model must give it exactly
    return abs(want - got) * scale <= Fraction(1, 2)


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
            got_values = {g, g / 100} if g_pct else {g}
            want_values = {w, w / 100} if w_pct else {w}
            if got_values & want_values:
                return True
            if allow_rounding:
                stripped = _latex_to_ascii(got)[0]
                return any(_rounds_to(stripped, gv, wv) for gv in got_values for wv in want_values)
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
