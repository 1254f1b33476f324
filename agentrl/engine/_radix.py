"""A radix tree over token ids whose nodes own KV blocks (SGLang's RadixAttention, page-aligned).

Every edge holds a run of whole pages (``page_size`` tokens each, the KV pool's block size) and
the blocks holding their KV, one per page; children are keyed by their first page. Only full
pages are cached: a sequence's trailing partial page stays private to its owner.

- ``match_prefix(tokens)``: the longest cached page-aligned prefix, split so a node ends exactly
  there; the caller ``lock``s that node while it reads the blocks.
- ``insert(tokens, blocks)``: hand the KV of a page-aligned sequence to the tree. Pages the tree
  already holds keep the tree's blocks and the caller's duplicates are freed; the caller must
  switch to the returned blocks.
- ``lock``/``unlock``: reference counts along the path to the root; a node with a non-zero count
  (or a locked descendant) is never evicted.
- ``evict(blocks)``: free at least that many blocks from unlocked leaves, least recently used
  first, trimming a leaf from its end when only part of it is needed. ``token_budget`` (if set)
  caps the tokens the tree holds: ``enforce_budget()`` evicts down to it.
- ``reset()``: drop everything (weight updates); nothing may be locked.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec


class RadixStatistics(msgspec.Struct, frozen=True):
    """Counters of one ``RadixCache`` (``statistics()``)."""

    hit_tokens: int
    """Tokens returned by ``match_prefix`` over its lifetime."""
    queried_tokens: int
    """Page-aligned tokens asked for by ``match_prefix``."""
    inserted_tokens: int
    """New tokens (not already cached) handed over by ``insert``."""
    evicted_tokens: int
    evictions: int
    """Leaves evicted or trimmed."""
    cached_tokens: int
    """Tokens the tree holds now (locked or not)."""
    evictable_tokens: int
    """Of those, tokens no lock protects."""
    nodes: int
    """Nodes, the root excluded."""


@dataclass(eq=False)
class RadixNode:
    key: list[int]
    """Token ids on the edge from the parent (a whole number of pages)."""
    blocks: list[int]
    """KV blocks of ``key``, one per page."""
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode]
    lock_ref: int = 0
    last_access: int = 0

    def __repr__(self) -> str:
        return f"RadixNode(tokens={len(self.key)}, lock_ref={self.lock_ref})"


class MatchResult(msgspec.Struct, frozen=True):
    node: RadixNode
    """The node ending exactly at the match (the root for no match)."""
    blocks: list[int]
    """KV blocks of the matched prefix, in order."""

    def __len__(self) -> int:
        return len(self.blocks)


class RadixCache:
    """See the module docstring. ``free`` returns blocks to the KV pool."""

    def __init__(
        self, page_size: int, free: Callable[[list[int]], None], token_budget: int | None = None
    ) -> None:
        self.page_size = page_size
        self.token_budget = token_budget
        self._free = free
        self.root = RadixNode(key=[], blocks=[], parent=None, children={}, lock_ref=1)
        self._clock = 0
        self._cached = 0
        self._evictable = 0
        self._nodes = 0
        self._hit = self._queried = self._inserted = self._evicted = self._evictions = 0

    # --- queries --------------------------------------------------------------------------------

    @property
    def evictable_blocks(self) -> int:
        return self._evictable // self.page_size

    @property
    def cached_tokens(self) -> int:
        return self._cached

    def statistics(self) -> RadixStatistics:
        return RadixStatistics(
            hit_tokens=self._hit,
            queried_tokens=self._queried,
            inserted_tokens=self._inserted,
            evicted_tokens=self._evicted,
            evictions=self._evictions,
            cached_tokens=self._cached,
            evictable_tokens=self._evictable,
            nodes=self._nodes,
        )

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``tokens`` in whole pages; refreshes its LRU time."""
        page = self.page_size
        usable = len(tokens) // page * page
        self._queried += usable
        self._clock += 1
        node, pos, blocks = self.root, 0, []
        while pos < usable:
            child = node.children.get(tuple(tokens[pos : pos + page]))
            if child is None:
                break
            pages = _common_pages(child.key, tokens, pos, usable, page)
            if pages * page < len(child.key):
                child = self._split(child, pages)
            child.last_access = self._clock
            blocks.extend(child.blocks)
            pos += len(child.key)
            node = child
        self._hit += pos
        _touch(node, self._clock)
        return MatchResult(node, blocks)

    # --- updates --------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> MatchResult:
        """Cache ``tokens`` (a whole number of pages) whose KV is in ``blocks`` (one per page).

        Ownership of ``blocks`` passes to the tree: where the tree already held a page, the
        caller's block for it is freed. Returns the node ending at ``tokens`` and the tree's
        blocks for all of ``tokens`` (use these from now on).
        """
        page = self.page_size
        assert len(tokens) == len(blocks) * page, (len(tokens), len(blocks))
        self._clock += 1
        node, pos, out = self.root, 0, []
        duplicates: list[int] = []
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + page]))
            if child is None:
                new = RadixNode(
                    key=list(tokens[pos:]),
                    blocks=list(blocks[pos // page :]),
                    parent=node,
                    children={},
                    last_access=self._clock,
                )
                node.children[tuple(tokens[pos : pos + page])] = new
                self._nodes += 1
                self._cached += len(new.key)
                self._evictable += len(new.key)
                self._inserted += len(new.key)
                out.extend(new.blocks)
                node, pos = new, len(tokens)
                break
            pages = _common_pages(child.key, tokens, pos, len(tokens), page)
            if pages * page < len(child.key):
                child = self._split(child, pages)
            child.last_access = self._clock
            duplicates.extend(b for b in blocks[pos // page : pos // page + pages])
            out.extend(child.blocks)
            pos += len(child.key)
            node = child
        _touch(node, self._clock)
        own = set(out)
        self._free([b for b in duplicates if b not in own])
        return MatchResult(node, out)

    def enforce_budget(self) -> int:
        """Evict (LRU) down to ``token_budget`` as far as locks allow; returns blocks freed.
        Call after locking what was just inserted."""
        if self.token_budget is None or self._cached <= self.token_budget:
            return 0
        return self.evict(-(-(self._cached - self.token_budget) // self.page_size))

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (counted)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "radix node unlocked more often than locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_blocks: int) -> int:
        """Free ``num_blocks`` blocks (fewer if not enough are evictable), least recently used
        leaves first. Returns the blocks freed."""
        page, freed = self.page_size, 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        while freed < num_blocks and heap:
            *_, leaf = heapq.heappop(heap)
            take = min(len(leaf.blocks), num_blocks - freed)
            cut = len(leaf.blocks) - take
            gone = leaf.blocks[cut:]
            self._free(gone)
            freed += take
            tokens = take * page
            self._cached -= tokens
            self._evictable -= tokens
            self._evicted += tokens
            self._evictions += 1
            if cut:  # trim the leaf's tail; it stays a leaf
                del leaf.key[cut * page :], leaf.blocks[cut:]
                continue
            parent = leaf.parent
            assert parent is not None
            del parent.children[tuple(leaf.key[:page])]
            self._nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Free every block; ``AssertionError`` if anything is still locked."""
        assert self._evictable == self._cached, "radix reset while nodes are locked"
        self.evict(self._cached // self.page_size)
        assert self._cached == 0 and self._nodes == 0 and not self.root.children

    # --- internals ------------------------------------------------------------------------------

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def _split(self, child: RadixNode, pages: int) -> RadixNode:
        """Cut ``child`` after ``pages`` pages; returns the new upper node."""
        page = self.page_size
        parent = child.parent
        assert parent is not None and 0 < pages * page < len(child.key)
        upper = RadixNode(
            key=child.key[: pages * page],
            blocks=child.blocks[:pages],
            parent=parent,
            children={},
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        parent.children[tuple(upper.key[:page])] = upper
        child.key = child.key[pages * page :]
        child.blocks = child.blocks[pages:]
        child.parent = upper
        upper.children[tuple(child.key[:page])] = child
        self._nodes += 1
        return upper


def _common_pages(key: list[int], tokens: Sequence[int], pos: int, end: int, page: int) -> int:
    """Whole pages ``key`` shares with ``tokens[pos:end]`` (the first page is known to match)."""
    n = min(len(key), end - pos) // page
    pages = 1
    while pages < n and key[pages * page : (pages + 1) * page] == list(
        tokens[pos + pages * page : pos + (pages + 1) * page]
    ):
        pages += 1
    return pages


def _touch(node: RadixNode, clock: int) -> None:
    while node.parent is not None:
        node.last_access = clock
        node = node.parent
