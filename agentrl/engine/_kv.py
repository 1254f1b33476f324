"""The paged KV pool and the one attention function over it.

The pool is a fixed set of blocks of ``block_size`` tokens, per layer
``k, v: [num_blocks, block_size, kv_heads, head_dim]`` (model dtype), views of two tensors
``[layers, num_blocks, block_size, kv_heads, head_dim]``. A sequence's KV lives in the blocks its
*block table* lists, in order: token ``i`` is at block ``table[i // block_size]``, offset
``i % block_size`` (flat slot ``block * block_size + offset``). Blocks are handed out and taken
back through a free list; who owns a block (a request, a session, the radix tree) is tracked by
the owners, the pool only checks that nothing is freed twice.

``paged_attention`` is the single place that reads the cache. Prefill rows gather their blocks
and call torch SDPA, rows of similar lengths together in one padded call (``PrefillGroup``);
decode rows do the same by default (``decode_kernel="sdpa"``) or run the Triton paged-decode
kernel (``decode_kernel="triton"``, ``agentrl.kernels``), which reads the blocks in place
through the block table. ``_decode`` decides which, per engine.

Devices: the pool lives on one device (CPU or a CUDA GPU); ``make_attention_batch`` builds a
step's metadata tensors on that device once, so no layer copies or builds any.
"""

from __future__ import annotations

import array
import itertools
import os
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from agentrl._errors import EngineError
from agentrl.kernels import paged_decode_attention, paged_prefill_attention


def causal_bias_module():
    """``torch.nn.attention.bias``, imported on first use: it imports ``torch._dynamo`` (~2 s
    of a CPU), which nothing else of the engine needs. A KV pool off the CPU loads it when
    built, so no step (nor the attention chooser's measurement) pays for it."""
    import torch.nn.attention.bias as bias

    return bias


def lower_right_causal(q_len: int, n: int, device: torch.device) -> torch.Tensor:
    """The mask of ``q_len`` queries that are the last of ``n`` positions (query ``i`` sees keys
    ``0 .. n - q_len + i``): torch's ``causal_lower_right`` bias, which the flash and
    memory-efficient kernels take without a mask; on the CPU, where torch materialises that
    bias as this very boolean mask, the mask itself."""
    if device.type == "cpu":
        return torch.ones(q_len, n, dtype=torch.bool, device=device).tril(n - q_len)
    return causal_bias_module().causal_lower_right(q_len, n)


def device_memory_bytes(device: torch.device) -> int | None:
    """All the memory ``device`` has (a CUDA device's, or this machine's RAM for the CPU), or
    ``None`` when unknown: a KV pool larger than this can never be allocated there."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


class KVPool:
    """``num_blocks`` blocks of ``block_size`` tokens for ``num_layers`` layers.

    ``k``/``v``: ``[layers, num_blocks, block_size, kv_heads, head_dim]`` in ``dtype``, on
    ``device``. With ``pad_block=True`` they hold one block more, ``pad_block`` (index
    ``num_blocks``): never handed out, it is where the padding rows of a captured decode step
    write and read (``_graphs``); otherwise ``pad_block`` is ``None``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pad_block: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise EngineError(f"KV pool needs blocks, got {num_blocks} x {block_size} tokens")
        self.pad_block = num_blocks if pad_block else None
        shape = (num_layers, num_blocks + int(pad_block), block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.k.device
        if self.device.type != "cpu":
            causal_bias_module()  # the SDPA prefill path's lower-right bias, before any step
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def alloc(self, count: int) -> list[int]:
        """Take ``count`` free blocks; ``EngineError`` when fewer are free (callers check
        ``num_free`` and evict first)."""
        if count > len(self._free):
            raise EngineError(f"KV pool exhausted: {count} blocks wanted, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._is_free[block] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the free list; a double free is a bug and raises ``AssertionError``."""
        for block in blocks:
            assert not self._is_free[block], f"KV block {block} freed twice"
            self._is_free[block] = True
            self._free.append(block)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, block_size, kv_heads, head_dim]`` of layer ``index`` (one block
        more with a ``pad_block``)."""
        return self.k[index], self.v[index]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[T, kv_heads, head_dim]`` at flat ``slots`` ``[T]`` (int64)."""
        kv_heads, dim = k.shape[1], k.shape[2]
        self.k[layer].view(-1, kv_heads, dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, kv_heads, dim).index_copy_(0, slots, v)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V (every layer) from ``src`` to ``dst``."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


PREFILL_PAD = 2.0
"""How much padding one batched prefill call may add: a group's padded attention area
(``rows * longest chunk * longest row``) and padded keys (``rows * longest row``) stay within
this factor of what its rows need; rows that would pass it start another group."""


CAUSAL_MIN_QUERIES = 128
"""On the CPU, a prefill row alone in its group attends as a causal row (no mask tensor) when it
is a fresh prompt or has at least this many queries; a shorter chunk after cached keys runs the
folded, masked call. Measured with ``bench/prefill_bench.py --causal`` (docs/benchmarks.md)."""

PREFILL_MASK_ELEMENTS = 1 << 24
"""Most elements one padded group's mask may have (rows x longest chunk x padded keys; the
attention call repeats it per query head of a KV head): a step of thousands of tokens over long
contexts still builds masks of megabytes, not gigabytes. Rows that would pass it start another
group."""


class PrefillGroup(NamedTuple):
    """Prefill rows attended in one SDPA call, padded to ``q_max`` queries and ``span`` blocks.

    - ``rows``: the rows (indices into the batch), longest first.
    - ``src``: ``[Tg]`` int64, the rows' query tokens in the packed ``[T]`` step, row by row.
    - ``dst``: ``[Tg]`` int64, where each of them sits in the padded ``[len(rows) * q_max]``.
    - ``table``: ``[len(rows), span]`` int64, the rows' block tables (padded with block 0).
    - ``mask``: ``[len(rows), q_max, span * block_size]`` bool (``True`` = attend): causal,
      keys past the row's length hidden, padded queries see key 0 only (their output is
      dropped; a query that sees nothing would be NaN).

    A group of one row keeps it unpadded: ``src``/``dst``/``table`` are ``None``, ``span`` is
    0 and ``mask`` is the row's ``[q_len, seq_len]`` causal mask (its KV is then a view of the
    pool when its blocks form one run), or ``None`` for a *causal row*: its queries attend
    bottom-right causally with no mask tensor at all (``make_attention_batch``'s
    ``causal_rows``).
    """

    rows: list[int]
    q_max: int
    span: int
    src: torch.Tensor | None
    dst: torch.Tensor | None
    table: torch.Tensor | None
    mask: torch.Tensor | None


class AttentionBatch(NamedTuple):
    """How the ``T`` packed query tokens of a step map onto ``B`` sequences.

    Rows ``[0, num_decode)`` are decode rows (one query token each, listed first); the rest are
    prefill chunks. Row ``b``'s queries are tokens ``query_starts[b]:query_starts[b + 1]`` and sit
    at the *end* of its ``seq_lens[b]`` keys (its KV, this step's tokens included). The tensors
    are on the KV pool's device (``make_attention_batch(..., device=)``).

    - ``block_tables``: ``[B, max_blocks]`` int64, padded with 0.
    - ``seq_lens``/``query_starts``: Python ints (``B`` and ``B + 1`` of them).
    - ``seq_lens_tensor``: ``[B]`` int32, ``seq_lens`` as a tensor (the Triton kernel's input).
      A captured decode step (``_graphs``) is the exception: its lengths change on the device
      between replays, so the tensor (int64) holds them and ``seq_lens`` lists every row's
      capacity (the block table's width in tokens), which only the Triton kernel reads, as
      the longest length.
    - ``runs``: per row, the first block when its table is one ascending run of blocks (its KV is
      then a contiguous slice of the pool and is read without a copy), else ``None``.
    - ``decode_mask``: ``[num_decode, 1, 1, L]`` bool (``True`` = attend; ``L`` the longest decode
      row rounded up to blocks) or ``None`` when every decode row spans all ``L`` keys.
    - ``prefill_groups``: the prefill rows, grouped for batched SDPA calls (``PrefillGroup``).
    - ``prefill_starts``: ``[P + 1]`` int32, the prefill rows' query starts counted from the
      first prefill token (``query_starts[num_decode:]`` minus its first), what the Triton
      prefill kernel reads; ``None`` when the step has no prefill row.
    """

    block_tables: torch.Tensor
    seq_lens: list[int]
    seq_lens_tensor: torch.Tensor
    query_starts: list[int]
    runs: list[int | None]
    num_decode: int
    decode_mask: torch.Tensor | None
    prefill_groups: list[PrefillGroup]
    prefill_starts: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch (to check where they live)."""
        found = [self.block_tables, self.seq_lens_tensor]
        found += [self.prefill_starts] if self.prefill_starts is not None else []
        found += [self.decode_mask] if self.decode_mask is not None else []
        for g in self.prefill_groups:
            found += [t for t in (g.src, g.dst, g.table, g.mask) if t is not None]
        return found


_ARRAY_CODES = {torch.long: "q", torch.int32: "i"}


def int_tensor(
    values: Iterable[int], device: torch.device | str | None = None, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """A 1-D int64 (or int32) tensor of Python ints on ``device`` (default: torch's default
    device). Built through ``array`` (one C loop over the ints) instead of ``torch.tensor``'s
    per-element conversion: ~3x faster for the thousands of ids, positions and slots a step
    sends (the host time of every step)."""
    code = _ARRAY_CODES.get(dtype)
    if code is None:
        raise EngineError(f"int_tensor makes int64 or int32 tensors, not {dtype}")
    host_array = array.array(code, values)
    if not host_array:
        host = torch.empty(0, dtype=dtype, device="cpu")
    else:
        host = torch.frombuffer(host_array, dtype=dtype)  # keeps the array alive
    return host.to(device if device is not None else torch.get_default_device())


def group_prefill_rows(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    pad: float = PREFILL_PAD,
    max_mask: int = PREFILL_MASK_ELEMENTS,
) -> list[list[int]]:
    """Split prefill rows (indices into the two lists) into groups, longest row first, each
    within ``pad`` of its rows' own attention area and keys (see ``PREFILL_PAD``) and, when it
    has several rows, within ``max_mask`` mask elements; ``pad`` below 1 puts every row
    alone."""
    order = sorted(range(len(seq_lens)), key=lambda r: (-seq_lens[r], -query_lens[r], r))
    groups: list[list[int]] = []
    area = keys = q_max = 0
    for r in order:
        q, n = query_lens[r], seq_lens[r]
        if groups and pad >= 1:
            rows = len(groups[-1]) + 1
            length = -(-seq_lens[groups[-1][0]] // block_size) * block_size
            wide = max(q_max, q)
            padded = rows * wide * length
            fits = padded <= pad * (area + q * n) and rows * length <= pad * (keys + n)
            if fits and padded <= max_mask:
                groups[-1].append(r)
                area, keys, q_max = area + q * n, keys + n, wide
                continue
        groups.append([r])
        area, keys, q_max = q * n, n, q
    return groups


def make_attention_batch(
    tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str | None = None,
    *,
    prefill_pad: float = PREFILL_PAD,
    causal_rows: bool | None = None,
) -> AttentionBatch:
    """Build the metadata for rows whose decode rows (``query_lens == 1``) come first;
    ``tables[b]`` lists exactly the blocks holding row ``b``'s ``seq_lens[b]`` keys. Tensors
    are made on ``device`` (default: torch's default device; masks are computed there, tables
    copied there once) and nothing is read back from it. ``prefill_pad``: see
    ``PREFILL_PAD`` (below 1: one SDPA call per prefill row).

    ``causal_rows``: whether prefill rows alone in their group attend as causal rows, without a
    mask tensor (query heads unfolded, K/V repeated per head, ``is_causal`` or SDPA's
    bottom-right causal bias), so a long chunk costs no ``[q_len, seq_len]`` mask and runs
    flash / memory-efficient attention. Default: every such row on a CUDA device; on the CPU
    fresh prompts and chunks of at least ``CAUSAL_MIN_QUERIES`` queries (a short chunk after
    many cached keys is faster folded and masked, K/V never repeated)."""
    num_decode = 0
    while num_decode < len(query_lens) and query_lens[num_decode] == 1:
        num_decode += 1
    width = max(map(len, tables))
    rows = [t + [0] * (width - len(t)) for t in tables]
    flat = [block for row in rows for block in row]
    block_tables = int_tensor(flat, device).view(len(rows), width)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    prefill_starts = None
    if num_decode < len(query_lens):  # one copy for the lengths and the prefill starts
        relative = [start - starts[num_decode] for start in starts[num_decode:]]
        both = int_tensor(seq_lens + relative, device, torch.int32)
        lens, prefill_starts = both.split([len(seq_lens), len(relative)])
    else:
        lens = int_tensor(seq_lens, device, torch.int32)
    runs = [t[0] if t[-1] - t[0] == len(t) - 1 and _ascending(t) else None for t in tables]
    decode_mask = None
    if num_decode > 1:
        span = -(-max(seq_lens[:num_decode]) // block_size) * block_size
        if any(n != span for n in seq_lens[:num_decode]):
            keys = torch.arange(span, device=device)
            decode_mask = (keys < lens[:num_decode, None]).view(num_decode, 1, 1, span)
    groups = group_prefill_rows(
        query_lens[num_decode:], seq_lens[num_decode:], block_size, prefill_pad
    )
    on_cuda = torch.device(device or torch.get_default_device()).type == "cuda"
    prefill_groups = []
    for members in groups:
        members = [num_decode + r for r in members]
        if len(members) == 1:
            (row,) = members
            q, n = query_lens[row], seq_lens[row]
            mask = None
            causal = causal_rows
            if causal is None:
                causal = on_cuda or q == n or q >= CAUSAL_MIN_QUERIES
            if not causal:
                # query i sits at position n - q + i and sees keys 0..n - q + i
                keys = torch.arange(n, device=device)
                queries = torch.arange(n - q, n, device=device)
                mask = keys[None, :] <= queries[:, None]
            prefill_groups.append(PrefillGroup(members, q, 0, None, None, None, mask))
            continue
        q_max = max(query_lens[r] for r in members)
        span = -(-seq_lens[members[0]] // block_size)
        src: list[int] = []
        dst: list[int] = []
        positions: list[int] = []  # the padded queries' positions (0 for padding)
        for i, row in enumerate(members):
            q, n = query_lens[row], seq_lens[row]
            src.extend(range(starts[row], starts[row + 1]))
            dst.extend(range(i * q_max, i * q_max + q))
            positions.extend([*range(n - q, n), *[0] * (q_max - q)])
        table = [block for row in members for block in rows[row][:span]]
        # one copy to the device for the group's index vectors
        index = int_tensor(src + dst + positions + table, device)
        src_t, dst_t, pos_t, table_t = index.split([len(src), len(dst), len(positions), len(table)])
        keys = torch.arange(span * block_size, device=device)
        mask = keys[None, None, :] <= pos_t.view(len(members), q_max, 1)
        prefill_groups.append(
            PrefillGroup(members, q_max, span, src_t, dst_t, table_t.view(len(members), span), mask)
        )
    return AttentionBatch(
        block_tables=block_tables,
        seq_lens=seq_lens,
        seq_lens_tensor=lens,
        query_starts=starts,
        runs=runs,
        num_decode=num_decode,
        decode_mask=decode_mask,
        prefill_groups=prefill_groups,
        prefill_starts=prefill_starts,
    )


def _ascending(table: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(table, table[1:], strict=False))


def _row_kv(cache: torch.Tensor, batch: AttentionBatch, row: int, block_size: int) -> torch.Tensor:
    """Row ``row``'s keys (or values) ``[seq_len, kv_heads, head_dim]``: a view of the pool when
    its blocks form one run, else gathered block by block (``index_select`` copies whole blocks;
    advanced indexing is ~500x slower here)."""
    n = batch.seq_lens[row]
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    first = batch.runs[row]
    if first is not None:
        return flat[first * block_size : first * block_size + n]
    table = batch.block_tables[row, : -(-n // block_size)]
    return cache.index_select(0, table).view(-1, cache.shape[2], cache.shape[3])[:n]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    *,
    decode_kernel: str = "sdpa",
    prefill_kernel: str = "sdpa",
) -> torch.Tensor:
    """Causal attention of packed queries over paged KV.

    ``q``: ``[T, heads, head_dim]``; ``k_cache``/``v_cache``: one layer of the pool,
    ``[num_blocks, block_size, kv_heads, head_dim]``, already holding this step's keys/values.
    Returns ``[T, heads, head_dim]`` (``q``'s dtype). Grouped-query attention folds the query
    heads sharing a KV head into the query-length axis, so KV is never repeated.
    ``decode_kernel``: ``"sdpa"`` or ``"triton"``, what the decode rows run; ``prefill_kernel``
    the same for the prefill chunks (``"triton"``: all of them in one launch of
    ``paged_prefill_attention``; ``"sdpa"``: per ``PrefillGroup``). ``batch``'s tensors must be
    on the cache's device.
    """
    tokens, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    nd = batch.num_decode
    for name, kernel in (("decode_kernel", decode_kernel), ("prefill_kernel", prefill_kernel)):
        if kernel not in ("sdpa", "triton"):
            raise EngineError(f"{name} must be 'sdpa' or 'triton', got {kernel!r}")
    if nd and decode_kernel == "triton":
        out[:nd] = paged_decode_attention(
            q[:nd],
            k_cache,
            v_cache,
            batch.block_tables[:nd],
            batch.seq_lens_tensor[:nd],
            scale,
            max_seq_len=max(batch.seq_lens[:nd]),
        )
    elif nd == 1:
        k = _row_kv(k_cache, batch, 0, block_size).transpose(0, 1)  # [K, n, D]
        v = _row_kv(v_cache, batch, 0, block_size).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[0].view(kv_heads, group, dim), k, v, scale=scale)
        out[0] = o.reshape(heads, dim)
    elif nd:
        span = -(-max(batch.seq_lens[:nd]) // block_size)
        table = batch.block_tables[:nd, :span].reshape(-1)
        k = k_cache.index_select(0, table).view(nd, span * block_size, kv_heads, dim)
        v = v_cache.index_select(0, table).view(nd, span * block_size, kv_heads, dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [nd, K, L, D]
        qd = q[:nd].view(nd, kv_heads, group, dim)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=batch.decode_mask, scale=scale)
        out[:nd] = o.reshape(nd, heads, dim)
    if prefill_kernel == "triton" and batch.prefill_starts is not None:
        first = batch.query_starts[nd]
        out[first:] = paged_prefill_attention(
            q[first:],
            k_cache,
            v_cache,
            batch.block_tables[nd:],
            batch.seq_lens_tensor[nd:],
            batch.prefill_starts,
            scale,
            max_query_len=max(b - a for a, b in itertools.pairwise(batch.query_starts[nd:])),
        )
        return out
    for g in batch.prefill_groups:
        if g.src is None:
            _prefill_row(out, q, k_cache, v_cache, batch, g, scale)
            continue
        assert g.dst is not None and g.table is not None
        rows, q_max, length = len(g.rows), g.q_max, g.span * block_size
        k = k_cache.index_select(0, g.table.reshape(-1)).view(rows, length, kv_heads, dim)
        v = v_cache.index_select(0, g.table.reshape(-1)).view(rows, length, kv_heads, dim)
        padded = q.new_zeros(rows * q_max, heads, dim).index_copy_(
            0, g.dst, q.index_select(0, g.src)
        )
        # [rows * q_max, H, D] -> [rows, K, group * q_max, D]: head h = kv_head * group + g
        qp = padded.view(rows, q_max, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        qp = qp.reshape(rows, kv_heads, group * q_max, dim)
        assert g.mask is not None  # a padded group always has one
        mask = g.mask[:, None, None].expand(rows, 1, group, q_max, length)
        mask = mask.reshape(rows, 1, group * q_max, length)
        o = F.scaled_dot_product_attention(
            qp, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
        )
        o = o.view(rows, kv_heads, group, q_max, dim).permute(0, 3, 1, 2, 4)
        out.index_copy_(0, g.src, o.reshape(rows * q_max, heads, dim).index_select(0, g.dst))
    return out


def _prefill_row(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    g: PrefillGroup,
    scale: float,
) -> None:
    """One prefill row alone (no padding; its KV read in place when its blocks form a run)."""
    (row,) = g.rows
    _, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    start, end = batch.query_starts[row], batch.query_starts[row + 1]
    q_len = end - start
    k = _row_kv(k_cache, batch, row, block_size).transpose(0, 1)  # [K, n, D]
    v = _row_kv(v_cache, batch, row, block_size).transpose(0, 1)
    if g.mask is None:  # a causal row: [1, H, q_len, D] over K/V repeated per query head
        n = k.shape[1]
        # 4-D: the flash and memory-efficient kernels take nothing else (3-D falls back to
        # the math kernel, which builds the scores and, for the bias, the mask)
        qh = q[start:end].transpose(0, 1)[None]
        kh = k.repeat_interleave(group, dim=0)[None]
        vh = v.repeat_interleave(group, dim=0)[None]
        if q_len == n:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:  # the queries are the last q_len positions: causal from the bottom right
            bias = lower_right_causal(q_len, n, q.device)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
        return
    # [q_len, H, D] -> [K, group * q_len, D]: head h = kv_head * group + g
    qp = q[start:end].view(q_len, kv_heads, group, dim).permute(1, 2, 0, 3)
    qp = qp.reshape(kv_heads, group * q_len, dim)
    mask = g.mask.repeat(group, 1)  # [group * q_len, n]
    o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
    out[start:end] = (
        o.view(kv_heads, group, q_len, dim).permute(2, 0, 1, 3).reshape(q_len, heads, dim)
    )
