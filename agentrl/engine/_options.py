"""The embedded engine's knobs (``EngineOptions``) and counters (``EngineStatistics``)."""

from __future__ import annotations

from typing import Literal

import msgspec

from ._radix import RadixStatistics

_GIB = 1 << 30


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How an ``EmbeddedEngine`` sizes and schedules itself."""

    max_batch_size: int = 32
    """Most requests running at once (decoding or prefilling)."""
    max_step_tokens: int = 512
    """Tokens one step computes at most: decode rows count one each, prefill chunks fill the
    rest (chunked prefill)."""
    kv_cache_tokens: int | None = None
    """KV pool size in tokens; default: ``kv_cache_bytes`` worth, at most
    ``max_batch_size * max_context``."""
    kv_cache_bytes: int = _GIB
    block_size: int = 16
    """Tokens per KV block (the radix tree's page)."""
    radix_cache: bool = True
    """Reuse KV across requests through the radix tree (False: only sessions reuse)."""
    radix_token_budget: int | None = None
    """Most tokens the radix tree keeps (LRU eviction beyond); default: the whole pool."""
    session_ttl_s: float = 600.0
    """A session's pin is dropped after this long without a request."""
    session_cap_tokens: int | None = None
    """Most tokens all sessions pin together; default: half the pool."""
    in_flight: Literal["finish", "abort"] = "finish"
    """What a weight update does to started requests (see the module docs)."""
    num_threads: int | None = None
    dtype: str = "float32"
    decode_attention: Literal["auto", "sdpa", "triton"] = "auto"
    """What runs the decode rows' attention over the paged KV cache. ``"sdpa"``: torch SDPA
    over blocks gathered with ``index_select``. ``"triton"``: the Triton paged-decode kernel
    (``agentrl.kernels``), reading blocks in place; needs a CUDA device, or Triton's CPU
    interpreter (``TRITON_INTERPRET=1``, tests only), else the engine refuses to start.
    ``"auto"``: SDPA on CPU; on a CUDA device, the first step of each shape bucket (decode rows
    and longest context, each rounded up to a power of two) times both paths once with CUDA
    events and the bucket keeps the faster."""


class EngineStatistics(msgspec.Struct, frozen=True):
    """Counters since the engine started (``EmbeddedEngine.statistics()``)."""

    requests_done: int
    """Requests that ended with ``stop`` or ``length``."""
    requests_aborted: int
    requests_failed: int
    tokens_generated: int
    prefill_tokens: int
    """Tokens computed other than sampled tokens fed back: prompts, chunks, recomputes."""
    decode_steps: int
    mean_batch_size: float
    """Mean number of decode rows per step that had any (0 before the first)."""
    running: int
    waiting: int
    weight_version: int
    cached_tokens: int = 0
    """Tokens whose KV was reused (radix tree or session pin) instead of computed."""
    preemptions: int = 0
    kv_blocks: int = 0
    kv_blocks_free: int = 0
    block_size: int = 16
    sessions_open: int = 0
    sessions_pinned: int = 0
    session_pinned_tokens: int = 0
    """Tokens pinned by sessions (a prefix shared by several sessions counts for each)."""
    session_pinned_bytes: int = 0
    session_mismatches: int = 0
    """Turns whose context did not extend the session's pinned tokens (fell back to the tree)."""
    sessions_unpinned: int = 0
    """Pins dropped by TTL, cap or memory pressure."""
    radix: RadixStatistics | None = None
