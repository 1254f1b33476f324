"""Trajectories → micro-batches: sequence packing (the default) and a padded fallback.

Both produce the same :class:`PackedBatch`, so everything downstream (log-probs, losses,
advantages) is layout-agnostic: a token's sequence is always read from ``sequence_index``, never
inferred from pad ids (SmolLM2's pad id is its EOS id).

Alignment, the off-by-one every RL trainer has to get right, is stated once, in
:class:`PackedBatch`'s docstring, and every per-token field follows it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentrl._types import Trajectory

PerTrajectory = float | Sequence[float]
"""A value per trajectory: one number for the whole trajectory, or one per token of
``token_ids`` (entry ``i`` belongs to token ``i``, exactly like ``loss_mask[i]``)."""

OVERLONG_REASONS = ("max_tokens", "context_limit")


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch: ``B`` rows of ``T`` positions holding ``S`` whole sequences.

    **Alignment.** A trajectory with ids ``x[0..n-1]``, engine logprobs ``lp`` and mask ``m``
    (``m[i] == 1`` exactly where the engine sampled ``x[i]``) becomes a sequence of ``L``
    positions, where ``L`` is the index of its last trainable token (``m[i] * alg[i] == 1``, with
    ``alg`` the algorithm mask); everything after it carries no loss and is dropped. Position
    ``p`` of the sequence (``0 <= p < L``) holds::

        input_ids[p]        = x[p]
        position_ids[p]     = p
        targets[p]          = x[p + 1]        # the model at p predicts the token after it
        loss_mask[p]        = m[p + 1] * alg[p + 1]
        rollout_logprobs[p] = lp[p + 1]       # 0.0 where loss_mask[p] is False
        advantages[p]       = adv[p + 1]      # 0.0 where loss_mask[p] is False

    so ``log_softmax(logits[p])[targets[p]]`` is the trainer's logprob of the sampled token
    ``x[p + 1]``, directly comparable with ``rollout_logprobs[p]``. A token is trained on at the
    position that *predicts* it; ``x[0]`` can never be trained on (``m[0] == 1`` is refused).

    **Layouts.** Packed (``packed=True``): ``B == 1`` and the sequences are concatenated with no
    padding; attention must stay inside each sequence (``block_causal_mask`` for HF sdpa/eager,
    ``cu_seqlens`` for varlen kernels). Padded (``packed=False``): one sequence per row, right
    padding, ``attention_mask`` explicit; padding positions have ``sequence_index == -1``,
    ``input_ids == targets == pad_id`` and every per-token value 0.

    Fields (``S`` sequences; per-sequence tensors are ordered by sequence index):

    - ``input_ids``: ``[B, T]`` int64.
    - ``position_ids``: ``[B, T]`` int64, restarting at 0 for each sequence; 0 on padding.
    - ``attention_mask``: ``[B, T]`` bool, True on real positions (all True when packed).
    - ``sequence_index``: ``[B, T]`` int64, the batch-local sequence ``0..S-1``; -1 on padding.
    - ``targets``: ``[B, T]`` int64, see alignment.
    - ``loss_mask``: ``[B, T]`` bool, the trajectory's loss mask AND the algorithm mask, shifted.
    - ``rollout_logprobs``: ``[B, T]`` float32, the engine's logprobs, shifted (use them as the
      old logprobs on-policy, or as the TIS reference when the trainer recomputes old logprobs).
    - ``advantages``: ``[B, T]`` float32, shifted; replace with ``dataclasses.replace`` after GAE.
    - ``trajectory_index``: ``[S]`` int64, index of each sequence in the list that was packed.
    - ``sequence_row``, ``sequence_start``, ``sequence_lengths``: ``[S]`` int64, where each
      sequence lies: ``row``, first position, and ``L``.
    - ``packed``: which layout.
    - ``step_loss_tokens`` / ``step_sequences``: the number of loss tokens / sequences with at
      least one loss token over *all* micro-batches returned by the same call, the denominators
      for ``token-mean`` / ``seq-mean-*`` aggregation across gradient accumulation.
    - ``segment_bounds`` / ``segment_parents``: only for the shared-prefix layout
      (``pack_shared_prefix``), see ``attention_segments``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    sequence_index: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    trajectory_index: torch.Tensor
    sequence_row: torch.Tensor
    sequence_start: torch.Tensor
    sequence_lengths: torch.Tensor
    packed: bool
    step_loss_tokens: int
    step_sequences: int
    segment_bounds: torch.Tensor | None = None
    """``[G + 1]`` int32 boundaries of the row's attention segments (shared-prefix layout)."""
    segment_parents: torch.Tensor | None = None
    """``[G]`` int64: the segment whose keys each segment also attends to (-1: none)."""

    @property
    def num_sequences(self) -> int:
        return int(self.trajectory_index.numel())

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) positions: what the model computes on usefully."""
        return int(self.sequence_lengths.sum())

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[S + 1]`` int32 cumulative sequence lengths over the single packed row (varlen
        attention kernels); only defined for packed batches."""
        if not self.packed:
            raise ValueError("cu_seqlens is only defined for packed batches")
        out = torch.zeros(
            self.num_sequences + 1, dtype=torch.int32, device=self.sequence_lengths.device
        )
        out[1:] = torch.cumsum(self.sequence_lengths, 0)
        return out

    @property
    def attention_segments(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What varlen attention needs for a packed row: segment boundaries ``[G + 1]`` and,
        for the shared-prefix layout, each segment's parent ``[G]`` (a suffix attends to its
        parent prefix, then causally to itself). Plain packing: ``(cu_seqlens, None)``."""
        if self.segment_bounds is not None:
            return self.segment_bounds, self.segment_parents
        return self.cu_seqlens, None

    def split_sequences(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence views ``[L_s]`` of a ``[B, T]`` tensor laid out like this batch."""
        return [
            values[int(r), int(s) : int(s) + int(n)]
            for r, s, n in zip(
                self.sequence_row, self.sequence_start, self.sequence_lengths, strict=True
            )
        ]

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


@dataclass(frozen=True)
class _Sequence:
    """One trajectory, already shifted and trimmed (plain lists; see PackedBatch)."""

    trajectory_index: int
    input_ids: list[int]
    targets: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    advantages: list[float]


def _per_token(value: PerTrajectory, n: int, what: str, traj: Trajectory) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"trajectory {traj.id}: {what} has {len(values)} entries for {n} tokens")
    return values


def _shift(
    index: int, traj: Trajectory, advantage: PerTrajectory, algorithm_mask: PerTrajectory
) -> _Sequence | None:
    n = len(traj.token_ids)
    if len(traj.loss_mask) != n or len(traj.logprobs) != n:
        raise ValueError(
            f"trajectory {traj.id}: lengths differ: token_ids={n} "
            f"loss_mask={len(traj.loss_mask)} logprobs={len(traj.logprobs)}"
        )
    if n and traj.loss_mask[0]:
        raise ValueError(f"trajectory {traj.id}: token 0 is marked sampled; it has no context")
    adv = _per_token(advantage, n, "advantages", traj)
    alg = _per_token(algorithm_mask, n, "algorithm_mask", traj)
    keep = [bool(traj.loss_mask[i]) and alg[i] != 0.0 for i in range(n)]
    if not any(keep):
        return None
    last = max(i for i in range(n) if keep[i])  # L: positions 0..L-1 predict tokens 1..L
    logprobs: list[float] = []
    for i in range(1, last + 1):
        lp = traj.logprobs[i]
        if keep[i] and lp is None:
            raise ValueError(f"trajectory {traj.id}: sampled token {i} has no logprob")
        if keep[i] and not math.isfinite(lp):  # type: ignore[arg-type]
            raise ValueError(f"trajectory {traj.id}: sampled token {i} has logprob {lp}")
        logprobs.append(float(lp) if keep[i] else 0.0)  # type: ignore[arg-type]
    return _Sequence(
        trajectory_index=index,
        input_ids=list(traj.token_ids[:last]),
        targets=list(traj.token_ids[1 : last + 1]),
        loss_mask=keep[1 : last + 1],
        logprobs=logprobs,
        advantages=[adv[i] if keep[i] else 0.0 for i in range(1, last + 1)],
    )


def _prepare(
    trajs: Sequence[Trajectory],
    advantages: Sequence[PerTrajectory] | None,
    algorithm_mask: Sequence[PerTrajectory] | None,
) -> list[_Sequence]:
    for name, values in (("advantages", advantages), ("algorithm_mask", algorithm_mask)):
        if values is not None and len(values) != len(trajs):
            raise ValueError(f"{name} has {len(values)} entries for {len(trajs)} trajectories")
    out = []
    for i, traj in enumerate(trajs):
        seq = _shift(
            i,
            traj,
            0.0 if advantages is None else advantages[i],
            1.0 if algorithm_mask is None else algorithm_mask[i],
        )
        if seq is not None:
            out.append(seq)
    return out


def _check_fits(seqs: list[_Sequence], trajs: Sequence[Trajectory], max_tokens: int) -> None:
    for seq in seqs:
        if len(seq.input_ids) > max_tokens:
            raise ValueError(
                f"trajectory {trajs[seq.trajectory_index].id}: {len(seq.input_ids)} positions "
                f"exceed max_tokens_per_micro_batch={max_tokens}"
            )


def _build(
    rows: list[list[_Sequence]], *, pad_id: int, packed: bool, step_tokens: int, step_seqs: int
) -> PackedBatch:
    width = max(sum(len(s.input_ids) for s in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    sequence_index = torch.full(shape, -1, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    traj_index, seq_row, seq_start, seq_len = [], [], [], []
    for r, row in enumerate(rows):
        start = 0
        for seq in row:
            n, s = len(seq.input_ids), len(traj_index)
            span = slice(start, start + n)
            input_ids[r, span] = torch.tensor(seq.input_ids)
            targets[r, span] = torch.tensor(seq.targets)
            position_ids[r, span] = torch.arange(n)
            sequence_index[r, span] = s
            loss_mask[r, span] = torch.tensor(seq.loss_mask)
            logprobs[r, span] = torch.tensor(seq.logprobs)
            advantages[r, span] = torch.tensor(seq.advantages)
            traj_index.append(seq.trajectory_index)
            seq_row.append(r)
            seq_start.append(start)
            seq_len.append(n)
            start += n
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=sequence_index >= 0,
        sequence_index=sequence_index,
        targets=targets,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        advantages=advantages,
        trajectory_index=torch.tensor(traj_index, dtype=torch.long),
        sequence_row=torch.tensor(seq_row, dtype=torch.long),
        sequence_start=torch.tensor(seq_start, dtype=torch.long),
        sequence_lengths=torch.tensor(seq_len, dtype=torch.long),
        packed=packed,
        step_loss_tokens=step_tokens,
        step_sequences=step_seqs,
    )


def _first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin packing: indices of ``sizes``, longest first (ties by index), each into the first bin
    with room, a new bin of ``capacity`` when none has; returns the bins' indices."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b, room in enumerate(free):
            if sizes[i] <= room:
                bins[b].append(i)
                free[b] -= sizes[i]
                break
        else:
            bins.append([i])
            free.append(capacity - sizes[i])
    return bins


def _step_counts(seqs: list[_Sequence]) -> tuple[int, int]:
    return sum(sum(s.loss_mask) for s in seqs), len(seqs)


def pack_trajectories(
    trajs: Sequence[Trajectory],
    max_tokens_per_micro_batch: int,
    *,
    pad_id: int,
    advantages: Sequence[PerTrajectory] | None = None,
    algorithm_mask: Sequence[PerTrajectory] | None = None,
) -> list[PackedBatch]:
    """Pack trajectories into micro-batches of one row of at most ``max_tokens_per_micro_batch``
    positions, several whole sequences per row, no padding (first-fit decreasing by length,
    ties by input order, so the result is deterministic).

    ``advantages[i]`` / ``algorithm_mask[i]`` are per trajectory (a number, or one value per
    token of ``token_ids``); the algorithm mask (e.g. ``overlong_filter``) is combined with the
    trajectory's ``loss_mask``, which is only read. Trajectories left with no trainable token are
    skipped (they carry no loss); ``PackedBatch.trajectory_index`` says which ones are where.
    Packed rows have no padding; ``pad_id`` is accepted so both layouts share one signature.
    """
    seqs = _prepare(trajs, advantages, algorithm_mask)
    _check_fits(seqs, trajs, max_tokens_per_micro_batch)
    sizes = [len(seq.input_ids) for seq in seqs]
    bins = [[seqs[i] for i in b] for b in _first_fit_decreasing(sizes, max_tokens_per_micro_batch)]
    tokens, count = _step_counts(seqs)
    return [
        _build([row], pad_id=pad_id, packed=True, step_tokens=tokens, step_seqs=count)
        for row in bins
    ]


def pad_trajectories(
    trajs: Sequence[Trajectory],
    max_tokens_per_micro_batch: int,
    *,
    pad_id: int,
    advantages: Sequence[PerTrajectory] | None = None,
    algorithm_mask: Sequence[PerTrajectory] | None = None,
) -> list[PackedBatch]:
    """The padded fallback: one sequence per row, right padding with ``pad_id``, an explicit
    ``attention_mask``; rows are grouped longest first so that ``rows × width`` stays within
    ``max_tokens_per_micro_batch``. Same arguments and skipping rule as ``pack_trajectories``."""
    seqs = _prepare(trajs, advantages, algorithm_mask)
    _check_fits(seqs, trajs, max_tokens_per_micro_batch)
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i].input_ids), i))
    groups: list[list[_Sequence]] = []
    for i in order:
        if groups:
            width = len(groups[-1][0].input_ids)  # the longest: sorted descending
            if (len(groups[-1]) + 1) * width <= max_tokens_per_micro_batch:
                groups[-1].append(seqs[i])
                continue
        groups.append([seqs[i]])
    tokens, count = _step_counts(seqs)
    return [
        _build(
            [[s] for s in group], pad_id=pad_id, packed=False, step_tokens=tokens, step_seqs=count
        )
        for group in groups
    ]


def block_causal_mask(
    sequence_index: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[B, 1, T, T]`` attention mask: position ``q`` may attend to ``k`` iff ``k <= q`` and both
    belong to the same sequence (``sequence_index [B, T]``, -1 = padding).

    ``dtype=torch.bool`` gives True = attend (HF ``sdpa`` only); a floating dtype gives the
    additive form, 0 = attend and ``finfo(dtype).min`` = blocked, which HF ``sdpa`` and
    ``eager`` both accept as a custom 4D mask (checked on transformers 5.2: ``eager`` adds the
    mask, so a bool mask is silently wrong there; position ids alone do not isolate packed
    sequences in either). Padding positions attend to themselves so no row is empty (an empty
    row gives NaN, and NaN × 0 loss weight is still NaN).
    """
    t = sequence_index.shape[-1]
    q = sequence_index[:, :, None]
    k = sequence_index[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=sequence_index.device).tril()
    allowed = (q == k) & causal  # padding (-1 == -1) only reaches itself through the next line
    allowed &= (q >= 0) | torch.eye(t, dtype=torch.bool, device=sequence_index.device)
    allowed = allowed[:, None]
    if dtype == torch.bool:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=sequence_index.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def model_inputs(
    batch: PackedBatch, *, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Keyword arguments for an HF causal LM's forward (``input_ids``, ``position_ids``,
    ``attention_mask``): a 4D block-causal mask of ``dtype`` when packed, the 2D mask when
    padded. For ``flash_attention_2`` pass ``position_ids`` without a mask instead."""
    if batch.packed:
        mask = block_causal_mask(batch.sequence_index, dtype=dtype)
    else:
        mask = batch.attention_mask.long()
    return {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": mask,
    }


def overlong_filter(
    trajs: Sequence[Trajectory], *, reasons: Sequence[str] = OVERLONG_REASONS
) -> list[float]:
    """DAPO's overlong filtering (Yu et al. 2025, §3.4, "Overlong Filtering"): an algorithm mask
    of 0 for trajectories that were cut off by a length limit (their reward says nothing about
    the answer), 1 otherwise. Pass it as ``algorithm_mask``."""
    return [0.0 if t.termination_reason in reasons else 1.0 for t in trajs]


def turn_advantages(traj: Trajectory, per_turn: Sequence[float]) -> list[float]:
    """Per-token advantages from per-turn ones: every token of a span with ``turn == k`` gets
    ``per_turn[k]`` (only sampled tokens are ever used). Pass the result as ``advantages[i]``."""
    out = [0.0] * len(traj.token_ids)
    for span in traj.spans:
        if span.source == "model":
            if not 0 <= span.turn < len(per_turn):
                raise ValueError(f"trajectory {traj.id}: no advantage for turn {span.turn}")
            out[span.start : span.end] = [float(per_turn[span.turn])] * (span.end - span.start)
    return out
