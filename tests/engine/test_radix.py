"""RadixCache properties (hypothesis): match/insert/evict invariants and no leaked blocks."""

from __future__ import annotations

import random

from hypothesis import given, note, settings
from hypothesis import strategies as st

from agentrl.engine._kv import KVPool
from agentrl.engine._radix import RadixCache, RadixNode
from agentrl.engine._seq import KVManager, SequenceKV

PAGE = 4


class Pool:
    """A block allocator that checks every block is owned exactly once."""

    def __init__(self, size: int) -> None:
        self.free_list = list(range(size))
        self.size = size

    def alloc(self, n: int) -> list[int]:
        assert n <= len(self.free_list)
        out, self.free_list = self.free_list[:n], self.free_list[n:]
        return out

    def free(self, blocks: list[int]) -> None:
        assert not set(blocks) & set(self.free_list), f"double free of {blocks}"
        assert len(set(blocks)) == len(blocks)
        self.free_list.extend(blocks)


def tree_blocks(tree: RadixCache) -> list[int]:
    out, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        out.extend(node.blocks)
        stack.extend(node.children.values())
    return out


def check_invariants(tree: RadixCache, pool: Pool, held: int) -> None:
    """Blocks partition into free / tree / ``held`` private ones; counters agree with the tree."""
    blocks = tree_blocks(tree)
    assert len(blocks) == len(set(blocks)), "a block is in the tree twice"
    assert not set(blocks) & set(pool.free_list), "a tree block is also free"
    assert len(blocks) + len(pool.free_list) + held == pool.size
    stats = tree.statistics()
    assert stats.cached_tokens == len(blocks) * PAGE
    evictable, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        assert len(node.key) == len(node.blocks) * PAGE and (node is tree.root or node.key)
        for first, child in node.children.items():
            assert child.parent is node and tuple(child.key[:PAGE]) == first
            assert child.lock_ref <= node.lock_ref or node is tree.root
        evictable += len(node.key) if node.lock_ref == 0 else 0
        stack.extend(node.children.values())
    assert stats.evictable_tokens == evictable


sequences = st.lists(
    st.lists(st.integers(0, 3), min_size=0, max_size=6).map(
        lambda pages: [t for p in pages for t in [p] * PAGE]  # few distinct pages: many overlaps
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(seqs=sequences, seed=st.integers(0, 2**32 - 1))
def test_insert_then_match_returns_what_was_inserted(seqs: list[list[int]], seed: int) -> None:
    note(f"seed={seed}")
    pool = Pool(200)
    tree = RadixCache(PAGE, pool.free)
    content: dict[int, tuple[int, ...]] = {}  # block -> the page it holds
    for tokens in seqs:
        blocks = pool.alloc(len(tokens) // PAGE)
        for i, b in enumerate(blocks):
            content[b] = tuple(tokens[i * PAGE : (i + 1) * PAGE])
        found = tree.insert(tokens, blocks)
        assert len(found.blocks) * PAGE == len(tokens)
        check_invariants(tree, pool, held=0)
    rng = random.Random(seed)
    for tokens in rng.sample(seqs, len(seqs)):
        extra = [rng.randrange(5) for _ in range(rng.randrange(6))]
        found = tree.match_prefix(tokens + extra)
        assert len(found) * PAGE >= len(tokens)  # everything inserted is found
        for i, b in enumerate(found.blocks):  # and each block holds the right page
            assert content[b] == tuple((tokens + extra)[i * PAGE : (i + 1) * PAGE])
        check_invariants(tree, pool, held=0)
    tree.reset()
    assert sorted(pool.free_list) == list(range(200))


@settings(max_examples=150, deadline=None)
@given(
    seqs=sequences,
    ops=st.lists(st.tuples(st.sampled_from("ilue"), st.integers(0, 11)), max_size=40),
)
def test_locks_protect_and_eviction_is_lru(seqs: list[list[int]], ops: list[tuple[str, int]]):
    pool = Pool(200)
    tree = RadixCache(PAGE, pool.free)
    locked: list[RadixNode] = []
    for op, k in ops:
        tokens = seqs[k % len(seqs)]
        if op == "i":
            tree.insert(tokens, pool.alloc(len(tokens) // PAGE))
        elif op == "l":
            found = tree.match_prefix(tokens)
            tree.lock(found.node)
            locked.append(found.node)
            protected = list(found.blocks)
            tree.evict(10_000)  # everything unlocked goes; the locked path stays
            assert tree.match_prefix(tokens).blocks == protected
        elif op == "u" and locked:
            tree.unlock(locked.pop(k % len(locked)))
        elif op == "e":
            before = tree.statistics()
            freed = tree.evict(k)
            after = tree.statistics()
            assert freed == min(k, before.evictable_tokens // PAGE)
            assert after.cached_tokens == before.cached_tokens - freed * PAGE
        check_invariants(tree, pool, held=0)
    for node in locked:
        tree.unlock(node)
    tree.reset()
    assert sorted(pool.free_list) == list(range(200))


def test_lru_order_and_trimming() -> None:
    pool = Pool(20)
    tree = RadixCache(PAGE, pool.free)
    a, b = [1] * 8, [2] * 12
    tree.insert(a, pool.alloc(2))
    tree.insert(b, pool.alloc(3))
    tree.match_prefix(a)  # a is now the most recently used
    assert tree.evict(2) == 2  # from b's end: b keeps one page
    assert len(tree.match_prefix(b)) == 1 and len(tree.match_prefix(a)) == 2
    assert tree.statistics().evicted_tokens == 8


def test_token_budget() -> None:
    pool = Pool(20)
    tree = RadixCache(PAGE, pool.free, token_budget=8)
    tree.insert([1] * 8, pool.alloc(2))
    tree.insert([2] * 8, pool.alloc(2))
    tree.enforce_budget()
    assert tree.statistics().cached_tokens == 8
    assert len(tree.match_prefix([2] * 8)) == 2  # the older entry went first


@settings(max_examples=60, deadline=None)
@given(
    contexts=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=40), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_sequences_never_leak_blocks(contexts: list[list[int]], seed: int) -> None:
    """Sequences that match, grow, commit and release in random interleavings return every
    block to the pool once the tree is reset."""
    note(f"seed={seed}")
    rng = random.Random(seed)
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=100, block_size=PAGE)
    kv = KVManager(pool, RadixCache(PAGE, pool.free))
    live: list[SequenceKV] = []
    for tokens in contexts:
        seq = kv.match(tokens)
        assert seq.length < len(tokens) and seq.length % PAGE == 0
        assert kv.ensure_free(pool.blocks_for(len(tokens)))
        kv.grow(seq, len(tokens))
        seq.length = rng.randrange(seq.length, len(tokens) + 1)
        kv.commit(seq)
        live.append(seq)
        if rng.random() < 0.5:
            kv.release(live.pop(rng.randrange(len(live))), cache=rng.random() < 0.7)
    for seq in live:
        kv.release(seq)
    assert kv.tree is not None
    kv.tree.reset()
    assert pool.num_free == pool.num_blocks
