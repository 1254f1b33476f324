"""The embedded engine's knobs (``EngineOptions``, a pydantic model: the ``engine`` section people
write) and its counters (``EngineStatistics``). Torch-free, so that a config is checked before
torch loads; the checks against this machine are ``_device``'s."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
import pydantic

from agentrl._config import NumbersNotBools, describe_errors, short_repr, validate_config
from agentrl._errors import ConfigError, EngineError

from ._radix import RadixStatistics

_GIB = 1 << 30
IN_FLIGHT_RULES = ("finish", "abort", "partial")
"""``EngineOptions.in_flight``'s values."""


STEP_TOKENS = {"cpu": 512, "cuda": 8192}
"""``EngineOptions.max_step_tokens``' default per device type."""


class EngineOptions(NumbersNotBools):
    """How an ``EmbeddedEngine`` sizes and schedules itself (the config's ``engine`` section;
    unknown fields are refused by name). Where the device and dtype exist on this machine is
    checked when the engine starts."""

    model_config = pydantic.ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    max_batch_size: int = pydantic.Field(32, ge=1)
    """Most requests running at once (decoding or prefilling)."""
    max_step_tokens: int | None = pydantic.Field(None, ge=1)
    """Tokens one step computes at most: decode rows count one each, prefill chunks fill the
    rest (chunked prefill). Default: ``STEP_TOKENS`` for the device, 512 on the CPU (a step's
    GEMMs already fill the cores) and 8192 on a CUDA device (SGLang's chunked-prefill size on
    an H100: a GPU needs thousands of tokens per step to be busy)."""
    kv_cache_tokens: int | None = pydantic.Field(None, ge=1)
    """KV pool size in tokens; default: ``kv_cache_bytes`` worth, at most
    ``max_batch_size * max_context``."""
    kv_cache_bytes: int = pydantic.Field(_GIB, ge=1)
    """KV pool size in bytes when ``kv_cache_tokens`` is unset."""
    block_size: int = pydantic.Field(16, ge=1)
    """Tokens per KV block (the radix tree's page)."""
    context_length: int | None = pydantic.Field(None, ge=2)
    """Most tokens (prompt + generated) one request may reach; default: the model's
    ``max_position_embeddings``. Larger is refused (the rope tables end there); the KV pool's
    capacity caps it too."""
    radix_cache: bool = True
    """Reuse KV across requests through the radix tree (False: only sessions reuse)."""
    radix_token_budget: int | None = pydantic.Field(None, ge=0)
    """Most tokens the radix tree keeps (LRU eviction beyond); default: the whole pool."""
    session_ttl_s: float = pydantic.Field(600.0, gt=0)
    """A session's pin is dropped after this long without a request."""
    session_cap_tokens: int | None = pydantic.Field(None, ge=0)
    """Most tokens all sessions pin together; default: half the pool."""
    in_flight: Literal["finish", "abort", "partial"] = "finish"
    """What a weight update does to started requests: ``"finish"`` them on the old weights
    (the update waits), ``"abort"`` them (they restart from scratch on the new weights), or
    continue them on the new weights (``"partial"``: their KV is recomputed, the tokens already
    sampled are kept; ``GenerateResult.token_versions`` then holds several versions). See
    ``EmbeddedEngine``."""
    num_threads: int | None = pydantic.Field(None, ge=1)
    """torch CPU threads of the worker (default: every core); on a GPU they only sample the rows
    a logprob query reads."""
    device: str = "cpu"
    """Where the weights, the rope tables, the KV pool and every step's tensors live:
    ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. ``"cuda"`` is the current CUDA device of the thread
    that opens the engine (under torchrun: the rank's, once ``torch.cuda.set_device`` ran).
    Checked when the engine starts: ``EngineError`` naming this field when CUDA is unavailable
    or the index does not exist. Every sampled token consumes one uniform number of its
    request's own CPU generator and is drawn by inverse CDF from it: on a GPU all of a step's rows
    at once where the logits are (only ids and logprobs come back), on the CPU row by row, by the
    same operations, so a seed means the same on every device. (A row that feeds a logprob
    query is copied back whole and sampled on the CPU.)"""
    dtype: str = "float32"
    """Model and KV dtype: ``"float32"``, ``"bfloat16"`` (the natural choice on a GPU),
    ``"float16"`` or ``"float64"`` (logits are float32 either way)."""
    decode_attention: Literal["auto", "sdpa", "triton"] = "auto"
    """What runs the decode rows' attention over the paged KV cache. ``"sdpa"``: torch SDPA
    over blocks gathered with ``index_select``. ``"triton"``: the Triton paged-decode kernel
    (``agentrl.kernels``), reading blocks in place; needs a CUDA device, or Triton's CPU
    interpreter (``TRITON_INTERPRET=1``, tests only), else the engine refuses to start.
    ``"auto"``: SDPA on CPU; on a CUDA device, the first step of each shape bucket (decode rows
    and longest context, each rounded up to a power of two) times both paths once with CUDA
    events and the bucket keeps the faster."""
    prefill_attention: Literal["auto", "sdpa", "triton"] = "auto"
    """What runs the prefill chunks' attention (a prompt's tokens past its cached prefix, over
    that prefix and causally over themselves). ``"sdpa"``: torch SDPA, chunks of similar length
    padded into groups (one call per group) or alone as causal rows. ``"triton"``: the Triton
    paged-prefill kernel (``agentrl.kernels``), every chunk of the step in one launch per layer,
    reading the cached keys in place; needs a CUDA device, or Triton's CPU interpreter
    (``TRITON_INTERPRET=1``, tests only), else the engine refuses to start. ``"auto"``: SDPA on
    CPU; on a CUDA device, the first step of each shape bucket (prefill rows, their new tokens,
    their longest context, each rounded up to a power of two) times both paths once with CUDA
    events and the bucket keeps the faster."""
    fused_ops: Literal["auto", "triton", "torch"] = "auto"
    """What runs each layer's elementwise work: RMSNorm (with the residual add before it),
    rotary embedding and ``silu(gate) * up``. ``"triton"``: one Triton kernel each
    (``agentrl.kernels``), computing in fp32 and rounding once; needs a CUDA device, or Triton's
    CPU interpreter (``TRITON_INTERPRET=1``, tests only), else the engine refuses to start.
    ``"torch"``: torch operations in the model's dtype, several kernels each. ``"auto"``:
    Triton on a CUDA device where Triton is installed, torch elsewhere."""
    cuda_graph: bool = True
    """On a CUDA device, replay decode-only steps (every row feeds one token, no input-token
    logprobs) of up to ``cuda_graph_max_bs`` rows from CUDA graphs captured when the
    engine starts, one per batch-size bucket (1, 2, 4, 8, then multiples of 8): one launch per
    step instead of hundreds. Those steps run the Triton decode kernel, so graphs are used only
    where it runs and ``decode_attention`` is not ``"sdpa"``; ignored on the CPU. Weight updates
    keep the graphs (new weights are copied into the captured tensors). If capturing fails (out
    of memory, say) the engine warns (``RuntimeWarning``, the reason also in
    ``EmbeddedEngine.cuda_graph_error``) and runs every step uncaptured."""
    cuda_graph_max_bs: int | None = pydantic.Field(None, ge=1)
    """The largest captured batch size (default: ``max_batch_size``); larger decode steps run
    without a graph."""

    @pydantic.field_validator("device")
    @classmethod
    def _device_syntax(cls, value: str) -> str:
        parse_device(value)  # whether it exists here is checked when the engine starts
        return value

    @pydantic.field_validator("dtype")
    @classmethod
    def _dtype_name(cls, value: str) -> str:
        dtype_name(value, error=ValueError)
        return value

    def replace(self, **changes: Any) -> EngineOptions:
        """A validated copy with ``changes`` (``EngineError`` naming a bad field)."""
        if not changes:
            return self
        try:
            return EngineOptions.model_validate({**self.model_dump(), **changes})
        except pydantic.ValidationError as exc:
            raise EngineError(describe_errors(exc)) from None


ENGINE_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""``EngineOptions.dtype``'s values (torch's aliases of them, ``float``, ``half``, ``double``,
are accepted too): the floating dtypes the model, the KV pool and the samplers run in."""

DTYPE_NAMES: dict[str, str] = {
    **{name: name for name in ENGINE_DTYPES},
    "float": "float32",
    "half": "float16",
    "double": "float64",
}
"""Every name ``EngineOptions.dtype`` accepts → the ``ENGINE_DTYPES`` entry it means."""

_DEVICE = re.compile(r"(cpu|cuda)(?::(0|[1-9][0-9]{0,2}))?", re.ASCII)
_MAX_DEVICE_INDEX = 127
"""torch keeps a device index in 8 bits (``torch.device("cuda:128")`` wraps to -128)."""


def dtype_name(value: object, *, error: type[Exception] = EngineError) -> str:
    """``value`` as one of ``ENGINE_DTYPES`` (aliases resolved); ``error`` naming the field for
    anything else."""
    if not isinstance(value, str) or value not in DTYPE_NAMES:
        raise error(f"dtype must be one of {', '.join(ENGINE_DTYPES)}, got {short_repr(value)}")
    return DTYPE_NAMES[value]


def parse_device(value: object) -> tuple[str, int | None]:
    """``value`` (``"cpu"``, ``"cuda"`` or ``"cuda:N"``) as (type, index); ``ValueError``
    otherwise. torch's syntax, checked without importing torch."""
    match = _DEVICE.fullmatch(value) if isinstance(value, str) else None
    index = None if match is None or match[2] is None else int(match[2])
    if match is None or (index is not None and index > _MAX_DEVICE_INDEX):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {short_repr(value)}")
    return match[1], index


def engine_options(section: Mapping[str, Any] | EngineOptions | None = None) -> EngineOptions:
    """``EngineOptions`` from a config file's ``engine`` section (or the options themselves); a
    bad or unknown field is a ``ConfigError`` that names it."""
    if isinstance(section, EngineOptions):
        return section
    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(
            f"engine: expected a mapping of engine options, got {short_repr(section)}"
        )
    return validate_config(EngineOptions, dict(section or {}), where="engine")


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
    waiting_tokens: int = 0
    """Context tokens of the waiting requests (what admitting them would put in the KV pool)."""
    cached_tokens: int = 0
    """Tokens whose KV was reused (radix tree or session pin) instead of computed."""
    preemptions: int = 0
    interruptions: int = 0
    """Running requests moved onto new weights mid-generation (``in_flight="partial"``)."""
    kv_blocks: int = 0
    """KV blocks of the pool: ``kv_blocks_free + kv_blocks_cached + kv_blocks_in_use``."""
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    """Blocks the radix tree holds (reusable prefixes; locked while a request or a session pin
    uses them)."""
    kv_blocks_evictable: int = 0
    """Of ``kv_blocks_cached``, blocks no lock protects: freed first when the pool runs short."""
    kv_blocks_in_use: int = 0
    """Blocks outside the tree and not free: pages running requests own, and the partial last
    pages sessions pin. With nothing running and no session open this is 0; more is a leak."""
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
    graph_steps: int = 0
    """Decode steps replayed from a captured CUDA graph (``EngineOptions.cuda_graph``)."""
    steps: int = 0
    """Forward steps run: ``prefill_steps`` plus steps of decode rows only."""
    prefill_steps: int = 0
    """Steps with at least one prompt or chunk row (decode rows may ride along)."""
    prefill_step_seconds: float = 0.0
    """Wall time of ``prefill_steps``: forward, sampling and bookkeeping. Every step ends by
    reading its picks back, so on a GPU this includes the device's time."""
    decode_step_seconds: float = 0.0
    """Wall time of the steps with decode rows only. Time a run spends outside both (waiting
    for requests, HTTP, tokenizing, handing results back) is its wall time minus the two."""
