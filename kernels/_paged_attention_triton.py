"""The Triton side of ``_paged_attention``: the decode kernels (forward and split merge), the
prefill kernel, and their launches. Imported on first
use only (it imports Triton, and Triton reads ``TRITON_INTERPRET`` when these kernels are
decorated, i.e. when this module is imported)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_LOG2E = math.log2(math.e)
_MAX_SPLITS = 64
_TILE_ELEMENTS = 8192
COMPILE_OPTIONS = {"enable_fp_fusion": False}
"""Compiler options of every kernel here. No multiply-add contraction: the compiler computes the
probabilities ``2^(s·c - m)`` once per register layout (one feeds ``Σ p``, the other ``Σ p v``)
and may contract one copy into an FMA and not the other; the numerator and denominator then
weigh the same key differently, by up to an ulp of the score, an output error that grows with
``|s|`` (measured on an H100: 0.5% at scores ~1e4) and that no normalization removes. Without
contraction both copies round alike, as in the interpreter."""
"""Largest ``[BLOCK_GROUP, TILE_N, BLOCK_D]`` product a program materializes (fp32): 64 values
per thread at 4 warps."""


@triton.jit
def _exp2(x, PRECISE: tl.constexpr):
    """2^x. ``tl.exp2`` is the GPU's fast approximation (fine under bf16/fp16 rounding);
    ``PRECISE`` (fp32 inputs) takes libdevice's full-precision ``exp2f``."""
    if PRECISE:
        return libdevice.exp2(x)
    else:
        return tl.exp2(x)


@triton.jit
def _div(a, b, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _paged_decode_fwd_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    BLOCK_TABLES,
    SEQ_LENS,
    OUT,
    PARTIAL_OUT,
    PARTIAL_LSE,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_tm,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    qk_scale,
    tokens_per_split,
    GROUP: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """One (sequence, kv_head, split): online softmax over the split's keys for the
    ``GROUP`` query heads of this KV head. ``qk_scale`` = softmax scale * log2(e)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # [BLOCK_GROUP] query heads of this KV head

    seq_len = tl.load(SEQ_LENS + seq).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    q_ptrs = (
        Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_GROUP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_D], dtype=tl.float32)
    table_row = BLOCK_TABLES + seq.to(tl.int64) * stride_tb
    k_head = K_CACHE + kv_head.to(tl.int64) * stride_kh
    v_head = V_CACHE + kv_head.to(tl.int64) * stride_vh

    for tile_start in range(start, end, TILE_N):
        pos = tile_start + offs_n  # [TILE_N] token positions in the sequence
        mask_n = pos < end
        block = tl.load(table_row + (pos // KV_BLOCK_SIZE) * stride_tm, mask=mask_n, other=0)
        block = block.to(tl.int64)
        offset = pos % KV_BLOCK_SIZE
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k_ptrs = (
            k_head
            + block[:, None] * stride_kn
            + offset[:, None] * stride_kt
            + offs_d[None, :] * stride_kd
        )
        k = tl.load(k_ptrs, mask=mask_nd, other=0.0).to(tl.float32)  # [TILE_N, BLOCK_D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale
        scores = tl.where(mask_n[None, :], scores, float("-inf"))  # [BLOCK_GROUP, TILE_N]

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: the tile has a key
        alpha = _exp2(m_i - m_new, PRECISE)
        p = _exp2(scores - m_new[:, None], PRECISE)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = (
            v_head
            + block[:, None] * stride_vn
            + offset[:, None] * stride_vt
            + offs_d[None, :] * stride_vd
        )
        v = tl.load(v_ptrs, mask=mask_nd, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    # an empty split (a sequence shorter than this split's start) has l = 0: write 0 there
    has_keys = l_i > 0.0
    out = _div(acc, tl.where(has_keys, l_i, 1.0)[:, None], PRECISE)
    if NUM_SPLITS == 1:
        o_ptrs = (
            OUT
            + seq.to(tl.int64) * stride_ob
            + heads[:, None] * stride_oh
            + offs_d[None, :] * stride_od
        )
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        p_ptrs = (
            PARTIAL_OUT
            + seq.to(tl.int64) * stride_pb
            + heads[:, None] * stride_ph
            + split * stride_ps
            + offs_d[None, :]
        )
        tl.store(p_ptrs, out, mask=mask_g[:, None] & mask_d[None, :])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        lse_ptrs = PARTIAL_LSE + seq.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(lse_ptrs, lse, mask=mask_g)


@triton.jit
def _paged_decode_reduce_kernel(
    PARTIAL_OUT,
    PARTIAL_LSE,
    OUT,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """One (sequence, head): merge the splits, ``out = Σ_s 2^(lse_s - M) o_s / Σ_s 2^(lse_s
    - M)`` with ``M = max_s lse_s`` (base-2 log-sum-exps from the first kernel)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(
        PARTIAL_LSE + seq * stride_lb + head * stride_lh + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights all 0
    weight = _exp2(lse - top, PRECISE)  # [BLOCK_SPLITS], 0 for empty and padded splits
    p_ptrs = (
        PARTIAL_OUT
        + seq * stride_pb
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :]
    )
    partial = tl.load(p_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = _div(
        tl.sum(partial * weight[:, None], axis=0), tl.where(total > 0.0, total, 1.0), PRECISE
    )
    o_ptrs = OUT + seq * stride_ob + head * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=mask_d)


def _tile_tokens(row_elements: int, max_seq_len: int) -> int:
    """Keys per loop step: a power of two in 16..128 keeping the ``[group, tile, head_dim]``
    products within ``_TILE_ELEMENTS``, and no longer than the longest sequence needs."""
    fit = 1 << max(0, (_TILE_ELEMENTS // row_elements).bit_length() - 1)
    return max(16, min(128, fit, triton.next_power_of_2(max_seq_len)))


def _default_splits(programs: int, tiles: int, device: torch.device) -> int:
    """Enough splits that ``programs * splits`` fills the GPU about twice, each split keeping
    at least two tiles of keys."""
    if device.type == "cuda" and torch.cuda.is_available():
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # the interpreter: a split or two is all a test needs
    splits = -(-target // max(programs, 1))
    return max(1, min(splits, -(-tiles // 2), _MAX_SPLITS))


def interpreted() -> bool:
    """Were the kernels decorated for Triton's interpreter (so they run on CPU tensors)?"""
    return type(_paged_decode_fwd_kernel).__name__ == "InterpretedFunction"


def paged_decode_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None,
) -> torch.Tensor:
    """Launch on checked inputs (``_paged_attention.paged_decode_attention``); ``[B, H, D]``."""
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = heads // kv_heads
    # fp32 inputs: full-precision exp2 and division on the GPU (the interpreter is exact anyway)
    precise = q.dtype == torch.float32 and not interpreted()
    block_group = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(dim)
    tile_n = _tile_tokens(block_group * block_d, max_seq_len)
    if num_splits is None:
        num_splits = _default_splits(batch * kv_heads, -(-max_seq_len // tile_n), q.device)
    split_tokens = -(-max_seq_len // num_splits)
    tile_n = min(tile_n, max(16, triton.next_power_of_2(split_tokens)))
    tokens_per_split = -(-split_tokens // tile_n) * tile_n
    num_splits = -(-max_seq_len // tokens_per_split)  # no split without keys in every row
    if num_splits > 1:
        partial_out = torch.empty(
            (batch, heads, num_splits, block_d), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
        partial_strides = (*partial_out.stride()[:3], *partial_lse.stride()[:2])
    else:  # unused: the first kernel writes ``out`` itself
        partial_out = partial_lse = out
        partial_strides = (0, 0, 0, 0, 0)
    _paged_decode_fwd_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        *partial_strides,
        float(scale) * _LOG2E,
        tokens_per_split,
        GROUP=group,
        BLOCK_GROUP=block_group,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        KV_BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        PRECISE=precise,
        num_warps=4 if block_group * tile_n * block_d <= _TILE_ELEMENTS else 8,
        **COMPILE_OPTIONS,
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(batch, heads)](
            partial_out,
            partial_lse,
            out,
            *partial_strides,
            *out.stride(),
            HEAD_DIM=dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            PRECISE=precise,
            num_warps=4,
            **COMPILE_OPTIONS,
        )
    return out


@triton.jit
def _paged_prefill_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    BLOCK_TABLES,
    SEQ_LENS,
    QUERY_STARTS,
    OUT,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_tm,
    stride_ot,
    stride_oh,
    stride_od,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (row, kv_head, query block): ``BLOCK_M`` (query, head) pairs of one KV head, the
    ``GROUP`` heads of a query side by side, attend causally over the row's paged keys with an
    online softmax (base 2; ``qk_scale`` = softmax scale * log2(e)). Both products are
    ``tl.dot`` on fp32 operands at ``DOT_PRECISION``."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M

    q_first = tl.load(QUERY_STARTS + row).to(tl.int32)
    q_len = tl.load(QUERY_STARTS + row + 1).to(tl.int32) - q_first
    if m_start >= q_len * GROUP:
        return
    seq_len = tl.load(SEQ_LENS + row).to(tl.int32)
    context = seq_len - q_len  # keys before this step's queries

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    query = offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    mask_m = query < q_len
    mask_d = offs_d < HEAD_DIM
    # a padded pair reads as the row's last query (finite scores; never stored)
    last_query = tl.minimum(query, q_len - 1)
    visible = context + last_query  # the last key each pair sees

    token = (q_first + last_query).to(tl.int64)
    q_ptrs = (
        Q + token[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=mask_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = BLOCK_TABLES + row.to(tl.int64) * stride_tb
    k_head = K_CACHE + kv_head.to(tl.int64) * stride_kh
    v_head = V_CACHE + kv_head.to(tl.int64) * stride_vh
    end = context + tl.minimum((m_start + BLOCK_M - 1) // GROUP, q_len - 1) + 1

    for tile_start in range(0, end, TILE_N):
        pos = tile_start + offs_n  # [TILE_N] key positions
        mask_n = pos < end
        block = tl.load(table_row + (pos // KV_BLOCK_SIZE) * stride_tm, mask=mask_n, other=0)
        block = block.to(tl.int64)
        offset = pos % KV_BLOCK_SIZE
        k_ptrs = (
            k_head
            + block[None, :] * stride_kn
            + offset[None, :] * stride_kt
            + offs_d[:, None] * stride_kd
        )
        k = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        seen = (pos[None, :] <= visible[:, None]) & mask_n[None, :]
        scores = tl.where(seen, scores, float("-inf"))

        # finite from the first tile on: key 0 is in it and every pair sees it
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = _exp2(m_i - m_new, PRECISE)
        p = _exp2(scores - m_new[:, None], PRECISE)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = (
            v_head
            + block[:, None] * stride_vn
            + offset[:, None] * stride_vt
            + offs_d[None, :] * stride_vd
        )
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = _div(acc, l_i[:, None], PRECISE)
    o_ptrs = (
        OUT
        + (q_first + query).to(tl.int64)[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_tiles(group: int, dim: int, max_query_len: int, fp32: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, TILE_N, num_warps)`` of the prefill kernel: query blocks of 16-64 (query,
    head) pairs, 16-32 for fp32 (no longer than the longest row needs), 64-key tiles for 16-bit
    heads of up to 64 dims and 32-key tiles otherwise, 8 warps for the larger tiles and for
    fp32 (sized with ptxas's register report for sm_90: larger tiles or fewer warps spill)."""
    block_m = max(16, min(32 if fp32 else 64, triton.next_power_of_2(max_query_len * group)))
    tile_n = 64 if dim <= 64 and not fp32 else 32
    return block_m, tile_n, 8 if fp32 or block_m * tile_n >= 2048 else 4


def paged_prefill_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Launch on checked inputs (``_paged_attention.paged_prefill_attention``); ``[T, H, D]``."""
    tokens, heads, dim = q.shape
    rows = seq_lens.shape[0]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or rows == 0:
        return out
    group = heads // kv_heads
    fp32 = q.dtype == torch.float32
    # fp32 inputs: exact products and libdevice exp2/division; 16-bit inputs are exact in tf32,
    # so only the probabilities lose bits (truncated to tf32 by the tensor cores) before their
    # product with V
    precise = fp32 and not interpreted()
    block_m, tile_n, warps = prefill_tiles(group, dim, max_query_len, fp32)
    grid = (rows, kv_heads, triton.cdiv(max_query_len * group, block_m))
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_starts,
        out,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        float(scale) * _LOG2E,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        KV_BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        PRECISE=precise,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=warps,
        **COMPILE_OPTIONS,
    )
    return out
