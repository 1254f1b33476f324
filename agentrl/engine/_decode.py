"""Which kernel runs the decode rows of ``paged_attention``: ``EngineOptions.decode_attention``.

- ``"sdpa"``: torch SDPA over the rows' blocks gathered with ``index_select``.
- ``"triton"``: the Triton paged-decode kernel (``agentrl.kernels``), which reads the blocks in
  place. It needs a CUDA device, or Triton's interpreter on CPU (``TRITON_INTERPRET=1`` before
  the kernel's first use; slow, for tests); ``check_decode_attention`` refuses it at engine
  start otherwise, so no request fails on it later.
- ``"auto"``: SDPA on CPU. On a CUDA device with Triton, the first step of each shape bucket
  runs both paths on that step's real inputs, a warm-up call each (it compiles the kernel)
  then ``_TIMED_CALLS`` timed with CUDA events, and the bucket keeps the faster (lower median).
  A bucket is (decode rows, longest decode context), each rounded up to a power of two.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from agentrl._errors import EngineError
from agentrl.kernels import triton_available

from ._kv import AttentionBatch, paged_attention

DECODE_ATTENTION = ("auto", "sdpa", "triton")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TIMED_CALLS = 5


def check_decode_attention(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``EngineError`` unless decode attention ``mode`` can run on ``device`` in
    ``dtype`` ("auto" always can: it falls back to SDPA)."""
    if mode not in DECODE_ATTENTION:
        raise EngineError(f"decode_attention must be one of {DECODE_ATTENTION}, got {mode!r}")
    if mode != "triton":
        return
    if not triton_available(device):
        raise EngineError(
            f"decode_attention='triton' cannot run on {device}: it needs triton installed and a "
            "CUDA device, or TRITON_INTERPRET=1 (Triton's CPU interpreter, for tests); use "
            "'auto' or 'sdpa'"
        )
    if dtype not in _TRITON_DTYPES:
        raise EngineError(
            f"decode_attention='triton' supports float32, float16 and bfloat16, not {dtype}"
        )


def _bucket(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class DecodeKernelChooser:
    """Picks ``paged_attention``'s ``decode_kernel`` for each step (see the module docs).

    Built once per engine; ``choices`` holds what "auto" measured, per
    ``(decode rows bucket, context bucket)``.
    """

    def __init__(self, mode: str, device: torch.device, dtype: torch.dtype) -> None:
        check_decode_attention(mode, device, dtype)
        measurable = device.type == "cuda" and dtype in _TRITON_DTYPES and triton_available(device)
        self.mode = "sdpa" if mode == "auto" and not measurable else mode
        self.choices: dict[tuple[int, int], str] = {}

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
            )
            times = {
                kernel: cuda_median_ms(
                    lambda kernel=kernel: paged_attention(
                        q[:nd], k_cache, v_cache, decode, scale, decode_kernel=kernel
                    )
                )
                for kernel in ("sdpa", "triton")
            }
            choice = self.choices[key] = min(times, key=times.__getitem__)
        return choice


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
