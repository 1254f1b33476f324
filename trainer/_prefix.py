"""Shared-prefix packing: a GRPO group's prompt is computed once per micro-batch, not G times.

The samples of one group share their prompt ids (the rollout renders it once). With calc-v0's
few-shot prompt (~490 tokens) and ~65 sampled tokens per sample, plain packing spends ~88% of
the learner's compute re-running the same prompt G times. Here each group becomes one *unit*
in a packed row::

    [ prefix: x[0 .. k-1] ][ suffix 1: x1[k .. L1-1] ][ suffix 2: x2[k .. L2-1] ] ...

``k`` is the longest run of leading positions that are identical in every member and carry no
loss (so ``k <= s - 1`` for the first sampled token ``s``: the position that predicts it, whose
target differs per member, is in every suffix). Position ids continue from ``k`` in each
suffix; a suffix attends to its prefix and causally to itself (``PackedBatch.segment_*``, read
by ``_attention``'s varlen path), so every position sees exactly the context it has in its own
sequence: log-probs and gradients equal plain packing's (gradients reaching the prefix are
summed over the members, as autograd does through the shared keys and values).

Prefix positions belong to no sequence (``sequence_index == -1``, no loss); everything else
follows ``PackedBatch``'s alignment convention. Needs the varlen attention (a dense mask would
treat the prefix as padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentrl._types import Trajectory

from ._batch import (
    PackedBatch,
    PerTrajectory,
    _check_fits,
    _first_fit_decreasing,
    _prepare,
    _Sequence,
    _step_counts,
)


@dataclass
class _Unit:
    prefix: list[int]
    members: list[_Sequence]

    @property
    def size(self) -> int:
        k = len(self.prefix)
        return k + sum(len(m.input_ids) - k for m in self.members)


def _shared_length(members: list[_Sequence]) -> int:
    first = members[0].input_ids
    limit = min(len(m.input_ids) for m in members)
    for m in members:  # no loss inside the prefix
        limit = min(limit, next((p for p, keep in enumerate(m.loss_mask) if keep), limit))
    k = 0
    while k < limit and all(m.input_ids[k] == first[k] for m in members):
        k += 1
    return k


def _units(seqs: list[_Sequence], trajs: Sequence[Trajectory], max_tokens: int) -> list[_Unit]:
    groups: dict[str, list[_Sequence]] = {}
    for seq in seqs:
        groups.setdefault(trajs[seq.trajectory_index].group_id, []).append(seq)
    units = []
    for members in groups.values():
        k = _shared_length(members) if len(members) > 1 else 0
        if k < 2:  # nothing worth sharing
            units.extend(_Unit([], [m]) for m in members)
            continue
        current = _Unit(members[0].input_ids[:k], [])
        for m in members:
            if current.members and current.size + len(m.input_ids) - k > max_tokens:
                units.append(current)
                current = _Unit(current.prefix, [])
            current.members.append(m)
        units.append(current)
    return units


def _build_row(units: list[_Unit], *, pad_id: int, step_tokens: int, step_seqs: int):
    ids, pos, seq_index, targets, mask, lps, advs = [], [], [], [], [], [], []
    bounds, parents = [0], []
    traj_index, seq_start, seq_len = [], [], []
    for unit in units:
        k = len(unit.prefix)
        prefix_segment = -1
        if k:
            ids += unit.prefix
            pos += list(range(k))
            seq_index += [-1] * k
            targets += unit.members[0].targets[:k]
            mask += [False] * k
            lps += [0.0] * k
            advs += [0.0] * k
            prefix_segment = len(parents)
            parents.append(-1)
            bounds.append(len(ids))
        for m in unit.members:
            start, n = len(ids), len(m.input_ids)
            seq_index += [len(traj_index)] * (n - k)
            traj_index.append(m.trajectory_index)
            seq_start.append(start)
            seq_len.append(n - k)
            ids += m.input_ids[k:]
            pos += list(range(k, n))
            targets += m.targets[k:]
            mask += m.loss_mask[k:]
            lps += m.logprobs[k:]
            advs += m.advantages[k:]
            parents.append(prefix_segment)
            bounds.append(len(ids))
    long = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    return PackedBatch(
        input_ids=long(ids),
        position_ids=long(pos),
        attention_mask=torch.ones(1, len(ids), dtype=torch.bool),
        sequence_index=long(seq_index),
        targets=long(targets),
        loss_mask=torch.tensor([mask], dtype=torch.bool),
        rollout_logprobs=torch.tensor([lps], dtype=torch.float32),
        advantages=torch.tensor([advs], dtype=torch.float32),
        trajectory_index=torch.tensor(traj_index, dtype=torch.long),
        sequence_row=torch.zeros(len(traj_index), dtype=torch.long),
        sequence_start=torch.tensor(seq_start, dtype=torch.long),
        sequence_lengths=torch.tensor(seq_len, dtype=torch.long),
        packed=True,
        step_loss_tokens=step_tokens,
        step_sequences=step_seqs,
        segment_bounds=torch.tensor(bounds, dtype=torch.int32),
        segment_parents=torch.tensor(parents, dtype=torch.long),
    )


def pack_shared_prefix(
    trajs: Sequence[Trajectory],
    max_tokens_per_micro_batch: int,
    *,
    pad_id: int,
    advantages: Sequence[PerTrajectory] | None = None,
    algorithm_mask: Sequence[PerTrajectory] | None = None,
) -> list[PackedBatch]:
    """Like ``pack_trajectories`` (same arguments, skipping rule and denominators), with each
    group's common prompt stored once per micro-batch (a group too large for one micro-batch
    is split, each part with its own copy of the prefix). Units are placed first-fit
    decreasing, ties in input order (deterministic)."""
    seqs = _prepare(trajs, advantages, algorithm_mask)
    _check_fits(seqs, trajs, max_tokens_per_micro_batch)
    units = _units(seqs, trajs, max_tokens_per_micro_batch)
    sizes = [unit.size for unit in units]
    bins = [[units[i] for i in b] for b in _first_fit_decreasing(sizes, max_tokens_per_micro_batch)]
    tokens, count = _step_counts(seqs)
    return [_build_row(row, pad_id=pad_id, step_tokens=tokens, step_seqs=count) for row in bins]
