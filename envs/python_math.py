"""``python-math-v0``: math word problems solved with a Python tool that runs in a sandbox.

Tasks are generated deterministically from (split, seed, index) at six levels; most want a short
program (sums over ranges, primes, combinations, probabilities as fractions):

- level 0: a two-step purchase ("3 notebooks at $4 and 2 pens at $1.50")  → decimal
- level 1: what fraction of a pizza is left                               → fraction
- level 2: price after a percentage discount                             → decimal
- level 3: sums over ranges (squares, multiples of 3 or 5)               → integer
- level 4: primes below N, lcm of three numbers                          → integer
- level 5: binomial counts and dice probabilities                        → integer / fraction

The model calls ``run_python(code)`` as often as it likes (the program runs in the sandbox the
runtime provides; the tool returns status, stdout and stderr) and answers in ``\\boxed{}`` or
``<answer></answer>``. The reward is the math grader's verdict: equivalent forms count
(``0.375 == 3/8 == \\frac{3}{8}``). Three worked examples precede the task as chat turns.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from fractions import Fraction

import anyio.to_thread

import agentrl
from agentrl import Episode, Message, Reward, Task
from agentrl.sandboxes import RunRequest, SandboxRunner, extract_answer, grade_math

from ._sandbox import SandboxLease, format_run_result

SYSTEM_PROMPT = (
    "You are a careful math assistant. You can run Python code with the run_python tool; "
    "it returns what the program prints. When you know the final result, reply with it "
    "inside \\boxed{} (fractions like 3/8 are fine)."
)
# Worked examples, rendered as real chat turns before the task (as in calc-v0, where three
# such turns took SmolLM2-135M from 0 to about 40% valid tool calls).
FEWSHOT = (
    (
        "What is the sum of the cubes of the integers from 1 to 10?",
        "print(sum(i**3 for i in range(1, 11)))",
        "3025",
    ),
    (
        "Sam buys 3 books at $12 each and 4 pens at $2.50 each. How many dollars in total?",
        "print(3 * 12 + 4 * 2.50)",
        "46.0",
    ),
    (
        "A cake is cut into 8 equal slices and 3 are eaten. What fraction is left?",
        "from fractions import Fraction\nprint(Fraction(8 - 3, 8))",
        "5/8",
    ),
)
LEVELS = (0, 1, 2, 3, 4, 5)
PROGRAM_TIMEOUT_S = 5.0

_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun"]


def fewshot_messages() -> list[Message]:
    out: list[Message] = []
    for question, code, printed in FEWSHOT:
        call = {"name": "run_python", "arguments": {"code": code}}
        answer = printed.removesuffix(".0")
        out += [
            Message("user", question),
            Message("assistant", f"<tool_call>\n{json.dumps(call)}\n</tool_call>"),
            Message("tool", f"status: ok\nstdout:\n{printed}", name="run_python"),
            Message("assistant", f"The answer is \\boxed{{{answer}}}."),
        ]
    return out


def _fmt(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def _decimal(value: Fraction) -> str:
    """An exact decimal (the generators only make values with terminating expansions)."""
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")
    assert Fraction(text) == value, (text, value)
    return text


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[0:2] = b"\x00\x00"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))
    return sum(sieve)


def _make_task(split: str, seed: int, index: int, level: int) -> Task:
    rng = random.Random(f"python-math-v0/{split}/{seed}/{index}/{level}")
    name = rng.choice(_NAMES)
    if level == 0:
        a, pa, b = rng.randint(2, 9), rng.randint(2, 20), rng.randint(2, 9)
        pb = Fraction(rng.randint(1, 40), 4)
        prompt = (
            f"{name} buys {a} notebooks at ${pa} each and {b} pens at ${_decimal(pb)} each. "
            "How many dollars does that cost in total?"
        )
        answer = _decimal(a * pa + b * pb)
    elif level == 1:
        slices = rng.choice([6, 8, 10, 12, 16])
        x, y = rng.randint(1, slices // 2 - 1), rng.randint(1, slices // 2 - 1)
        prompt = (
            f"A pizza is cut into {slices} equal slices. {name} eats {x} slices and a friend "
            f"eats {y}. What fraction of the pizza is left?"
        )
        answer = _fmt(Fraction(slices - x - y, slices))
    elif level == 2:
        price, discount = rng.randint(20, 400), rng.choice([5, 10, 15, 20, 25, 30, 40, 50])
        prompt = (
            f"A jacket costs ${price}. It is sold at a {discount}% discount. "
            "What is the new price in dollars?"
        )
        answer = _decimal(Fraction(price * (100 - discount), 100))
    elif level == 3:
        n = rng.randint(20, 400)
        if rng.random() < 0.5:
            prompt = f"What is the sum of the squares of the integers from 1 to {n}?"
            answer = str(n * (n + 1) * (2 * n + 1) // 6)
        else:
            prompt = (
                f"What is the sum of all positive integers below {n} that are multiples of 3 or 5?"
            )
            answer = str(sum(i for i in range(n) if i % 3 == 0 or i % 5 == 0))
    elif level == 4:
        if rng.random() < 0.5:
            n = rng.randint(100, 5000)
            prompt = f"How many prime numbers are there below {n}?"
            answer = str(_primes_below(n))
        else:
            a, b, c = rng.randint(4, 30), rng.randint(4, 30), rng.randint(4, 30)
            prompt = f"What is the least common multiple of {a}, {b} and {c}?"
            answer = str(math.lcm(a, b, c))
    else:
        if rng.random() < 0.5:
            n = rng.randint(8, 30)
            k = rng.randint(2, min(6, n - 1))
            prompt = f"In how many ways can a team of {k} be chosen from {n} people?"
            answer = str(math.comb(n, k))
        else:
            target = rng.randint(3, 11)
            ways = sum(1 for i in range(1, 7) for j in range(1, 7) if i + j == target)
            prompt = (
                f"Two fair six-sided dice are rolled. What is the probability that the sum is "
                f"{target}? Give the answer as a fraction."
            )
            answer = _fmt(Fraction(ways, 36))
    return Task(id=f"{split}-L{level}-{seed}-{index}", prompt=prompt, answer=answer, level=level)


def _grade(text: str, answer: str) -> tuple[float, float]:
    """(correct, formatted) of a final message: the grader's verdict, and whether it marked an
    answer at all."""
    return grade_math(text, answer), 0.0 if extract_answer(text) is None else 1.0


@agentrl.env("python-math-v0", max_turns=6, max_new_tokens=256, tags=("math", "tools", "sandbox"))
class PythonMathEnv:
    """Math word problems with a sandboxed Python tool; answer in \\boxed{} or <answer>."""

    def __init__(
        self,
        levels: Sequence[int] = LEVELS,
        num_tasks: int = 1000,
        fewshot: bool = True,
        program_timeout_s: float = PROGRAM_TIMEOUT_S,
        memory_mb: int = 256,
        sandbox: SandboxRunner | None = None,
    ) -> None:
        bad = [lv for lv in levels if lv not in LEVELS]
        if bad or not levels:
            raise ValueError(f"python-math-v0: levels must be a non-empty subset of {LEVELS}")
        self.levels = tuple(levels)
        self.num_tasks = num_tasks
        self.fewshot = fewshot
        self.program_timeout_s = program_timeout_s
        self.memory_mb = memory_mb
        self.sandbox = SandboxLease(sandbox, env_id="python-math-v0")

    def tasks(self, split: str = "train", *, seed: int = 0) -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"python-math-v0: unknown split {split!r} (train or eval)")
        offset = 0 if split == "train" else 10**6
        return [
            _make_task(split, seed, offset + i, self.levels[i % len(self.levels)])
            for i in range(self.num_tasks)
        ]

    async def reset(self, task: Task) -> list[Message]:
        shots = fewshot_messages() if self.fewshot else []
        return [Message("system", SYSTEM_PROMPT), *shots, Message("user", task.prompt)]

    @agentrl.tool(timeout_s=60.0)
    async def run_python(self, code: str) -> str:
        """Run a Python 3 program in a sandbox and return its status, stdout and stderr.

        Args:
            code: The program. Print the values you want to see.
        """
        request = RunRequest(
            language="python",
            code=code,
            timeout_s=self.program_timeout_s,
            memory_mb=self.memory_mb,
            output_limit_bytes=64 * 1024,
        )
        return format_run_result(await self.sandbox.run(request))

    async def reward(self, episode: Episode) -> Reward:
        # The grader is bounded (one pass over the text, numbers capped) but pure CPU: it runs
        # in a worker thread, so the event loop never waits for it, and a reward deadline that
        # passes gives up on it (abandon_on_cancel) instead of waiting for it to return.
        correct, formatted = await anyio.to_thread.run_sync(
            _grade, episode.final_text, episode.task.answer, abandon_on_cancel=True
        )
        return Reward(total=correct, breakdown={"correct": correct, "format": formatted})

    async def close(self) -> None:
        self.sandbox.close()
