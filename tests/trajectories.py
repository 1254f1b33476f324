"""Trajectory builders for the tests: valid ``Trajectory`` records from token pieces, without a
model or an engine (import as ``from trajectories import trajectory_from_pieces``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agentrl import SamplingParams, Span, Trajectory

Piece = tuple[str, Sequence[int], int]
"""``(source, token_ids, turn)``: ``source`` is prompt, model, tool or template."""


def trajectory_from_pieces(
    pieces: Sequence[Piece], *, logprob: Callable[[int], float] = lambda i: -1.0, **fields: Any
) -> Trajectory:
    """A validated trajectory of ``pieces`` in order, one span each. Model tokens get loss mask 1
    and ``logprob(i)`` (``i`` the token's position, called in order), the rest mask 0 and no
    logprob. ``fields`` override the defaults (id ``t0``, env ``test-v0``, group ``g``, policy
    version 0, status done / stop, reward 1.0, default sampling)."""
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float | None] = []
    spans: list[Span] = []
    for source, ids, turn in pieces:
        start = len(token_ids)
        sampled = source == "model"
        for token in ids:
            logprobs.append(logprob(len(token_ids)) if sampled else None)
            token_ids.append(token)
            loss_mask.append(int(sampled))
        spans.append(Span(start, len(token_ids), source, turn))
    values: dict[str, Any] = {
        "id": "t0",
        "env": "test-v0",
        "task_id": "0",
        "group_id": "g",
        "policy_version": 0,
        "status": "done",
        "termination_reason": "stop",
        "reward": 1.0,
        "turn_rewards": [],
        "error": None,
        "sampling": SamplingParams(),
        "tokenizer_fingerprint": "test",
        **fields,
    }
    trajectory = Trajectory(
        token_ids=token_ids, loss_mask=loss_mask, logprobs=logprobs, spans=spans, **values
    )
    trajectory.validate()
    return trajectory
