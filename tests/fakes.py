"""A scripted engine for state-machine tests: it replays fixed assistant texts, tokenized with
the real tokenizer, obeying stop ids, stop strings and max_new_tokens like a real engine.

It exists because the state machine's edge cases (malformed calls, cuts at max tokens, slow
turns under a fake clock) need exact, repeatable model outputs; real-engine tests cover the rest.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import anyio

from agentrl._errors import EngineError
from agentrl._types import GenerateResult, SamplingParams


class ScriptedEngine:
    def __init__(
        self,
        tokenizer,
        replies: Sequence[str],
        *,
        delay_s: float = 0.0,
        max_context: int = 8192,
        fail_on_call: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.delay_s = delay_s
        self._max_context = max_context
        self.fail_on_call = fail_on_call
        self.calls: list[list[int]] = []
        self.sessions: set[str] = set()
        self._ids = itertools.count()
        self.weight_version = 7

    @property
    def max_context(self) -> int:
        return self._max_context

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> GenerateResult:
        if session is not None and session not in self.sessions:
            raise EngineError(f"unknown session {session}")
        call = len(self.calls)
        self.calls.append(list(input_ids))
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        if self.fail_on_call is not None and call == self.fail_on_call:
            raise EngineError("scripted failure")
        text = self.replies[min(call, len(self.replies) - 1)]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        out: list[int] = []
        finish, matched = "length", None
        for tok in ids:
            if len(out) >= sampling.max_new_tokens:
                break
            out.append(tok)
            if tok in sampling.stop_token_ids:
                finish, matched = "stop", tok
                break
            decoded = self.tokenizer.decode(out)
            hit = next((s for s in sampling.stop if s in decoded), None)
            if hit is not None:
                finish, matched = "stop", hit
                break
        else:
            if len(out) < sampling.max_new_tokens:
                finish = "stop"  # scripted text ran out: treat as an EOS-less stop
        return GenerateResult(
            token_ids=out,
            logprobs=[-0.5] * len(out),
            finish_reason=finish,
            matched_stop=matched,
            prompt_tokens=len(input_ids),
            weight_version=self.weight_version,
        )

    async def open_session(self, capacity_tokens: int | None = None) -> str:
        sid = f"s{next(self._ids)}"
        self.sessions.add(sid)
        return sid

    async def close_session(self, session_id: str) -> None:
        self.sessions.discard(session_id)

    async def update_weights(self, version, source) -> None:
        self.weight_version = version

    async def aclose(self) -> None:
        return None
