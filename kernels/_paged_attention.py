"""Paged decode attention in Triton: one query token per sequence over a block-table KV cache.

Split-K "flash decoding" in two launches:

1. ``_paged_decode_fwd_kernel``, grid ``(sequence, kv_head, split)``. A program owns one KV
   head of one sequence and one contiguous slice of its keys; it loads the query rows of every
   query head that reads this KV head (grouped-query attention: K/V are read once per group),
   walks its slice ``TILE_N`` tokens at a time (a tile may span several KV blocks: each token's
   block comes from the block table) and keeps an online softmax (running max ``m``, running
   sum ``l``, fp32 accumulator; Milakov & Gimelshein 2018, Dao et al. 2022). With one split it
   writes the normalized output; otherwise the slice's normalized partial output and its
   log-sum-exp, in fp32.
2. ``_paged_decode_reduce_kernel``, grid ``(sequence, head)``: merges the splits' partials,
   weighting each by ``exp(lse_s - max lse)``.

Both products are broadcast multiplies reduced with ``tl.sum`` in fp32, not ``tl.dot``: a GQA
group has 1-8 query heads, fewer than the 16 rows ``tl.dot`` wants on GPU (padding would mostly
multiply zeros), and Triton's interpreter multiplies bf16 ``tl.dot`` operands as raw integers,
so the tests could not check that path. The launcher sizes ``TILE_N`` so that the
``[group, TILE_N, head_dim]`` products stay within ``_TILE_ELEMENTS`` fp32 values.

Scores are computed in base 2 (``scale * log2(e)`` folded into one multiply, ``exp2``). For fp32
inputs on a GPU, ``exp2`` and the final division are libdevice's full-precision ones rather
than the hardware approximations (on an H100 the fast path's fp32 errors grew with the score
magnitude, far past fp32 rounding; bf16/fp16 rounding hides them). Shapes need not be powers of
two: head_dim, the GQA group, the KV block size and the sequence lengths
are padded up to power-of-two tiles and masked on every load and store.

The kernels live in ``_paged_attention_triton``, imported on first use: this module imports
without Triton, ``triton_available(device)`` says whether the kernel can run, and
``paged_decode_attention`` raises ``RuntimeError`` when it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton import require_triton, triton_available

__all__ = ["paged_decode_attention", "paged_prefill_attention", "triton_available"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    batch: int | None = None,
) -> None:
    """``batch``: the sequences (default ``q``'s first dimension; the prefill kernel's ``q``
    holds tokens)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    heads, dim = q.shape[1:]
    batch = q.shape[0] if batch is None else batch
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} differs from q's head_dim {dim}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"q's heads ({heads}) must be a multiple of k_cache's kv_heads ({kv_heads})"
        )
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype must be float32, float16 or bfloat16, got {q.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != q.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} differs from q dtype {q.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [batch={batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables dtype must be int32 or int64, got {block_tables.dtype}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [batch={batch}], got {tuple(seq_lens.shape)}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens dtype must be int32 or int64, got {seq_lens.dtype}")
    for name, tensor in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")


def _check_lengths(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_blocks: int
) -> int:
    """Read ``seq_lens`` and the used part of ``block_tables`` back (one host sync) and check
    them; returns the longest length."""
    lens = seq_lens.to("cpu", torch.int64)
    tables = block_tables.to("cpu", torch.int64)
    capacity = tables.shape[1] * block_size
    if int(lens.min()) < 1:
        raise ValueError(f"seq_lens must be >= 1, got {lens.tolist()}")
    longest = int(lens.max())
    if longest > capacity:
        row = int(lens.argmax())
        raise ValueError(
            f"seq_lens[{row}] = {longest} exceeds block_tables capacity "
            f"({tables.shape[1]} blocks x {block_size} tokens = {capacity})"
        )
    used = torch.arange(tables.shape[1]) < -(-lens[:, None] // block_size)
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{row}, {col}] = {int(tables[row, col])} is not a block of the cache "
            f"(0..{num_blocks - 1})"
        )
    return longest


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | Sequence[int],
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One decode step of attention over a paged KV cache (Triton).

    - ``q``: ``[B, H, D]``, each sequence's newest query (float32, float16 or bfloat16).
    - ``k_cache``/``v_cache``: ``[num_blocks, block_size, KVH, D]``, ``q``'s dtype; query head
      ``h`` reads KV head ``h // (H / KVH)``.
    - ``block_tables``: ``[B, max_blocks]`` int32/int64; sequence ``b``'s token ``i`` is in block
      ``block_tables[b, i // block_size]`` at offset ``i % block_size``.
    - ``seq_lens``: ``[B]`` int32/int64, each sequence's number of keys (>= 1).
    - ``max_seq_len``: the largest ``seq_lens`` when the caller knows it. Given, it is trusted
      (longer sequences would be cut) and nothing is read back from the device; without it the
      wrapper reads ``seq_lens`` and ``block_tables`` once and checks every length and used
      table entry.
    - ``num_splits``: how many slices each sequence's keys are split into (flash decoding);
      default: enough to fill the GPU.

    Returns ``softmax(scale · q Kᵀ) V`` as ``[B, H, D]`` in ``q``'s dtype (fp32 accumulation).
    Raises ``ValueError`` on bad arguments, ``RuntimeError`` when Triton cannot run here.
    """
    if not torch.is_tensor(seq_lens):
        seq_lens = torch.tensor(list(seq_lens), dtype=torch.int64, device=q.device)
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    _require_triton(q.device)
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if batch == 0:
        return torch.empty_like(q)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if max_seq_len is None:
        max_seq_len = _check_lengths(seq_lens, block_tables, block_size, num_blocks)
    elif not 1 <= max_seq_len <= block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seq_len = {max_seq_len} must be in 1..{block_tables.shape[1] * block_size} "
            "(the block_tables capacity)"
        )
    from ._paged_attention_triton import paged_decode_forward

    return paged_decode_forward(
        q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, num_splits
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed prefill chunks over a paged KV cache (Triton): each row's new
    query tokens attend to its cached keys and to themselves, in one launch for every row.

    - ``q``: ``[T, H, D]``, the rows' query tokens packed row after row (float32, float16 or
      bfloat16).
    - ``k_cache``/``v_cache``: ``[num_blocks, block_size, KVH, D]``, ``q``'s dtype, already
      holding the queries' own keys and values; query head ``h`` reads KV head ``h // (H /
      KVH)``.
    - ``block_tables``: ``[B, max_blocks]`` int32/int64, as in ``paged_decode_attention``.
    - ``seq_lens``: ``[B]`` int32/int64, each row's keys (its cached context plus its queries).
    - ``query_starts``: ``[B + 1]`` int32/int64, row ``b``'s queries are
      ``q[query_starts[b]:query_starts[b + 1]]``, the last ``q_len`` of its ``seq_lens[b]``
      positions (query ``i`` sits at ``seq_len - q_len + i`` and sees keys ``0..`` that).
      ``query_starts[0]`` is 0 and ``query_starts[B]`` is ``T``.
    - ``max_query_len``: the longest row's query count when the caller knows it: then it is
      trusted and nothing is read back from the device; without it the wrapper reads the
      lengths and the used table entries once and checks them.

    Returns ``[T, H, D]`` in ``q``'s dtype (fp32 accumulation). Raises ``ValueError`` on bad
    arguments, ``RuntimeError`` when Triton cannot run here.
    """
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be [rows, max_blocks], got {tuple(block_tables.shape)}"
        )
    rows = block_tables.shape[0]
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, batch=rows)
    if query_starts.shape != (rows + 1,) or query_starts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"query_starts must be [rows + 1 = {rows + 1}] int32/int64, got "
            f"{tuple(query_starts.shape)} {query_starts.dtype}"
        )
    if query_starts.device != q.device:
        raise ValueError(f"query_starts is on {query_starts.device}, q on {q.device}")
    _require_triton(q.device, "paged_prefill_attention")
    num_blocks, block_size = k_cache.shape[:2]
    if rows == 0:
        if q.shape[0]:
            raise ValueError(f"q has {q.shape[0]} tokens and there are no rows")
        return torch.empty_like(q)
    if max_query_len is None:
        _check_lengths(seq_lens, block_tables, block_size, num_blocks)
        starts = query_starts.to("cpu", torch.int64)
        lens = seq_lens.to("cpu", torch.int64)
        q_lens = starts[1:] - starts[:-1]
        if int(starts[0]) != 0 or int(starts[-1]) != q.shape[0]:
            raise ValueError(
                f"query_starts must run from 0 to q's {q.shape[0]} tokens, got "
                f"{int(starts[0])}..{int(starts[-1])}"
            )
        bad = ((q_lens < 1) | (q_lens > lens)).nonzero()
        if len(bad):
            row = int(bad[0])
            raise ValueError(
                f"row {row} has {int(q_lens[row])} queries and {int(lens[row])} keys (a row "
                "needs 1..seq_len queries)"
            )
        max_query_len = int(q_lens.max())
    elif max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    from ._paged_attention_triton import paged_prefill_forward

    return paged_prefill_forward(
        q, k_cache, v_cache, block_tables, seq_lens, query_starts, scale, max_query_len
    )


def _require_triton(device: torch.device, name: str = "paged_decode_attention") -> None:
    """``RuntimeError`` saying why, unless the kernel can run on ``device``."""
    require_triton(device, name)
    if device.type != "cuda":
        from ._paged_attention_triton import interpreted

        if not interpreted():
            raise RuntimeError(
                f"{name} cannot run on CPU tensors: its kernels were compiled for "
                "the GPU (TRITON_INTERPRET was set after they were first used)"
            )
