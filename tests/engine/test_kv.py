"""``paged_attention`` against dense causal attention, and the KV pool's bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch
from numerics import assert_within, attention_error_bound, sdpa_rounding

from agentrl._errors import EngineError
from agentrl.engine._batch import Row, build_forward_batch
from agentrl.engine._kv import (
    CAUSAL_MIN_QUERIES,
    PREFILL_MASK_ELEMENTS,
    PREFILL_PAD,
    KVPool,
    group_prefill_rows,
    int_tensor,
    make_attention_batch,
    paged_attention,
)

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 8, 4


def dense_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``attention_error_bound`` of fp32 SDPA for each query of ``dense_reference``."""
    q_len, n = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    bound = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q_len):
        visible = n - q_len + i + 1
        for h in range(HEADS):
            keys, values = k[:visible, h // group], v[:visible, h // group]
            bound[i, h] = attention_error_bound(
                q[i, h], keys, values, DIM**-0.5, **sdpa_rounding(torch.float32, "cpu")
            )
    return bound


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 causal attention of ``q`` ``[q_len, H, D]`` over ``k``/``v`` ``[n, K, D]`` (the
    queries are the last ``q_len`` positions)."""
    q_len, n = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / DIM**0.5
    visible = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("pad", "causal"),
    [(PREFILL_PAD, False), (0.0, False), (1e9, False), (PREFILL_PAD, True), (0.0, True)],
    ids=["grouped", "alone", "one-group", "grouped-causal", "alone-causal"],
)
@pytest.mark.parametrize("seed", range(6))
def test_mixed_step_matches_dense_attention(seed: int, pad: float, causal: bool) -> None:
    """Decode rows and prefill chunks (with and without cached keys before them) in one step,
    prefill rows attended one by one, in groups, or all padded into one call; rows alone in
    their group with a mask or as causal rows (no mask tensor, the CUDA default)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    pool = KVPool(
        num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, num_blocks=64, block_size=BLOCK
    )
    pool.k.normal_(generator=generator)  # stale data everywhere: padding must never leak in
    pool.v.normal_(generator=generator)
    free = list(range(64))
    rng.shuffle(free)
    rows = []  # (seq_len, q_len, table)
    for i in range(rng.randrange(1, 6)):
        q_len = 1 if i < rng.randrange(0, 4) else rng.randrange(2, 12)
        n = q_len + (0 if rng.random() < 0.3 else rng.randrange(1, 20))  # 0: a fresh prompt
        blocks = -(-n // BLOCK)
        if rng.random() < 0.3:  # one contiguous run: read as a view
            start = rng.randrange(0, 64 - blocks)
            table = list(range(start, start + blocks))
        else:
            table, free = free[:blocks], free[blocks:] + free[:blocks]
        rows.append((n, q_len, table))
    rows.sort(key=lambda r: r[1] != 1)
    batch = make_attention_batch(
        [t for _, _, t in rows],
        [n for n, _, _ in rows],
        [q for _, q, _ in rows],
        BLOCK,
        prefill_pad=pad,
        causal_rows=causal,
    )
    prefill = len(rows) - batch.num_decode
    assert sorted(r for g in batch.prefill_groups for r in g.rows) == list(
        range(batch.num_decode, len(rows))
    )
    alone = [g for g in batch.prefill_groups if g.src is None]
    assert all((g.mask is None) == causal for g in alone)
    if pad < 1:
        assert len(batch.prefill_groups) == prefill
    elif pad > 1e6:
        assert len(batch.prefill_groups) == min(prefill, 1)
    q = torch.randn(sum(r[1] for r in rows), HEADS, DIM, generator=generator)
    got = paged_attention(q, pool.k[0], pool.v[0], batch, DIM**-0.5)
    for b, (n, q_len, table) in enumerate(rows):
        k = pool.k[0][table].reshape(-1, KV_HEADS, DIM)[:n]
        v = pool.v[0][table].reshape(-1, KV_HEADS, DIM)[:n]
        start = batch.query_starts[b]
        want = dense_reference(q[start : start + q_len], k, v)
        bound = dense_bound(q[start : start + q_len], k, v)
        assert_within(got[start : start + q_len], want, bound, f"seed {seed}, row {b}")


def test_which_lone_rows_are_causal_rows_on_the_cpu() -> None:
    """Fresh prompts and chunks of at least ``CAUSAL_MIN_QUERIES`` queries attend without a
    mask; a short chunk after cached keys keeps its mask (faster on the CPU)."""
    rows = [(40, 40), (CAUSAL_MIN_QUERIES, 400), (CAUSAL_MIN_QUERIES - 1, 400), (8, 400)]
    tables = [list(range(i * 100, i * 100 + -(-n // BLOCK))) for i, (_, n) in enumerate(rows)]
    batch = make_attention_batch(
        tables, [n for _, n in rows], [q for q, _ in rows], BLOCK, "cpu", prefill_pad=0.0
    )
    masks = {g.rows[0]: g.mask for g in batch.prefill_groups}
    assert [masks[r] is None for r in range(len(rows))] == [True, True, False, False]
    forced = make_attention_batch(tables[3:], [400], [8], BLOCK, "cpu", causal_rows=True)
    assert forced.prefill_groups[0].mask is None


def test_a_padded_group_stays_within_the_mask_cap() -> None:
    """Eight equal rows (no padding at all) still split once their mask would pass the cap: 4 x
    128 x 4096 = 2**21 elements per group."""
    q_lens, n_lens = [128] * 8, [4096] * 8
    assert group_prefill_rows(q_lens, n_lens, 16) == [list(range(8))]
    assert group_prefill_rows(q_lens, n_lens, 16, max_mask=1 << 21) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    # a single row is never split, however large
    assert group_prefill_rows([8192], [32768], 16, max_mask=1) == [[0]]
    assert PREFILL_MASK_ELEMENTS == 1 << 24


def test_pool_alloc_free() -> None:
    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=BLOCK)
    assert pool.alloc(3) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(EngineError, match="exhausted"):
        pool.alloc(2)
    pool.free([1])
    with pytest.raises(AssertionError, match="twice"):
        pool.free([1])
    assert pool.blocks_for(0) == 0 and pool.blocks_for(5) == 2
    slots = torch.tensor([0, 5])
    pool.write(1, slots, torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0))
    assert pool.k[1].view(-1, 1, 2)[5].tolist() == [[1.0, 1.0]]
    pool.copy_block(1, 3)
    assert pool.v[1, 3, 1].tolist() == [[2.0, 2.0]]


def test_slots_and_index_tensors_match_the_per_token_formula() -> None:
    """A step's KV slots come from block runs and its index vectors from ``int_tensor``: the
    same values and dtypes as the per-token formula ``blocks[p // page] * page + p % page``,
    for chunks that start and end inside blocks, span several, or sit in one."""
    rng = random.Random(0)
    page = 4
    rows = []
    for _ in range(40):
        length = rng.randint(2, 40)
        start = rng.randint(0, length - 1)
        blocks = rng.sample(range(200), -(-length // page))
        rows.append(Row(list(range(length)), start, length - start, blocks, True))
    rows.sort(key=lambda r: r.count != 1)
    batch = build_forward_batch(rows, page, "cpu")
    fed = [(r, p) for r in rows for p in range(r.start, r.start + r.count)]
    want = [r.blocks[p // page] * page + p % page for r, p in fed]
    assert batch.slots.dtype == torch.long and batch.slots.tolist() == want
    assert batch.positions.tolist() == [p for _, p in fed]
    assert int_tensor([], "cpu").shape == (0,) and int_tensor([7, -1], "cpu").tolist() == [7, -1]
    assert int_tensor([2**40], "cpu").item() == 2**40
    assert int_tensor([3], "cpu", torch.int32).dtype == torch.int32
    with pytest.raises(EngineError, match="int16"):
        int_tensor([3], "cpu", torch.int16)
