"""Whether Triton can run here, asked once: kernels are imported lazily so that
``agentrl.kernels`` imports (and its torch paths work) on machines without Triton."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

Backend = str
"""``"auto"`` (Triton on CUDA tensors, torch elsewhere), ``"triton"`` or ``"torch"``."""
BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``, read by Triton when a kernel is
    decorated, i.e. when the kernel module is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(device: torch.device | str) -> bool:
    """Triton kernels can run on tensors of ``device``: Triton is installed and the device is
    a CUDA GPU, or the interpreter is on (any device; tests run kernels that way on CPU)."""
    if not triton_installed():
        return False
    return torch.device(device).type == "cuda" or interpreting()


def use_triton(backend: Backend, device: torch.device, what: str) -> bool:
    """Resolve ``backend`` for tensors on ``device``: ``auto`` picks Triton on CUDA only (the
    interpreter is for tests, never a silent default); ``triton`` where it cannot run raises."""
    if backend not in BACKENDS:
        raise ValueError(f"{what}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda" and triton_installed()
    require_triton(device, f"{what}: backend='triton'")
    return True


def require_triton(device: torch.device, what: str) -> None:
    """``RuntimeError`` saying why, unless Triton kernels can run on ``device``."""
    if not triton_available(device):
        why = (
            "Triton is not installed (pip install 'agentrl[kernels]')"
            if not triton_installed()
            else f"tensors are on {device.type}, not CUDA, and TRITON_INTERPRET is not set"
        )
        raise RuntimeError(f"{what} cannot run here: {why}")
