"""How many tensor ops one decode forward runs per layer: on a GPU each is a kernel launch, and a
decode step of a small model is bound by the host issuing them, so this count is host time per
step. Views (no kernel) are not counted."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl.engine._batch import Row, build_forward_batch
from agentrl.engine._kv import KVPool
from agentrl.engine._model import CausalLM

_VIEWS = {
    "alias", "chunk", "expand", "permute", "reshape", "select", "slice", "split",
    "split_with_sizes", "squeeze", "t", "transpose", "unsqueeze", "view", "_unsafe_view",
}  # fmt: skip


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in _VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_decode_forward_runs_few_ops_per_layer(tiny_dir: Path) -> None:
    model = CausalLM.from_folder(tiny_dir)
    c = model.config
    pool = KVPool(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_blocks=16,
        block_size=16,
    )
    rows = [Row(list(range(5, 25)), 19, 1, [2 * i, 2 * i + 1], True) for i in range(4)]
    batch = build_forward_batch(rows, 16, "cpu")
    with torch.inference_mode(), _Count() as count:
        model.forward(batch, pool)
    per_layer = sum(count.ops.values()) / c.num_layers
    # per layer: 2 RMSNorms x 6, 4 projections (on the CPU each also copies its transposed
    # product into rows: 8), rope on q and k together 5 (neg, cat, 2 mul, add), KV write 2,
    # decode attention 5 (2 gathers, SDPA, empty, copy), 2 residual adds, SwiGLU 2, plus the
    # final norm, head and cast spread over the layers
    assert per_layer <= 43, count.ops
    assert count.ops["mm"] == 4 * c.num_layers + 1  # one GEMM per projection and the head
    assert count.ops["neg"] == c.num_layers  # q and k rotate in one set of kernels
