"""Who owns which KV block: one sequence's block table, and the moves between owners.

Every block is owned by exactly one of: the pool's free list, the radix tree, or one sequence
(a running request, or a session's pin). A ``SequenceKV`` reads a page-aligned prefix from the
tree (``blocks[:shared]``, kept alive by a lock on ``node``) and owns the rest
(``blocks[shared:]``, the only blocks it ever writes). ``KVManager`` moves blocks between owners:

- ``match``: start a sequence from the tree's longest cached prefix (locked);
- ``commit``: hand the sequence's finished full pages to the tree (SGLang's
  ``cache_unfinished_req``), so siblings can reuse them while it still runs;
- ``release``: end the sequence, optionally caching its full pages first; its private tail
  goes back to the free list.

With the radix cache disabled (``tree is None``) a sequence owns all its blocks and
``release`` frees them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._kv import KVPool
from ._radix import RadixCache, RadixNode


@dataclass(eq=False)
class SequenceKV:
    """KV held for ``tokens[:length]``.

    ``tokens``: the sequence's token ids (for a running request, its live context list, which
    may run ahead of ``length``); ``blocks``: its block table; ``blocks[:shared]`` belong to the
    radix tree (path to ``node``, locked), the rest to this sequence.
    """

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    shared: int = 0
    node: RadixNode | None = None
    length: int = 0


class KVManager:
    def __init__(self, pool: KVPool, tree: RadixCache | None) -> None:
        self.pool = pool
        self.tree = tree

    @property
    def available_blocks(self) -> int:
        """Free blocks plus blocks the tree could evict right now."""
        return self.pool.num_free + (self.tree.evictable_blocks if self.tree else 0)

    def match(self, tokens: list[int], limit: int | None = None) -> SequenceKV:
        """A sequence for ``tokens`` reusing the longest cached prefix of ``tokens[:-1]`` (at
        least one token is always left to compute, for the next-token logits), and of
        ``tokens[:limit]`` when ``limit`` is given."""
        seq = SequenceKV(tokens)
        usable = len(tokens) - 1 if limit is None else min(len(tokens) - 1, limit)
        if self.tree is not None and usable > 0:
            found = self.tree.match_prefix(tokens[:usable])
            if len(found):
                self.tree.lock(found.node)
                seq.node, seq.blocks, seq.shared = found.node, list(found.blocks), len(found)
                seq.length = len(found) * self.pool.block_size
        return seq

    def ensure_free(self, count: int) -> bool:
        """Evict from the tree until ``count`` blocks are free; False if that is impossible."""
        missing = count - self.pool.num_free
        if missing > 0 and self.tree is not None:
            self.tree.evict(missing)
        return self.pool.num_free >= count

    def grow(self, seq: SequenceKV, tokens: int) -> None:
        """Give ``seq`` blocks for its first ``tokens`` tokens (call ``ensure_free`` first)."""
        need = self.pool.blocks_for(tokens) - len(seq.blocks)
        if need > 0:
            seq.blocks.extend(self.pool.alloc(need))

    def commit(self, seq: SequenceKV) -> None:
        """Move the full pages of ``tokens[:length]`` into the tree; ``seq`` keeps reading them
        under a lock on the new node. Duplicates of pages the tree already had are freed."""
        if self.tree is None:
            return
        pages = seq.length // self.pool.block_size
        if pages <= seq.shared:
            return
        found = self.tree.insert(seq.tokens[: pages * self.pool.block_size], seq.blocks[:pages])
        self.tree.lock(found.node)
        if seq.node is not None:
            self.tree.unlock(seq.node)
        seq.node, seq.shared = found.node, pages
        seq.blocks[:pages] = found.blocks
        self.tree.enforce_budget()

    def release(self, seq: SequenceKV, *, cache: bool = True) -> None:
        """End ``seq``: cache its full pages in the tree (unless ``cache`` is False, e.g. when
        the weights changed), unlock, free the private tail. ``seq`` is empty afterwards."""
        if cache:
            self.commit(seq)
        if seq.node is not None:
            assert self.tree is not None
            self.tree.unlock(seq.node)
        self.pool.free(seq.blocks[seq.shared :])
        seq.blocks, seq.shared, seq.node, seq.length = [], 0, None, 0
        if self.tree is not None:
            self.tree.enforce_budget()

    def trim(self, seq: SequenceKV) -> None:
        """Free private blocks beyond what ``seq.length`` tokens need."""
        keep = max(self.pool.blocks_for(seq.length), seq.shared)
        if len(seq.blocks) > keep:
            self.pool.free(seq.blocks[keep:])
            del seq.blocks[keep:]
