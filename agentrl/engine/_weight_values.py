"""Value checks of new weights, run before they replace the served ones.

Names and shapes are the model's business (``CausalLM.check_state_dict``); this module checks
what the tensors hold: a floating-point dtype (an integer or boolean tensor cast to the model's
dtype is silently wrong), only finite values (one NaN or Inf makes every forward pass produce NaN
logits), and no value beyond what the model's dtype can hold (a float32 checkpoint with values
above bfloat16's maximum turns into Inf when cast). Each failure names the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from agentrl._errors import EngineError


def check_weight_values(
    state: Mapping[str, object], names: Iterable[str], dtype: torch.dtype
) -> None:
    """Raise ``EngineError`` naming the first of ``names`` in ``state`` whose values cannot
    become the model's ``dtype`` weights (``state`` is not modified)."""
    limit = torch.finfo(dtype).max
    for name in names:
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise EngineError(f"weight update: {name} is a {type(tensor).__name__}, not a tensor")
        if not (tensor.dtype.is_floating_point):
            raise EngineError(
                f"weight update: {name} has dtype {tensor.dtype}; weights must be floating "
                "point (float32, bfloat16, float16 or float64)"
            )
        if tensor.numel() == 0:
            continue
        values = tensor.detach()
        if values.element_size() < 2:  # float8: no abs() kernel everywhere
            values = values.float()
        with torch.no_grad():
            largest = float(values.abs().amax())  # NaN if any value is NaN
        if not math.isfinite(largest):
            bad = int((~torch.isfinite(tensor.detach())).sum())
            raise EngineError(
                f"weight update: {name} holds {bad} non-finite value(s) (NaN or Inf) of "
                f"{tensor.numel()}"
            )
        if largest > limit:
            raise EngineError(
                f"weight update: {name} holds a value of magnitude {largest:.3g}, beyond what "
                f"the model's {dtype} can hold ({limit:.3g})"
            )
