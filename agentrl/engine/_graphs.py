"""Decode steps replayed from CUDA graphs (``EngineOptions.cuda_graph``).

A decode step's forward launches about a thousand small kernels (SmolLM2-135M: 30 layers of
norms, GEMMs, rope, KV writes and attention); at small and medium batch sizes launching them
costs more than running them. At engine start ``DecodeGraphs`` captures the forward of a
decode-only step once per batch-size bucket (``capture_sizes``) into a CUDA graph; a step whose
rows all feed one token (sampled, or a finished session turn's last token, whose KV the next
turn reuses), with no input-token logprobs, then copies its inputs into the graphs' static
buffers and replays the smallest bucket that holds it: one launch.
Other steps (prefill chunks, logprob queries, more rows than the largest bucket) run the
forward as usual.

What makes the forward capturable:

- Static inputs and output. Per row the token id, position, flat KV slot and length
  (``[4, max bucket]`` int64) and the block table (``[max bucket, max_blocks]`` int64) live in
  device buffers that every graph reads (``batches``: views of them only); a step copies its
  rows in (two host-to-device copies) and nothing else. Every graph writes its logits into one
  ``[max bucket, vocab]`` buffer.
  Only the table columns the step's rows use are copied: a row's columns past its length are
  never read.
- Padding rows. A step of ``n`` rows replays bucket ``size >= n``; rows ``n..size`` feed token 0
  at position 0, length 1, into the pool's pad block (``KVPool.pad_block``, never handed out),
  and their logits are dropped.
- A fixed launch grid. Attention is the Triton paged-decode kernel with the table capacity as
  the longest length (``AttentionBatch.seq_lens`` of a captured step): a key split past a row's
  length exits at once, so no launch depends on a length the host would have to read.
- Fixed weights. ``CausalLM.load_state_dict`` copies new weights into the tensors the graphs
  captured, so weight updates need no recapture.

The graphs share one memory pool for their intermediates (captured largest first, as CUDA graph
users usually do); a step's logits are valid until the next replay, which the worker never
starts before it has read them.

On the CPU (tests) ``replay="eager"`` runs the same static-buffer forward instead of a graph:
padding, bucketing and the buffer copies are the same code; the decode kernel then runs in
Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from agentrl._errors import EngineError
from agentrl.kernels import triton_available

from ._batch import Row, take_rows
from ._kv import AttentionBatch, KVPool, int_tensor
from ._model import CausalLM, ForwardBatch

REPLAY_MODES = ("cuda", "eager")


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch-size buckets graphs are captured for: 1, 2, 4, 8, then every multiple of 8
    up to ``max_batch_size`` (which is always one of them)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += range(8, max_batch_size, 8)
    return [*sizes, max_batch_size]


class DecodeGraphs:
    """Captured decode steps of one model over one KV pool (see the module docs).

    ``max_batch_size``: the largest bucket (steps with more rows run eagerly); ``max_context``:
    the longest sequence a row may reach (the block table's width). ``pool`` must have a pad
    block. Raises ``EngineError`` when the graphs cannot be built here.
    """

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        *,
        max_batch_size: int,
        max_context: int,
        replay: str = "cuda",
    ) -> None:
        if replay not in REPLAY_MODES:
            raise EngineError(f"replay must be one of {REPLAY_MODES}, got {replay!r}")
        device = pool.device
        if replay == "cuda" and device.type != "cuda":
            raise EngineError(f"CUDA graphs need a CUDA device, the KV pool is on {device}")
        if not triton_available(device):
            raise EngineError(
                f"captured decode steps run the Triton paged-decode kernel, which cannot run on "
                f"{device} here"
            )
        if pool.pad_block is None:
            raise EngineError("captured decode steps need a KV pool built with pad_block=True")
        if max_batch_size < 1 or max_context < 1:
            raise EngineError(
                f"max_batch_size ({max_batch_size}) and max_context ({max_context}) must be >= 1"
            )
        self.model = model
        self.pool = pool
        self.sizes = capture_sizes(max_batch_size)
        block = pool.block_size
        self.max_blocks = -(-max_context // block)
        self.capacity = self.max_blocks * block
        self._pad_slot = pool.pad_block * block
        top = self.sizes[-1]
        # rows: token id, position, KV slot, length; padding defaults
        self._vectors = torch.zeros((4, top), dtype=torch.long, device=device)
        self._vectors[2] = self._pad_slot
        self._vectors[3] = 1
        self._tables = torch.full(
            (top, self.max_blocks), pool.pad_block, dtype=torch.long, device=device
        )
        self._rows = torch.arange(top, dtype=torch.long, device=device)  # the logits rows
        vocab = model.config.vocab_size
        self._logits = torch.empty((top, vocab), dtype=torch.float32, device=device)
        """Every bucket's output: one buffer, not one ``[size, vocab]`` tensor per graph."""
        self.batches: dict[int, ForwardBatch] = {}
        """Each bucket's ``ForwardBatch``: views of the buffers above, nothing else (a tensor
        a graph reads must outlive it: these keep their storage alive)."""
        self._runs: dict[int, Callable[[], torch.Tensor]] = {}
        self.replays = 0
        """Steps run from a graph (for statistics and tests)."""
        if replay == "cuda":
            self._capture_all()
        else:
            for size in self.sizes:
                self._runs[size] = self._static_forward(size)

    def _static_forward(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward of a ``size``-row decode step over the static buffers."""
        ids, positions, slots, lens = self._vectors[:, :size].unbind(0)
        attention = AttentionBatch(
            block_tables=self._tables[:size],
            seq_lens=[self.capacity] * size,
            seq_lens_tensor=lens,
            query_starts=list(range(size + 1)),
            runs=[None] * size,
            num_decode=size,
            decode_mask=None,
            prefill_groups=[],
        )
        batch = self.batches[size] = ForwardBatch(
            ids, positions, slots, attention, self._rows[:size]
        )
        model, pool, out = self.model, self.pool, self._logits[:size]

        def forward() -> torch.Tensor:
            return out.copy_(model.forward(batch, pool, "triton"))

        return forward

    def _capture_all(self) -> None:
        device = self.pool.device
        memory_pool = None
        stream = torch.cuda.Stream(device)
        with torch.cuda.device(device):
            for size in reversed(self.sizes):
                forward = self._static_forward(size)
                # warm-up outside the capture: compiles the Triton kernels, creates cuBLAS
                # workspaces (nothing may be allocated lazily inside a capture)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        forward()
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: only this thread's CUDA calls are checked against the capture,
                # so another thread of the process (a learner) may keep using the device
                with torch.cuda.graph(
                    graph, pool=memory_pool, stream=stream, capture_error_mode="thread_local"
                ):
                    logits = forward()
                memory_pool = graph.pool()
                self._runs[size] = _replayer(graph, logits)
            torch.cuda.synchronize(device)

    def bucket(self, rows: int) -> int | None:
        """The bucket a step of ``rows`` rows replays, ``None`` when none holds it."""
        for size in self.sizes:
            if size >= rows:
                return size
        return None

    def accepts(self, rows: Sequence[Row]) -> bool:
        """Whether a step of ``rows`` can replay: every row feeds one token (and samples it,
        or only writes its KV: a finished session turn's last token), asks for no input-token
        logits, stays within ``max_context``, and some bucket holds them all."""
        if not rows or self.bucket(len(rows)) is None:
            return False
        return all(
            r.count == 1 and r.extra[1] <= r.extra[0] and r.start < self.capacity for r in rows
        )

    def run(self, rows: Sequence[Row]) -> torch.Tensor:
        """Run the decode step of ``rows`` (``accepts(rows)`` must hold): writes the rows' K/V
        into the pool and returns float32 logits ``[rows that sample, vocab]``, in row order
        (the ``ForwardBatch`` of the same rows would return these), valid until the next
        ``run``."""
        size = self.load(rows)
        logits = self._runs[size]()[: len(rows)]
        self.replays += 1
        return take_rows(logits, [i for i, r in enumerate(rows) if r.sample])

    def load(self, rows: Sequence[Row]) -> int:
        """Copy the step's rows (and padding rows) into the static buffers; returns the
        bucket to replay."""
        n = len(rows)
        size = self.bucket(n)
        assert size is not None
        block = self.pool.block_size
        pad = size - n
        tables = [r.blocks[: r.start // block + 1] for r in rows]
        width = max(map(len, tables))
        pad_block = self.pool.pad_block
        table = [list(t) + [pad_block] * (width - len(t)) for t in tables]
        table += [[pad_block] * width] * pad
        slots = [t[-1] * block + r.start % block for r, t in zip(rows, tables, strict=True)]
        vectors = [
            [r.tokens[r.start] for r in rows] + [0] * pad,
            [r.start for r in rows] + [0] * pad,
            slots + [self._pad_slot] * pad,
            [r.start + 1 for r in rows] + [1] * pad,
        ]
        flat = [value for vector in vectors for value in vector]
        self._vectors[:, :size].copy_(int_tensor(flat, "cpu").view(4, size))
        flat = [block for row in table for block in row]
        self._tables[:size, :width].copy_(int_tensor(flat, "cpu").view(size, width))
        return size


def _replayer(graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    return replay
