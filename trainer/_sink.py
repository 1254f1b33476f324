"""Where the learner publishes new weights: a protocol, so the trainer never imports an engine.

Implementations live in the composition root (``agentrl.loop``): the colocated embedded engine
(a state dict, in-process), or a server (a safetensors snapshot folder and
``/update_weights_from_disk`` with the new ``weight_version``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class WeightSink(Protocol):
    """Receives policy weights under a version number."""

    async def publish(self, version: int, weights: dict[str, torch.Tensor] | str) -> None:
        """Make ``weights`` (HF-named tensors, or a folder holding an HF safetensors snapshot)
        the weights that requests started after this call run on, as ``version``. Returns once
        the receiver has switched (later requests report ``weight_version == version``)."""
        ...
