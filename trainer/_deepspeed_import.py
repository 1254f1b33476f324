"""``import deepspeed`` without MLflow, and ``deepspeed.initialize`` without Muon.

DeepSpeed's autotuner imports MLflow at DeepSpeed's import time when MLflow is installed, which
adds ~2.4 s (MLflow and its dependencies) to the start of every rank of every run on a machine
that has MLflow, for a feature agentrl never runs. ``import_deepspeed`` hides MLflow for the
duration of that one import (the autotuner then records that MLflow is absent); afterwards
``import mlflow`` works as before, and agentrl's MLflow tracker imports it itself.

``deepspeed.initialize`` imports DeepSpeed's Muon optimizer only to ask whether the engine's
optimizer is one (its ZeRO support check, the ZeRO-3 and bf16 optimizers' set-up). That module
wraps its kernels in ``torch.compile`` when it is imported, which loads TorchInductor: ~4 s of
CPU at the start of every rank. agentrl's engines are built with the optimizer agentrl writes
into the DeepSpeed config (AdamW; a ``deepspeed.optimizer`` override is refused), never Muon, so
``initialize`` answers those questions with a stand-in class that no optimizer is an instance
of, for the duration of the call. Muon itself stays importable: afterwards
``import deepspeed.runtime.zero.muon.muon_optimizer`` loads the real module.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_lock = threading.RLock()
_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


@contextmanager
def _standing_in(name: str, module: types.ModuleType | None) -> Iterator[None]:
    """``sys.modules[name]`` is ``module`` within (``None``: importing ``name`` raises
    ``ImportError``), unless ``name`` was imported already; taken out again afterwards, so that a
    later ``import name`` loads the real module."""
    with _lock:
        placed = name not in sys.modules
        if placed:
            sys.modules[name] = module  # type: ignore[assignment]
    try:
        yield
    finally:
        with _lock:
            if placed and name in sys.modules and sys.modules[name] is module:
                del sys.modules[name]


def import_deepspeed() -> types.ModuleType:
    """The ``deepspeed`` module, imported on first call with MLflow hidden from it."""
    with _lock:
        module = sys.modules.get("deepspeed")
        if module is not None:
            return module
        with _standing_in("mlflow", None):
            import deepspeed
        return deepspeed


class NotMuon:
    """Stands in for ``MuonWithAuxAdam`` while ``initialize`` runs: nothing is an instance."""


def initialize(**kwargs: Any) -> tuple[Any, ...]:
    """``deepspeed.initialize(**kwargs)`` for an engine whose optimizer is not Muon."""
    deepspeed = import_deepspeed()
    stand_in = types.ModuleType(_MUON, "agentrl: Muon is not imported by initialize")
    stand_in.MuonWithAuxAdam = NotMuon  # type: ignore[attr-defined]
    with _standing_in(_MUON, stand_in):
        return deepspeed.initialize(**kwargs)
