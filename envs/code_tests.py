"""``code-tests-v0``: write a Python function; a tool runs the visible tests; hidden tests score.

Each task (``_code_tasks.py``, 21 shipped as literals) describes one function with its
signature and a few visible tests. The model may call ``run_tests(code)`` as often as it likes:
the code runs in the sandbox the runtime provides against the **visible** tests, and the tool
returns a line per test (expected vs got, exceptions, the program's output). The final answer
is the last ```` ```python ```` block of the model's last message (else the code of its last
``run_tests`` call). The reward is the fraction of **hidden** tests that code passes, judged by
the unit-test harness (``agentrl.sandboxes.run_unit_tests``): expected values never enter the
sandbox, so exiting early, patching the runner or printing a fake summary scores 0.

A sandbox failure (not the model's fault) raises ``agentrl.SandboxError`` from ``reward``, so the
trajectory is recorded as an error rather than as a misleading 0.
"""

from __future__ import annotations

import json
import random
import re

import agentrl
from agentrl import Episode, Message, Reward, SandboxError, Task
from agentrl.sandboxes import (
    SandboxRunner,
    UnitTest,
    UnitTestReport,
    render_report,
    run_unit_tests,
)

from ._code_tasks import TASKS, CodeTask
from ._sandbox import SandboxLease

SYSTEM_PROMPT = (
    "You are a careful Python programmer. Write the requested function. You can check your "
    "code against the example tests with the run_tests tool (pass the complete code). When "
    "you are done, reply with the final code in one ```python code block."
)
_CODE_BLOCK_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_BY_ID = {f"code-{t.name}": t for t in TASKS}
EVAL_EVERY = 5
"""Every fifth task (by position) is in the eval split; the others are train."""


def task_prompt(task: CodeTask) -> str:
    examples = "\n".join(f"    {t.call} == {t.expected!r}" for t in task.visible if not t.raises)
    return f"Write a Python function `{task.signature}`.\n{task.description}\nExamples:\n{examples}"


def extract_code(text: str) -> str | None:
    """The last fenced code block of a message, or None."""
    blocks = _CODE_BLOCK_RE.findall(text or "")
    return blocks[-1] if blocks else None


def fewshot_messages() -> list[Message]:
    code = "def square(x):\n    return x * x\n"
    call = {"name": "run_tests", "arguments": {"code": code}}
    return [
        Message(
            "user",
            "Write a Python function `def square(x: int) -> int`.\n"
            "Return x squared.\nExamples:\n    square(3) == 9",
        ),
        Message("assistant", f"<tool_call>\n{json.dumps(call)}\n</tool_call>"),
        Message("tool", "1/1 tests passed\nPASS square(3)", name="run_tests"),
        Message("assistant", f"```python\n{code}```"),
    ]


@agentrl.env("code-tests-v0", max_turns=6, max_new_tokens=512, tags=("code", "tools", "sandbox"))
class CodeTestsEnv:
    """Write a function; ``run_tests`` runs visible tests; reward = hidden tests passed."""

    def __init__(
        self,
        fewshot: bool = True,
        timeout_s: float = 10.0,
        per_test_timeout_s: float = 2.0,
        memory_mb: int = 256,
        sandbox: SandboxRunner | None = None,
    ) -> None:
        self.fewshot = fewshot
        self.timeout_s = timeout_s
        self.per_test_timeout_s = per_test_timeout_s
        self.memory_mb = memory_mb
        self.sandbox = SandboxLease(sandbox, env_id="code-tests-v0")
        self.task: CodeTask | None = None
        self.last_submitted: str | None = None

    def tasks(self, split: str = "train", *, seed: int = 0) -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"code-tests-v0: unknown split {split!r} (train or eval)")
        chosen = [
            t
            for i, t in enumerate(TASKS)
            if (i % EVAL_EVERY == EVAL_EVERY - 1) == (split == "eval")
        ]
        random.Random(f"code-tests-v0/{split}/{seed}").shuffle(chosen)
        return [
            Task(id=f"code-{t.name}", prompt=task_prompt(t), meta={"function": t.name})
            for t in chosen
        ]

    async def reset(self, task: Task) -> list[Message]:
        self.task = _BY_ID[task.id]
        shots = fewshot_messages() if self.fewshot else []
        return [Message("system", SYSTEM_PROMPT), *shots, Message("user", task.prompt)]

    async def _run(self, code: str, tests: tuple[UnitTest, ...]) -> UnitTestReport:
        return await run_unit_tests(
            self.sandbox,
            code,
            list(tests),
            timeout_s=self.timeout_s,
            per_test_timeout_s=self.per_test_timeout_s,
            memory_mb=self.memory_mb,
        )

    @agentrl.tool(timeout_s=90.0)
    async def run_tests(self, code: str) -> str:
        """Run the example tests against your code and report each result.

        Args:
            code: The complete Python code defining the function.
        """
        if self.task is None:
            raise SandboxError("code-tests-v0: run_tests before reset")
        self.last_submitted = code
        report = await self._run(code, self.task.visible)
        if report.infrastructure_failed:
            raise SandboxError(f"the sandbox failed: {report.error}")
        return render_report(report)

    async def reward(self, episode: Episode) -> Reward:
        task = _BY_ID.get(getattr(episode.task, "id", ""))
        code = extract_code(episode.final_text) or self.last_submitted
        if task is None or not code:
            return Reward(total=0.0, breakdown={"hidden_pass_rate": 0.0, "has_code": 0.0})
        report = await self._run(code, task.hidden)
        if report.infrastructure_failed:
            raise SandboxError(f"code-tests-v0: the sandbox failed while scoring: {report.error}")
        return Reward(
            total=report.fraction,
            breakdown={"hidden_pass_rate": report.fraction, "has_code": 1.0},
        )

    async def close(self) -> None:
        self.sandbox.close()
