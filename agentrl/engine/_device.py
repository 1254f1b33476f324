"""``EngineOptions.device`` and ``.dtype`` checked against this machine, as torch objects (when
an engine starts; the options themselves are checked without torch, in ``_options``)."""

from __future__ import annotations

import torch

from agentrl._errors import EngineError

from ._options import dtype_name, parse_device


def resolve_dtype(value: str | torch.dtype) -> torch.dtype:
    """``EngineOptions.dtype`` (or a ``torch.dtype``) as one of the engine's floating
    dtypes; ``EngineError`` naming the field otherwise."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    return getattr(torch, dtype_name(value))


def resolve_device(value: str | torch.device) -> torch.device:
    """``EngineOptions.device`` checked against this machine: ``cpu``, or a CUDA device that
    exists (``"cuda"`` resolves to the current one); ``EngineError`` naming the field else."""
    try:
        kind, index = parse_device(str(value) if isinstance(value, torch.device) else value)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EngineError(
            f"device={value!r}: CUDA is not available here (torch {torch.__version__}, CUDA "
            f"build: {torch.version.cuda or 'none'}); use device='cpu'"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if index is None else index
    if index >= count:
        raise EngineError(
            f"device={value!r}: no such CUDA device, this machine has {count} "
            f"(cuda:0 to cuda:{count - 1})"
        )
    return torch.device("cuda", index)
