"""paged_prefill_attention: the Triton kernel and the engine's SDPA prefill path (padded groups,
causal rows) against the float64 query-by-query reference, on fresh random caches with shuffled
block tables; rows with and without a cached context, one-token chunks, chunks longer than a
query block."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES, needs_triton
from numerics import (
    assert_within,
    paged_prefill_bound,
    sdpa_rounding,
    to64,
    triton_prefill_rounding,
)

from agentrl.engine._kv import make_attention_batch, paged_attention
from agentrl.kernels import paged_prefill_attention, reference, triton_available


def _case(gen, rows, heads, kv_heads, dim, block_size, dtype, device, *, q_scale=1.0):
    """``rows``: (cached context, new queries) per row. A cache with spare blocks of noise,
    each row's blocks drawn from a random permutation; returns (q, k, v, block_tables,
    seq_lens, query_starts)."""
    lens = [c + n for c, n in rows]
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 3
    shape = (num_blocks, block_size, kv_heads, dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    tokens = sum(n for _, n in rows)
    q = (torch.randn(tokens, heads, dim, generator=gen) * q_scale).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(rows), max(needed), dtype=torch.int64)
    used = 0
    for row, count in enumerate(needed):
        tables[row, :count] = order[used : used + count]
        used += count
    starts = [0]
    for _, n in rows:
        starts.append(starts[-1] + n)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query_starts = torch.tensor(starts, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k, v, tables, seq_lens, query_starts))


def _reference(q, k, v, tables, seq_lens, query_starts, scale):
    q64, k64, v64 = to64(q, k, v)
    return reference.paged_prefill_attention(
        q64, k64, v64, tables.cpu(), seq_lens.cpu(), query_starts.cpu(), scale
    )


def _sdpa(q, k, v, tables, seq_lens, query_starts, **batch_options):
    """The engine's SDPA prefill path on the same rows."""
    block_size = k.shape[1]
    lens, starts = seq_lens.tolist(), query_starts.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    used = [tables[b, : -(-n // block_size)].tolist() for b, n in enumerate(lens)]
    batch = make_attention_batch(used, lens, q_lens, block_size, q.device, **batch_options)
    return paged_attention(q, k, v, batch, q.shape[-1] ** -0.5)


CASES = [
    (4, 4, 24, 16, [(0, 5), (16, 3), (40, 20), (7, 1)]),  # no GQA; fresh, cached, one-token rows
    (4, 2, 40, 16, [(17, 2), (0, 33)]),  # group 2
    (6, 2, 40, 5, [(3, 70), (0, 1), (12, 9)]),  # group 3, block 5: 210 pairs, several blocks
    (16, 2, 64, 16, [(0, 20), (70, 6)]),  # group 8: a query block holds 8 queries
]
CASE_IDS = ["mha", "group2", "group3-block5", "group8"]


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size", "rows"), CASES, ids=CASE_IDS)
def test_three_way(gen, device, dtype, heads, kv_heads, dim, block_size, rows):
    case = _case(gen, rows, heads, kv_heads, dim, block_size, dtype, device)
    scale = dim**-0.5
    want = _reference(*case, scale)
    got = paged_prefill_attention(*case, scale)
    q = case[0]
    assert got.dtype == dtype and got.shape == q.shape and got.device == q.device
    kernel = triton_prefill_rounding(dtype, device)
    assert_within(got, want, paged_prefill_bound(*case, scale, **kernel), "kernel")
    sdpa = sdpa_rounding(dtype, device)
    for causal_rows in (False, True):
        got = _sdpa(*case, causal_rows=causal_rows)
        bound = paged_prefill_bound(*case, scale, **sdpa)
        assert_within(got, want, bound, f"sdpa (causal_rows={causal_rows})")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_scale", [1e2, 1e4])
def test_extreme_scores_stay_finite(gen, device, dtype, q_scale):
    """Scores in the thousands: the running max keeps every exp() in range; the tolerance comes
    from the error model (``attention_error_bound``), which grows with |q|·|k|."""
    case = _case(gen, [(9, 4), (0, 7)], 4, 2, 24, 4, dtype, device, q_scale=q_scale)
    want = _reference(*case, 24**-0.5)
    got = paged_prefill_attention(*case, 24**-0.5)
    assert torch.isfinite(got).all()
    bound = paged_prefill_bound(*case, 24**-0.5, **triton_prefill_rounding(dtype, device))
    assert_within(got, want, bound, "kernel")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_int32_tables_and_trusted_length(gen, device):
    """``q`` a non-contiguous view, ``block_tables`` int32 and wider than needed, one KV pool
    layer of a ``[layers, ...]`` tensor, as the engine passes them; ``max_query_len`` given
    launches the same kernel as the checked call."""
    q, k, v, tables, seq_lens, starts = _case(
        gen, [(5, 4), (20, 6)], 6, 3, 40, 8, torch.float32, device
    )
    q_wide = torch.randn(10, 6, 64, generator=gen).to(device)
    q_wide[..., :40] = q
    pool_k = torch.stack([torch.randn_like(k), k])
    wide = torch.cat([tables, torch.full_like(tables, 10**6)], dim=1).to(torch.int32)
    got = paged_prefill_attention(q_wide[..., :40], pool_k[1], v, wide, seq_lens, starts, 0.3)
    want = _reference(q, k, v, tables, seq_lens, starts, 0.3)
    assert_within(got, want, paged_prefill_bound(q, k, v, tables, seq_lens, starts, 0.3), "kernel")
    trusted = paged_prefill_attention(
        q_wide[..., :40], pool_k[1], v, wide, seq_lens, starts, 0.3, max_query_len=6
    )
    assert torch.equal(trusted, got)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(14, 2, 64), (9, 3, 64), (32, 8, 128)],
    ids=["qwen2-0.5b", "smollm2-135m", "llama-8b"],
)
def test_gpu_bf16_realistic(gen, heads, kv_heads, dim):
    """The serving shapes: many short chunks after long cached prompts, and fresh prompts."""
    rows = [(int(c), int(n)) for c, n in zip(
        torch.randint(0, 1500, (24,), generator=gen), torch.randint(1, 40, (24,), generator=gen),
        strict=True,
    )] + [(0, 700), (112, 16)]  # fmt: skip
    case = _case(gen, rows, heads, kv_heads, dim, 16, torch.bfloat16, "cuda")
    scale = dim**-0.5
    want = _reference(*case, scale)
    got = paged_prefill_attention(*case, scale)
    rounding = triton_prefill_rounding(torch.bfloat16, "cuda")
    assert_within(got, want, paged_prefill_bound(*case, scale, **rounding), "kernel")
    sdpa = sdpa_rounding(torch.bfloat16, "cuda")
    assert_within(_sdpa(*case), want, paged_prefill_bound(*case, scale, **sdpa), "sdpa")


# -- bad inputs -------------------------------------------------------------------------------


def _good():
    gen = torch.Generator().manual_seed(0)
    names = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_starts")
    case = _case(gen, [(3, 2), (5, 4)], 4, 2, 8, 4, torch.float32, "cpu")
    return dict(zip(names, case, strict=True)) | {"scale": 0.5}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(6, 4 * 8)}, r"q must be \[batch, heads, head_dim\]"),
        ({"q": torch.zeros(6, 3, 8)}, r"heads \(3\) must be a multiple of .* kv_heads \(2\)"),
        ({"k_cache": "half"}, "k_cache dtype torch.float16 differs"),
        ({"block_tables": torch.zeros(6, dtype=torch.long)}, r"block_tables must be \[rows"),
        ({"seq_lens": torch.tensor([5])}, r"seq_lens must be \[batch=2\]"),
        ({"query_starts": torch.tensor([0, 6])}, r"query_starts must be \[rows \+ 1 = 3\]"),
        ({"query_starts": torch.tensor([0.0, 2.0, 6.0])}, "query_starts must be"),
    ],
)
def test_bad_shapes_and_dtypes(change, message):
    args = _good()
    for name, value in change.items():
        args[name] = getattr(args[name], value)() if isinstance(value, str) else value
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**args)


@needs_triton
@pytest.mark.skipif(not triton_available("cpu"), reason="needs Triton's interpreter")
@pytest.mark.parametrize(
    ("change", "extra", "message"),
    [
        ({"query_starts": torch.tensor([0, 2, 5])}, {}, "must run from 0 to q's 6 tokens"),
        ({"query_starts": torch.tensor([1, 2, 6])}, {}, "must run from 0 to q's 6 tokens"),
        ({"query_starts": torch.tensor([0, 0, 6])}, {}, "row 0 has 0 queries and 5 keys"),
        ({"seq_lens": torch.tensor([5, 3])}, {}, "row 1 has 4 queries and 3 keys"),
        ({"seq_lens": torch.tensor([5, 13])}, {}, r"seq_lens\[1\] = 13 exceeds block_tables"),
        ({}, {"max_query_len": 0}, "max_query_len must be >= 1"),
    ],
)
def test_bad_lengths(change, extra, message):
    args = _good() | change
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**args, **extra)


def test_refuses_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available("cpu")
    with pytest.raises(RuntimeError, match="cannot run here"):
        paged_prefill_attention(**_good())
