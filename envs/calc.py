"""``calc-v0``: multi-turn arithmetic word problems with a calculator tool.

Tasks are generated deterministically from (split, seed, index). Difficulty levels start easy
enough that a 135M model sometimes succeeds:

- level 0: one operation on one-digit numbers ("What is 3 + 4?")
- level 1: one addition/subtraction on two-digit numbers, phrased as a short story
- level 2: one multiplication of a two-digit by a one/two-digit number (wants the calculator)
- level 3: two steps (multiply then add/subtract)
- level 4: three steps including an exact division

The model calls ``calculator`` as often as it likes and answers in ``<answer>…</answer>``.
Three worked examples precede the task as chat turns (``fewshot=False`` drops them).
Reward 1.0 for the exact final number; optional format credit (off by default).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Sequence
from fractions import Fraction

import agentrl
from agentrl import Episode, Message, Reward, Task

SYSTEM_PROMPT = (
    "You are a careful math assistant. Use the calculator tool for arithmetic. "
    "When you know the final result, reply with it inside <answer></answer> tags."
)

# Worked examples, rendered as real chat turns before the task (prompt tokens, loss mask 0):
# a 135M model never trained on tool calls imitates turns far better than a description.
# Measured on SmolLM2-135M (docs/benchmarks.md): 0 valid calls in 30 samples with one example
# written inside the system prompt; about 40% with these three turns.
FEWSHOT = (
    ("What is 12 * 7?", "12 * 7", "84"),
    ("Tom has 25 cards and buys 17 more. How many cards now?", "25 + 17", "42"),
    ("Mia has 9 bags with 14 pens each. How many pens in total?", "9 * 14", "126"),
)


def fewshot_messages() -> list[Message]:
    out: list[Message] = []
    for question, expression, result in FEWSHOT:
        call = {"name": "calculator", "arguments": {"expression": expression}}
        out += [
            Message("user", question),
            Message("assistant", f"<tool_call>\n{json.dumps(call)}\n</tool_call>"),
            Message("tool", result, name="calculator"),
            Message("assistant", f"<answer>{result}</answer>"),
        ]
    return out


_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun"]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stamps", "cards", "shells"]
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
LEVELS = (0, 1, 2, 3, 4)


def _make_task(split: str, seed: int, index: int, level: int) -> Task:
    rng = random.Random(f"calc-v0/{split}/{seed}/{index}/{level}")
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if level == 0:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        op = rng.choice(["+", "-", "*"])
        if op == "-" and b > a:
            a, b = b, a
        prompt = f"What is {a} {op} {b}?"
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    elif level == 1:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            prompt = f"{name} has {a} {item} and finds {b} more. How many {item} now?"
            answer = a + b
        else:
            a, b = max(a, b), min(a, b)
            prompt = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
            answer = a - b
    elif level == 2:
        a, b = rng.randint(12, 99), rng.randint(3, 30)
        prompt = f"{name} buys {b} boxes with {a} {item} each. How many {item} in total?"
        answer = a * b
    elif level == 3:
        a, b, c = rng.randint(12, 60), rng.randint(3, 20), rng.randint(5, 99)
        prompt = (
            f"{name} packs {b} bags of {a} {item} and then sells {c} of them. "
            f"How many {item} are left?"
        )
        answer = a * b - c
    else:
        per, groups, extra = rng.randint(3, 12), rng.randint(4, 15), rng.randint(10, 90)
        total = per * groups
        prompt = (
            f"{name} shares {total} {item} equally among {groups} friends, then each friend "
            f"gets {extra} more. Three friends put their {item} together. How many is that?"
        )
        answer = (total // groups + extra) * 3
    return Task(
        id=f"{split}-L{level}-{seed}-{index}", prompt=prompt, answer=str(answer), level=level
    )


MAX_BITS = 4096
"""Every number an expression computes (each numerator and denominator, intermediate results
included) fits in this many bits (about 1233 decimal digits): big-integer arithmetic holds the
GIL, so an unbounded ``((9**64)**64)**64)**16`` would freeze the whole process for seconds."""


def _bits(value: Fraction) -> int:
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _bounded(value: Fraction) -> Fraction:
    if _bits(value) > MAX_BITS:
        raise ValueError(f"a result exceeds {MAX_BITS} bits")
    return value


def safe_eval(expression: str) -> Fraction:
    """Evaluate +, -, *, /, //, %, ** and parentheses over numbers, exactly (fractions). Every
    intermediate result is bounded (``MAX_BITS``); a power is refused before it is computed when
    its result would pass the bound."""
    if len(expression) > 200:
        raise ValueError("expression is longer than 200 characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}") from exc

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return _bounded(Fraction(str(node.value)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1 or abs(right) > 64:
                    raise ValueError("exponents must be integers with |n| <= 64")
                if _bits(left) * abs(right) > MAX_BITS + 64:  # estimated before computing it
                    raise ValueError(f"a result exceeds {MAX_BITS} bits")
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise ValueError("division by zero")
            if isinstance(node.op, ast.Div):
                return _bounded(left / right)
            return _bounded(Fraction(_OPS[type(node.op)](left, right)))
        raise ValueError(f"unsupported expression element: {type(node).__name__}")

    return ev(tree)


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    as_float = float(value)
    return f"{as_float:.10g}"


MAX_DIGITS = 1233
"""The most digits (and the largest exponent magnitude) an answer's number may be written with:
about ``MAX_BITS`` in decimal. Checked on the text, before a Fraction is made:
``Fraction("1e999999999")`` would compute 10**999999999 (hours, holding the GIL)."""
_NUMBER_RE = re.compile(r"[+-]?(?:(\d+)\.?(\d*)|\.(\d+))(?:[eE]([+-]?\d+))?", re.ASCII)
_INTEGER_RE = re.compile(r"[+-]?\d+", re.ASCII)


def final_answer(text: str) -> str | None:
    """The content of the first ``<answer>…</answer>`` (stripped), or None. Two scans: the first
    opening tag, then the first closing tag after it (a lazy regex tries every opening tag
    against the rest of the text: quadratic on ``"<answer>" * n``)."""
    start = text.find("<answer>")
    if start < 0:
        return None
    end = text.find("</answer>", start + len("<answer>"))
    return None if end < 0 else text[start + len("<answer>") : end].strip()


def parse_number(text: str) -> Fraction | None:
    """An integer, decimal (scientific notation too) or ``a/b`` answer, exactly; None for
    anything else, and for a number with more than ``MAX_DIGITS`` digits or exponent."""
    text = text.strip().replace(",", "").rstrip(".")
    try:
        if "/" in text:
            num, den = (part.strip() for part in text.split("/", 1))
            if not all(_INTEGER_RE.fullmatch(p) and len(p) <= MAX_DIGITS for p in (num, den)):
                return None
            return Fraction(int(num), int(den))
        match = _NUMBER_RE.fullmatch(text)
        if match is None:
            return None
        whole, fraction, fraction_only, exponent = match.groups()
        if len((whole or "") + (fraction or fraction_only or "")) > MAX_DIGITS:
            return None
        if exponent:
            magnitude = exponent.lstrip("+-").lstrip("0")
            if len(magnitude) > len(str(MAX_DIGITS)) or int(magnitude or 0) > MAX_DIGITS:
                return None
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


@agentrl.env("calc-v0", max_turns=4, max_new_tokens=96, tags=("math", "tools"))
class CalcEnv:
    """Arithmetic word problems with a calculator tool; answer in <answer></answer>."""

    def __init__(
        self,
        levels: Sequence[int] = LEVELS,
        num_tasks: int = 1000,
        format_reward: float = 0.0,
        fewshot: bool = True,
    ) -> None:
        bad = [lv for lv in levels if lv not in LEVELS]
        if bad or not levels:
            raise ValueError(f"calc-v0: levels must be a non-empty subset of {LEVELS}, got {bad}")
        self.levels = tuple(levels)
        self.num_tasks = num_tasks
        self.format_reward = format_reward
        self.fewshot = fewshot

    def tasks(self, split: str = "train", *, seed: int = 0) -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"calc-v0: unknown split {split!r} (train or eval)")
        offset = 0 if split == "train" else 10**6  # eval tasks never collide with train tasks
        return [
            _make_task(split, seed, offset + i, self.levels[i % len(self.levels)])
            for i in range(self.num_tasks)
        ]

    async def reset(self, task: Task) -> list[Message]:
        shots = fewshot_messages() if self.fewshot else []
        return [Message("system", SYSTEM_PROMPT), *shots, Message("user", task.prompt)]

    @agentrl.tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 3) * 4".
        """
        return format_number(safe_eval(expression))

    async def reward(self, episode: Episode) -> Reward:
        answer = final_answer(episode.final_text)
        formatted = 0.0 if answer is None else 1.0
        correct = 0.0
        if answer is not None:
            got = parse_number(answer)
            want = parse_number(episode.task.answer)
            correct = 1.0 if got is not None and got == want else 0.0
        total = correct + (self.format_reward * formatted if correct == 0.0 else 0.0)
        return Reward(total=total, breakdown={"correct": correct, "format": formatted})

    async def close(self) -> None:
        return None
