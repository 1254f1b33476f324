"""DeepSpeed is imported without MLflow (its autotuner would import it, ~2.4 s per rank), and
MLflow still imports afterwards for the tracker."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

_SCRIPT = """
import sys
from agentrl.trainer import init_distributed
from agentrl.trainer._deepspeed_import import import_deepspeed

init_distributed(num_threads=1)
print("after init_distributed:", "mlflow" in sys.modules, "deepspeed" in sys.modules)
assert import_deepspeed() is sys.modules["deepspeed"]
from deepspeed.autotuning import autotuner
print("autotuner has mlflow:", autotuner.has_mlflow)
import mlflow
print("then:", type(mlflow).__name__, mlflow.__name__)
"""


@pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="MLflow is not installed"
)  # fmt: skip
def test_the_learner_starts_deepspeed_without_importing_mlflow() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "after init_distributed: False True" in lines, proc.stdout
    assert "autotuner has mlflow: False" in lines, proc.stdout
    assert "then: module mlflow" in lines, proc.stdout
