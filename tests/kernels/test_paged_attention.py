"""paged_decode_attention: the Triton kernel and the engine's SDPA decode path (working dtype)
against the float64 token-by-token reference, on fresh random caches with shuffled block
tables."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES, needs_triton
from numerics import (
    assert_within,
    paged_decode_bound,
    sdpa_rounding,
    to64,
    triton_decode_rounding,
)

from agentrl.engine._kv import make_attention_batch, paged_attention
from agentrl.kernels import reference
from agentrl.kernels._paged_attention import paged_decode_attention, triton_available


def _case(gen, lens, heads, kv_heads, dim, block_size, dtype, device, *, q_scale=1.0):
    """A cache with spare blocks full of noise (padding must never leak in), each sequence's
    blocks drawn from a random permutation; returns (q, k, v, block_tables, seq_lens)."""
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 3
    shape = (num_blocks, block_size, kv_heads, dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    q = (torch.randn(len(lens), heads, dim, generator=gen) * q_scale).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(needed), dtype=torch.int64)
    used = 0
    for row, count in enumerate(needed):
        tables[row, :count] = order[used : used + count]
        used += count
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k, v, tables, seq_lens))


def _sdpa(q, k, v, tables, seq_lens):
    """The engine's decode path: SDPA over blocks gathered with ``index_select``."""
    block_size = k.shape[1]
    lens = seq_lens.tolist()
    rows = [tables[b, : -(-n // block_size)].tolist() for b, n in enumerate(lens)]
    batch = make_attention_batch(rows, lens, [1] * len(lens), block_size)
    mask = batch.decode_mask
    batch = batch._replace(
        block_tables=batch.block_tables.to(q.device),
        decode_mask=None if mask is None else mask.to(q.device),
    )
    return paged_attention(q, k, v, batch, q.shape[-1] ** -0.5)


def _reference(q, k, v, tables, seq_lens, scale) -> torch.Tensor:
    """The float64 reference on the values the implementations read (not rounded again)."""
    q64, k64, v64 = to64(q, k, v)
    return reference.paged_decode_attention(q64, k64, v64, tables.cpu(), seq_lens.cpu(), scale)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_splits", [None, 3], ids=["splits-auto", "splits-3"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "lens"),
    [
        (4, 4, 24, 16, [1, 15, 17, 33]),  # no GQA
        (4, 2, 40, 16, [17, 1, 33]),  # group 2
        (8, 2, 24, 8, [15, 33]),  # group 4
        (6, 2, 40, 5, [1, 17, 33]),  # group 3, a block size that is not a power of two
        (16, 2, 64, 16, [1, 70, 200]),  # group 8: 16-key tiles, many per split
    ],
    ids=["mha", "group2", "group4", "group3-block5", "group8-long"],
)
def test_three_way(gen, device, dtype, num_splits, heads, kv_heads, dim, block_size, lens):
    q, k, v, tables, seq_lens = _case(gen, lens, heads, kv_heads, dim, block_size, dtype, device)
    scale = dim**-0.5
    want = _reference(q, k, v, tables, seq_lens, scale)
    got = paged_decode_attention(q, k, v, tables, seq_lens, scale, num_splits=num_splits)
    assert got.dtype == dtype and got.shape == q.shape and got.device == q.device
    case = (q, k, v, tables, seq_lens, scale)
    kernel = triton_decode_rounding(dtype, device, num_splits, max(lens))
    assert_within(got, want, paged_decode_bound(*case, **kernel), "kernel")
    got = _sdpa(q, k, v, tables, seq_lens)
    assert_within(got, want, paged_decode_bound(*case, **sdpa_rounding(dtype, device)), "sdpa")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_scale", [1e2, 1e4])
def test_extreme_scores_stay_finite(gen, device, dtype, q_scale):
    """Scores in the thousands: the running max keeps every exp() in range (no inf, no NaN);
    the softmax is then nearly one-hot, and a score that large carries an absolute rounding
    error proportional to |q|·|k| (``attention_error_bound``), so the tolerance comes from that
    error model rather than from one machine's result."""
    lens = [33, 1, 17]
    q, k, v, tables, seq_lens = _case(gen, lens, 4, 2, 24, 16, dtype, device, q_scale=q_scale)
    want = _reference(q, k, v, tables, seq_lens, 24**-0.5)
    for num_splits in (1, 2):
        got = paged_decode_attention(q, k, v, tables, seq_lens, 24**-0.5, num_splits=num_splits)
        precision = triton_decode_rounding(dtype, device, num_splits, max(lens))
        bound = paged_decode_bound(q, k, v, tables, seq_lens, 24**-0.5, **precision)
        assert_within(got, want, bound, f"splits={num_splits}")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_int32_tables(gen, device):
    """``q`` a non-contiguous view, ``block_tables`` int32 and wider than needed, one KV pool
    layer taken from a ``[layers, ...]`` tensor, as the engine passes it."""
    q, k, v, tables, seq_lens = _case(gen, [9, 26], 6, 3, 40, 8, torch.float32, device)
    q_wide = torch.randn(2, 6, 64, generator=gen).to(device)
    q_wide[..., :40] = q
    pool_k = torch.stack([torch.randn_like(k), k])
    wide = torch.cat([tables, torch.full_like(tables, 10**6)], dim=1).to(torch.int32)
    got = paged_decode_attention(q_wide[..., :40], pool_k[1], v, wide, seq_lens, 0.3)
    want = _reference(q, k, v, tables, seq_lens, 0.3)
    precision = triton_decode_rounding(torch.float32, device, None, 26)
    bound = paged_decode_bound(q, k, v, tables, seq_lens, 0.3, **precision)
    assert_within(got, want, bound, "kernel")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_trusted_max_seq_len_matches_checked(gen, device):
    q, k, v, tables, seq_lens = _case(gen, [5, 40, 23], 4, 2, 16, 16, torch.bfloat16, device)
    checked = paged_decode_attention(q, k, v, tables, seq_lens, 0.25)
    trusted = paged_decode_attention(q, k, v, tables, seq_lens, 0.25, max_seq_len=40)
    assert torch.equal(checked, trusted)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(14, 2, 64), (9, 3, 64), (32, 8, 128)],
    ids=["qwen2-0.5b", "smollm2-135m", "llama-8b"],
)
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_gpu_bf16_realistic(gen, heads, kv_heads, dim, batch):
    lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    lens[0] = 2999  # one long row sets the split sizes
    q, k, v, tables, seq_lens = _case(gen, lens, heads, kv_heads, dim, 16, torch.bfloat16, "cuda")
    scale = dim**-0.5
    want = _reference(q, k, v, tables, seq_lens, scale)
    got = paged_decode_attention(q, k, v, tables, seq_lens, scale)
    case = (q, k, v, tables, seq_lens, scale)
    kernel = triton_decode_rounding(torch.bfloat16, "cuda", None, max(lens))
    assert_within(got, want, paged_decode_bound(*case, **kernel), "kernel")
    sdpa = sdpa_rounding(torch.bfloat16, "cuda")
    assert_within(_sdpa(q, k, v, tables, seq_lens), want, paged_decode_bound(*case, **sdpa), "sdpa")
    # the checked path computes the same max_seq_len, hence the same launch: the same bits
    trusted = paged_decode_attention(q, k, v, tables, seq_lens, scale, max_seq_len=max(lens))
    assert torch.equal(trusted, got)


# -- bad inputs -------------------------------------------------------------------------------


def _good():
    gen = torch.Generator().manual_seed(0)
    return dict(
        zip(
            ("q", "k_cache", "v_cache", "block_tables", "seq_lens"),
            _case(gen, [5, 9], 4, 2, 8, 4, torch.float32, "cpu"),
            strict=True,
        )
    ) | {"scale": 0.5}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(2, 4 * 8)}, r"q must be \[batch, heads, head_dim\]"),
        ({"k_cache": torch.zeros(4, 4, 8)}, "k_cache must be"),
        ({"v_cache": torch.zeros(6, 4, 2, 4)}, "v_cache shape"),
        ({"q": torch.zeros(2, 4, 6)}, "head_dim 8 differs from q's head_dim 6"),
        ({"q": torch.zeros(2, 3, 8)}, r"heads \(3\) must be a multiple of .* kv_heads \(2\)"),
        ({"q": torch.zeros(2, 4, 8, dtype=torch.float64)}, "q dtype must be"),
        ({"k_cache": "half"}, "k_cache dtype torch.float16 differs"),
        ({"block_tables": "float"}, "block_tables dtype"),
        ({"block_tables": torch.zeros(3, 3, dtype=torch.long)}, r"block_tables must be \[batch"),
        ({"seq_lens": torch.tensor([5])}, r"seq_lens must be \[batch=2\]"),
        ({"seq_lens": torch.tensor([5.0, 9.0])}, "seq_lens dtype"),
    ],
)
def test_bad_shapes_and_dtypes(change, message):
    args = _good()
    for name, value in change.items():
        args[name] = getattr(args[name], value)() if isinstance(value, str) else value
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


@needs_triton
@pytest.mark.skipif(not triton_available("cpu"), reason="needs Triton's interpreter")
@pytest.mark.parametrize(
    ("change", "extra", "message"),
    [
        ({"seq_lens": torch.tensor([5, 13])}, {}, r"seq_lens\[1\] = 13 exceeds block_tables"),
        ({"seq_lens": torch.tensor([0, 9])}, {}, "seq_lens must be >= 1"),
        ({}, {"max_seq_len": 13}, "max_seq_len = 13 must be in 1..12"),
        ({}, {"num_splits": 0}, "num_splits must be >= 1"),
    ],
)
def test_bad_lengths(change, extra, message):
    args = _good() | change
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args, **extra)


@needs_triton
@pytest.mark.skipif(not triton_available("cpu"), reason="needs Triton's interpreter")
def test_bad_table_entry():
    args = _good()
    args["block_tables"] = args["block_tables"].clone()
    args["block_tables"][1, 2] = 99  # row 1 uses 3 blocks of 4 tokens
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\] = 99 is not a block"):
        paged_decode_attention(**args)


def test_refuses_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available("cpu")
    with pytest.raises(RuntimeError, match="cannot run here"):
        paged_decode_attention(**_good())
