"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math
from typing import Any

from ._config import OptimizerConfig


def lr_multiplier(opt: OptimizerConfig, total_updates: int):
    """The LR schedule as a multiplier of ``opt.lr`` for update index ``u`` (0-based): linear
    warmup to 1 over ``warmup_steps``, then constant, linear or cosine to ``min_lr_ratio``
    at ``total_updates``."""
    warmup, floor = opt.warmup_steps, opt.min_lr_ratio
    horizon = max(1, total_updates - warmup)

    def multiplier(u: int) -> float:
        if u < warmup:
            return (u + 1) / warmup
        if opt.schedule == "constant":
            return 1.0
        progress = min(1.0, (u - warmup) / horizon)
        if opt.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


class LRSchedule:
    """``lr = base_lr · multiplier(updates)`` on every parameter group, stepped by DeepSpeed
    after each optimizer update and saved in its checkpoints (``state_dict``). Not a torch
    ``LRScheduler``: DeepSpeed wraps the optimizer's ``step`` after the scheduler exists, which
    torch's schedulers report as a misuse.

    The schedule's length (``total_updates``) is saved with it and kept on load: a run resumed
    with another ``train.max_steps`` goes on along the curve it started on (linear and cosine
    end at ``min_lr_ratio`` where the first run would have ended, and stay there) instead of a
    curve re-shaped mid-run (the LR would jump). A state saved without it (an older agentrl)
    keeps the length this schedule was made with."""

    def __init__(self, optimizer: Any, config: OptimizerConfig, total_updates: int) -> None:
        self.optimizer = optimizer
        self.config = config
        self.total_updates = total_updates
        self.multiplier = lr_multiplier(config, total_updates)
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.updates = 0
        self._apply()

    def _apply(self) -> None:
        factor = self.multiplier(self.updates)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def step(self, **_: Any) -> None:
        self.updates += 1
        self._apply()

    def advance(self, updates: int) -> None:
        """Move on by ``updates`` that were not made (the schedule follows the steps)."""
        self.updates += updates
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {
            "updates": self.updates,
            "base_lrs": list(self.base_lrs),
            "total_updates": self.total_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        self.base_lrs = list(state["base_lrs"])
        self.total_updates = int(state.get("total_updates", self.total_updates))
        self.multiplier = lr_multiplier(self.config, self.total_updates)
        self._apply()
