"""Sizing a run: per-GPU memory of a training layout, and the actors that keep a learner busy.

``agentrl plan memory`` and ``agentrl plan capacity`` are the command-line faces of
``plan_memory`` and ``plan_capacity``; docs/planning.md has worked examples.
"""

from ._memory import MemoryPlan, MemorySettings, plan_memory
from ._shape import ModelShape, load_shape

__all__ = ["MemoryPlan", "MemorySettings", "ModelShape", "load_shape", "plan_memory"]
