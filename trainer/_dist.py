"""Where this process stands in the (optional) process group: one place for every module."""

from __future__ import annotations

import torch


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` without an initialized process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """Wait for every rank (nothing to wait for alone)."""
    if rank_world()[1] > 1:
        torch.distributed.barrier()
