"""Pack one scheduler step (decode rows and prefill chunks of many sequences) into a
``ForwardBatch``: every token of the step in one ``[T]`` vector, plus the per-sequence metadata
``paged_attention`` needs. Nothing is inferred from pad ids: positions, lengths and masks are
explicit (SmolLM2's pad id is its EOS id). The step is planned in Python and its tensors are
made on the model's device here, once per step (a GPU forward never copies metadata per layer)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._kv import PREFILL_PAD, int_tensor, make_attention_batch
from ._model import ForwardBatch


class Row(NamedTuple):
    """One sequence's share of a step: feed ``tokens[start:start + count]`` at positions
    ``start...``, writing into ``blocks`` (its block table, already covering
    ``start + count`` tokens); ``sample``: return logits for its last fed token; ``extra``:
    positions ``[lo, hi)`` whose logits are returned too (input-token logprobs), in order,
    before the sampled one (``hi`` must not pass the sampled position)."""

    tokens: Sequence[int]
    start: int
    count: int
    blocks: Sequence[int]
    sample: bool
    extra: tuple[int, int] = (0, 0)


def extra_positions(row: Row) -> range:
    """The fed positions of ``row`` whose logits ``extra`` asks for."""
    return range(max(row.start, row.extra[0]), min(row.start + row.count, row.extra[1]))


def build_forward_batch(
    rows: Sequence[Row],
    block_size: int,
    device: torch.device | str | None = None,
    *,
    prefill_pad: float = PREFILL_PAD,
    causal_rows: bool | None = None,
) -> ForwardBatch:
    """Rows with ``count == 1`` must come first (they form the batched decode part). The
    batch's tensors are on ``device`` (default: torch's default device). ``prefill_pad``,
    ``causal_rows``: how prefill rows attend (``make_attention_batch``)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    for row in rows:
        end = row.start + row.count
        base = len(ids) - row.start
        ids.extend(row.tokens[row.start : end])
        positions.extend(range(row.start, end))
        if row.count == 1:
            slots.append(row.blocks[row.start // block_size] * block_size + row.start % block_size)
        else:  # one run of slots per block the chunk touches (no tensors: host lists)
            p = row.start
            while p < end:
                block, offset = divmod(p, block_size)
                first = row.blocks[block] * block_size + offset
                stop = min(end, (block + 1) * block_size)
                slots.extend(range(first, first + stop - p))
                p = stop
        if row.extra[1] > row.extra[0]:  # most rows ask for none
            logits_rows.extend(base + p for p in extra_positions(row))
        if row.sample:
            logits_rows.append(len(ids) - 1)
    attention = make_attention_batch(
        [list(r.blocks[: -(-(r.start + r.count) // block_size)]) for r in rows],
        [r.start + r.count for r in rows],
        [r.count for r in rows],
        block_size,
        device,
        prefill_pad=prefill_pad,
        causal_rows=causal_rows,
    )
    # the four index vectors travel to the device in one copy
    packed = int_tensor(ids + positions + slots + logits_rows, device)
    input_ids, positions_t, slots_t, logits_rows_t = packed.split(
        [len(ids), len(positions), len(slots), len(logits_rows)]
    )
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions_t,
        slots=slots_t,
        attention=attention,
        logits_rows=logits_rows_t,
    )


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``: a view when the rows are consecutive (a decode step's are), so no
    index tensor is copied to the device."""
    if not rows:
        return logits[:0]
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
