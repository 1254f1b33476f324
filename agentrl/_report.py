"""Mask inspection views: what ``agentrl rollout --dry-run`` and ``agentrl inspect`` show.

Three views of the same trajectories, each showing exactly which tokens the learner trains on
(``loss_mask == 1``) and where every other token came from (prompt, template, tool output):

- :func:`render_terminal` -- the token stream coloured in the terminal (``_report_term.py``);
- :func:`write_html_report` -- one self-contained HTML file with a tooltip per token
  (``_report_html.py``);
- :func:`summarize` / :func:`render_summary` -- the numbers: tokens by source, rewards, pass
  rate, termination reasons, tool calls and their errors, throughput (this module).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

import msgspec

from ._report_html import write_html_report as write_html_report
from ._report_term import SOURCES, num_turns
from ._report_term import render_summary as render_summary
from ._report_term import render_terminal as render_terminal
from ._report_term import token_texts as token_texts
from ._types import Trajectory

__all__ = ["Summary", "render_summary", "render_terminal", "summarize", "write_html_report"]


class Summary(msgspec.Struct, kw_only=True, frozen=True):
    """Aggregate numbers over a set of trajectories. Shares are in ``[0, 1]``; a statistic over an
    empty set (no trajectories, no rewards, no timing) is ``None``."""

    trajectories: int
    total_tokens: int
    tokens_by_source: dict[str, int]
    """Token counts per span source: prompt, model, tool, template."""
    model_tokens: int
    """``sum(loss_mask)``: the tokens the learner trains on (equals the model-span count when
    every trajectory is valid)."""
    rewarded: int
    """Trajectories with a reward (errored ones may have none)."""
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
    positive_reward_rate: float | None
    """Share of all trajectories with ``reward > 0`` (no reward counts as not positive)."""
    pass_threshold: float
    pass_rate: float | None
    """Share of all trajectories with ``reward >= pass_threshold``."""
    statuses: dict[str, int]
    termination_reasons: dict[str, int]
    errors: dict[str, int]
    """Errored trajectories by ``"where:type"`` of their ``TrajectoryError``."""
    tool_calls: int
    tool_calls_ok: int
    tool_errors: dict[str, int]
    """Failed tool calls by ``error_kind``."""
    tool_call_rate: float | None
    """Share of trajectories with at least one tool call."""
    mean_turns: float | None
    elapsed_s: float | None
    generate_s: float
    """Sum of ``timing.generate_s`` over trajectories."""
    tokens_per_s: float | None
    """Model tokens per second: over ``elapsed_s`` when given (aggregate throughput), else over
    ``generate_s`` (per-stream rate: concurrent trajectories' generate times overlap)."""
    tokens_per_s_basis: Literal["elapsed", "generate"] | None


def _share(count: int, total: int) -> float | None:
    return count / total if total else None


def summarize(
    trajectories: Sequence[Trajectory],
    *,
    elapsed_s: float | None = None,
    pass_threshold: float = 1.0,
) -> Summary:
    """Aggregate ``trajectories`` into a :class:`Summary`.

    ``elapsed_s`` is the wall-clock time the whole set took; without it the token rate is
    computed from the trajectories' own generate times.
    """
    n = len(trajectories)
    by_source = dict.fromkeys(SOURCES, 0)
    for trajectory in trajectories:
        for source, count in trajectory.source_counts().items():
            by_source[source] += count
    model_tokens = sum(sum(t.loss_mask) for t in trajectories)
    rewards = [t.reward for t in trajectories if t.reward is not None]
    calls = [call for t in trajectories for call in t.tool_calls]
    generate_s = sum(t.timing.generate_s for t in trajectories)
    tokens_per_s: float | None = None
    basis: Literal["elapsed", "generate"] | None = None
    if elapsed_s is not None and elapsed_s > 0:
        tokens_per_s, basis = model_tokens / elapsed_s, "elapsed"
    elif elapsed_s is None and generate_s > 0:
        tokens_per_s, basis = model_tokens / generate_s, "generate"
    return Summary(
        trajectories=n,
        total_tokens=sum(len(t.token_ids) for t in trajectories),
        tokens_by_source=by_source,
        model_tokens=model_tokens,
        rewarded=len(rewards),
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        reward_min=min(rewards) if rewards else None,
        reward_max=max(rewards) if rewards else None,
        positive_reward_rate=_share(sum(r > 0 for r in rewards), n),
        pass_threshold=pass_threshold,
        pass_rate=_share(sum(r >= pass_threshold for r in rewards), n),
        statuses=dict(Counter(t.status for t in trajectories)),
        termination_reasons=dict(Counter(t.termination_reason for t in trajectories)),
        errors=dict(
            Counter(f"{t.error.where}:{t.error.type}" for t in trajectories if t.error is not None)
        ),
        tool_calls=len(calls),
        tool_calls_ok=sum(call.ok for call in calls),
        tool_errors=dict(Counter(c.error_kind or "unknown" for c in calls if not c.ok)),
        tool_call_rate=_share(sum(bool(t.tool_calls) for t in trajectories), n),
        mean_turns=sum(num_turns(t) for t in trajectories) / n if n else None,
        elapsed_s=elapsed_s,
        generate_s=generate_s,
        tokens_per_s=tokens_per_s,
        tokens_per_s_basis=basis,
    )
