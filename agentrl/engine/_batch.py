"""The running batch's KV cache: one transformers ``DynamicCache``, rows left-padded.

Each request is prefilled alone (batch 1, no padding), then its cache is appended as a new row.
Rows of different lengths are aligned on the right by left padding; the padding is excluded by an
explicit attention mask and every row carries its own position ids, so nothing is ever inferred
from pad ids (SmolLM2's pad id is its EOS id). When rows leave, leading columns that are padding
in every remaining row are cut off again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel


def _left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad ``tensor`` on the left of ``dim`` up to ``length``."""
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [missing, 0]
    return F.pad(tensor, pad)


def prefill(model: PreTrainedModel, input_ids: Sequence[int]) -> tuple[DynamicCache, torch.Tensor]:
    """Run one prompt alone. Returns its cache (batch 1) and the next-token logits ``[vocab]``
    (float32)."""
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    positions = torch.arange(len(input_ids), dtype=torch.long).unsqueeze(0)
    out = model(
        input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
    )
    return cache, out.logits[0, -1].float()


class BatchedKV:
    """KV of the running rows.

    ``cache`` layers hold keys and values of shape ``[rows, kv_heads, length, head_dim]`` (model
    dtype); ``mask`` is ``[rows, length]`` int64 with 1 for a real token and 0 for left padding.
    """

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def clear(self) -> None:
        self.cache = None
        self.mask = None

    def append(self, cache: DynamicCache, length: int) -> None:
        """Add a prefilled row (``cache``: batch 1, ``length`` tokens) as the last row."""
        row_mask = torch.ones(1, length, dtype=torch.long)
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, row_mask
            return
        total = max(self.mask.shape[1], length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat(
                [_left_pad(mine.keys, total, 2), _left_pad(theirs.keys, total, 2)]
            )
            mine.values = torch.cat(
                [_left_pad(mine.values, total, 2), _left_pad(theirs.values, total, 2)]
            )
        self.mask = torch.cat([_left_pad(self.mask, total, 1), _left_pad(row_mask, total, 1)])

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order) and drop columns that are now padding everywhere."""
        if self.cache is None or self.mask is None:
            return
        if not rows:
            self.clear()
            return
        if list(rows) == list(range(self.rows)):
            return
        index = torch.tensor(list(rows), dtype=torch.long)
        mask = self.mask[index]
        first = int(mask.any(dim=0).nonzero()[0])  # left padding: real columns form a suffix
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self.mask = mask[:, first:]

    def decode(
        self, model: PreTrainedModel, tokens: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """Feed one token per row (``tokens[i]`` at position ``positions[i]``).

        Returns the next-token logits ``[rows, vocab]`` (float32); the cache grows by one column.
        """
        assert self.cache is not None and self.mask is not None
        rows = self.rows
        mask = torch.cat([self.mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
        out = model(
            input_ids=torch.tensor(list(tokens), dtype=torch.long).view(rows, 1),
            attention_mask=mask,
            position_ids=torch.tensor(list(positions), dtype=torch.long).view(rows, 1),
            cache=self.cache,
            use_cache=True,
        )
        self.mask = mask
        return out.logits[:, -1].float()
