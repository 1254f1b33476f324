"""``import deepspeed`` without MLflow.

DeepSpeed's autotuner imports MLflow at DeepSpeed's import time when MLflow is installed, which
adds ~2.4 s (MLflow and its dependencies) to the start of every rank of every run on a machine
that has MLflow, for a feature agentrl never runs. ``import_deepspeed`` hides MLflow for the
duration of that one import (the autotuner then records that MLflow is absent); afterwards
``import mlflow`` works as before, and agentrl's MLflow tracker imports it itself.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType

_lock = threading.Lock()


def import_deepspeed() -> ModuleType:
    """The ``deepspeed`` module, imported on first call with MLflow hidden from it."""
    with _lock:
        module = sys.modules.get("deepspeed")
        if module is not None:
            return module
        hide = "mlflow" not in sys.modules
        if hide:
            sys.modules["mlflow"] = None  # type: ignore[assignment]  # import: ImportError
        try:
            import deepspeed
        finally:
            if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
                del sys.modules["mlflow"]
        return deepspeed
