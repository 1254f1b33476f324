"""Where this process stands in the (optional) process group: one place for every module."""

from __future__ import annotations

import os
from typing import Any

import torch


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` without an initialized process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def on_rank_device() -> None:
    """Before a collective over NCCL: make this rank's GPU the calling thread's current
    device. NCCL collectives place their buffers there, and a worker thread (the loop runs
    collectives from some) starts on device 0, which would be every rank's."""
    dist = torch.distributed
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` alone."""
    world = rank_world()[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    on_rank_device()  # called from worker threads too
    torch.distributed.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (nothing to wait for alone)."""
    if rank_world()[1] > 1:
        on_rank_device()
        torch.distributed.barrier()
