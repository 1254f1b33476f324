"""Input-token, top-k and chosen-id logprobs of one request (a ``LogprobQuery``), collected by
the worker thread as the request's steps run.

Conventions are SGLang's. The logits at position ``p`` give the distribution of token ``p + 1``:
the reported input tokens ``input_ids[start:]`` get their logprobs from positions
``start .. len - 2`` (``log_softmax(logits)``, temperature 1), and the first reported token has
none (None), whatever ``start`` is. Output positions use the sampling distribution
(``log_softmax(logits / temperature)``, temperature 0 counting as 1), like the sampled tokens'
own logprobs.

Input logprobs need the logits of every reported position, so a request with ``start`` set
reuses cached KV for at most ``input_ids[:start]`` (the scheduler limits its prefix match, as
SGLang does) and computes the rest; if it loses its KV before its prefill ends (preemption), the
input part starts over with its recompute.
"""

from __future__ import annotations

import torch

from agentrl._types import LogprobDetails, LogprobQuery, TopLogprobs


class LogprobCollector:
    """Accumulates a ``LogprobDetails`` for one request of ``input_len`` context tokens."""

    def __init__(self, query: LogprobQuery, input_len: int) -> None:
        self.query = query
        self.input_len = input_len
        start = query.input_start
        self.wants_input = start is not None
        self._ids = torch.tensor(query.token_ids, dtype=torch.long) if query.token_ids else None
        self.reset_input()
        self.reset_output()

    @property
    def input_pending(self) -> bool:
        """True while input positions still need computing (the prefill has not ended)."""
        return self.wants_input and not self.input_done

    @property
    def input_positions(self) -> tuple[int, int]:
        """Positions ``[lo, hi)`` whose logits the input entries need."""
        start = self.query.input_start or 0
        return (start, self.input_len - 1) if self.input_pending else (0, 0)

    def reset_input(self) -> None:
        """Forget input entries (the request recomputes its prefill)."""
        self.input_done = False
        self.input_logprobs: list[float | None] = []
        self.input_top: list[TopLogprobs | None] = []
        self.input_token_ids: list[list[float] | None] = []

    def reset_output(self) -> None:
        self.output_top: list[TopLogprobs] = []
        self.output_token_ids: list[list[float]] = []

    def add_input(self, first: int, logits: torch.Tensor, tokens: list[int]) -> None:
        """Logits ``[n, vocab]`` of positions ``first .. first + n - 1`` (``tokens``: the whole
        context)."""
        if not self.wants_input or self.input_done or not len(logits):
            return
        lo, _ = self.input_positions
        assert first == lo + len(self.input_logprobs), "input positions out of order"
        logprobs = torch.log_softmax(logits, dim=-1)
        nxt = torch.tensor(tokens[first + 1 : first + 1 + len(logits)], dtype=torch.long)
        self.input_logprobs.extend(logprobs.gather(1, nxt.view(-1, 1)).view(-1).tolist())
        if self.query.top_k > 0:
            self.input_top.extend(self._top(logprobs))
        if self._ids is not None:
            self.input_token_ids.extend(logprobs[:, self._ids].tolist())

    def add_output(self, logits: torch.Tensor, temperature: float) -> None:
        """The distribution a token was sampled from (``logits``: ``[vocab]``, float32)."""
        self.input_done = True
        if self.query.top_k <= 0 and self._ids is None:
            return
        logprobs = torch.log_softmax(logits.view(1, -1) / (temperature or 1.0), dim=-1)
        if self.query.top_k > 0:
            self.output_top.extend(self._top(logprobs))
        if self._ids is not None:
            self.output_token_ids.extend(logprobs[:, self._ids].tolist())

    def _top(self, logprobs: torch.Tensor) -> list[TopLogprobs]:
        k = min(self.query.top_k, logprobs.shape[-1])
        values, indices = torch.topk(logprobs, k, dim=-1)
        return [
            list(zip(v, i, strict=True))
            for v, i in zip(values.tolist(), indices.tolist(), strict=True)
        ]

    def details(self, outputs: int | None = None) -> LogprobDetails:
        """What was collected; with ``outputs``, a snapshot of the first ``outputs`` output
        positions (new lists: the worker goes on appending to its own)."""
        query, start = self.query, self.query.input_start
        out = LogprobDetails(input_start=start)
        if start is not None:
            head: list[None] = [None] if start < self.input_len else []
            out.input_logprobs = head + self.input_logprobs
            if query.top_k > 0:
                out.input_top = [*head, *self.input_top]
            if self._ids is not None:
                out.input_token_ids = [*head, *self.input_token_ids]
        if query.top_k > 0:
            out.output_top = self.output_top if outputs is None else self.output_top[:outputs]
        if self._ids is not None:
            chosen = self.output_token_ids
            out.output_token_ids = chosen if outputs is None else chosen[:outputs]
        return out
