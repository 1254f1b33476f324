"""``paged_attention`` against dense causal attention, and the KV pool's bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch
from numerics import assert_within, attention_error_bound, sdpa_rounding

from agentrl._errors import EngineError
from agentrl.engine._kv import PREFILL_PAD, KVPool, make_attention_batch, paged_attention

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


@pytest.mark.parametrize("pad", [PREFILL_PAD, 0.0, 1e9], ids=["grouped", "alone", "one-group"])
@pytest.mark.parametrize("seed", range(6))
def test_mixed_step_matches_dense_attention(seed: int, pad: float) -> None:
    """Decode rows and prefill chunks (with and without cached keys before them) in one step,
    prefill rows attended one by one, in groups, or all padded into one call."""
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
        n = q_len + rng.randrange(0, 20)
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
    )
    prefill = len(rows) - batch.num_decode
    assert sorted(r for g in batch.prefill_groups for r in g.rows) == list(
        range(batch.num_decode, len(rows))
    )
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
