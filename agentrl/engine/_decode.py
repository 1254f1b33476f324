"""Which kernels run the attention of ``paged_attention``: ``EngineOptions.decode_attention``
for the decode rows, ``EngineOptions.prefill_attention`` for the prefill chunks.

- ``"sdpa"``: torch SDPA. Decode rows over their blocks gathered with ``index_select``;
  prefill chunks in padded groups (or alone, as causal rows; see ``make_attention_batch``).
- ``"triton"``: the Triton paged kernels (``agentrl.kernels``), which read the blocks in place:
  ``paged_decode_attention`` for the decode rows, ``paged_prefill_attention`` for every prefill
  chunk of the step in one launch per layer. They need a CUDA device, or Triton's interpreter on
  CPU (``TRITON_INTERPRET=1`` before the kernel's first use; slow, for tests);
  ``check_attention`` refuses them at engine start otherwise, so no request fails on it later.
- ``"auto"``: SDPA on CPU. On a CUDA device with Triton, the first step of each shape bucket
  runs both paths on that step's real inputs, a warm-up call each (it compiles the kernel)
  then ``_TIMED_CALLS`` timed with CUDA events, and the bucket keeps the faster (lower median).
  A decode bucket is (decode rows, longest decode context); a prefill bucket is (prefill rows,
  their query tokens, their longest context); each number rounded up to a power of two.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from agentrl._errors import EngineError
from agentrl.kernels import triton_available

from ._kv import AttentionBatch, paged_attention

ATTENTION_MODES = ("auto", "sdpa", "triton")
KERNELS = ("sdpa", "triton")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TIMED_CALLS = 5


def check_attention(
    mode: str, device: torch.device, dtype: torch.dtype, field: str = "decode_attention"
) -> None:
    """Raise ``EngineError`` naming ``field`` unless attention ``mode`` can run on ``device`` in
    ``dtype`` ("auto" always can: it falls back to SDPA)."""
    if mode not in ATTENTION_MODES:
        raise EngineError(f"{field} must be one of {ATTENTION_MODES}, got {mode!r}")
    if mode != "triton":
        return
    if not triton_available(device):
        raise EngineError(
            f"{field}='triton' cannot run on {device}: it needs triton installed and a "
            "CUDA device, or TRITON_INTERPRET=1 (Triton's CPU interpreter, for tests); use "
            "'auto' or 'sdpa'"
        )
    if dtype not in _TRITON_DTYPES:
        raise EngineError(f"{field}='triton' supports float32, float16 and bfloat16, not {dtype}")


def _bucket(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class AttentionKernelChooser:
    """Picks ``paged_attention``'s ``decode_kernel`` and ``prefill_kernel`` for each step (see
    the module docs).

    Built once per engine; ``choices`` holds what "auto" measured for decode rows, per
    ``(decode rows bucket, context bucket)``, ``prefill_choices`` for prefill chunks, per
    ``(prefill rows bucket, query tokens bucket, context bucket)``.
    """

    def __init__(
        self, mode: str, device: torch.device, dtype: torch.dtype, prefill: str = "sdpa"
    ) -> None:
        check_attention(mode, device, dtype, "decode_attention")
        check_attention(prefill, device, dtype, "prefill_attention")
        measurable = device.type == "cuda" and dtype in _TRITON_DTYPES and triton_available(device)
        self.mode = "sdpa" if mode == "auto" and not measurable else mode
        self.prefill_mode = "sdpa" if prefill == "auto" and not measurable else prefill
        self.choices: dict[tuple[int, int], str] = {}
        self.prefill_choices: dict[tuple[int, int, int], str] = {}

    def choose(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        scale: float,
    ) -> str:
        """The kernel for this step's decode rows ("sdpa" or "triton"); in "auto" mode a new
        bucket is measured first, on these inputs (nothing is written)."""
        if self.mode != "auto":
            return self.mode
        nd = batch.num_decode
        if nd == 0:
            return "sdpa"
        key = (_bucket(nd), _bucket(max(batch.seq_lens[:nd])))
        choice = self.choices.get(key)
        if choice is None:
            decode = batch._replace(
                seq_lens=batch.seq_lens[:nd],
                seq_lens_tensor=batch.seq_lens_tensor[:nd],
                prefill_groups=[],
                prefill_starts=None,
            )
            choice = self.choices[key] = _faster(
                lambda kernel: paged_attention(
                    q[:nd], k_cache, v_cache, decode, scale, decode_kernel=kernel
                )
            )
        return choice

    def choose_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        scale: float,
    ) -> str:
        """The kernel for this step's prefill chunks ("sdpa" or "triton"); in "auto" mode a new
        bucket is measured first, on these inputs and on the prefill rows alone (nothing is
        written)."""
        if self.prefill_mode != "auto":
            return self.prefill_mode
        nd = batch.num_decode
        rows = len(batch.seq_lens) - nd
        if rows == 0:
            return "sdpa"
        first = batch.query_starts[nd]
        key = (
            _bucket(rows),
            _bucket(batch.query_starts[-1] - first),
            _bucket(max(batch.seq_lens[nd:])),
        )
        choice = self.prefill_choices.get(key)
        if choice is None:
            # the decode rows run SDPA in both timings: the difference is the prefill's
            choice = self.prefill_choices[key] = _faster(
                lambda kernel: paged_attention(
                    q, k_cache, v_cache, batch, scale, prefill_kernel=kernel
                )
            )
        return choice


def _faster(call: Callable[[str], object]) -> str:
    """The kernel ("sdpa" or "triton") whose ``call(kernel)`` has the lower median time
    (``cuda_median_ms``; SDPA on a tie)."""
    times = {kernel: cuda_median_ms(lambda kernel=kernel: call(kernel)) for kernel in KERNELS}
    return min(times, key=times.__getitem__)


def cuda_median_ms(fn: Callable[[], object], warmup: int = 1, repeats: int = _TIMED_CALLS) -> float:
    """Median CUDA-event time (ms) of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones
    (the chooser's measure; the GPU benchmarks time with it too)."""
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)
