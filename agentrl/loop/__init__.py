"""The training loop (a composition root: it may import everything).

``_config`` (the one YAML run config, ``--set`` overrides) → ``_ledger`` (ledger.jsonl,
TensorBoard, progress) → ``_train`` (the synchronous on-policy loop and ``EngineWeightSink``, the
``WeightSink`` over an engine) → ``_eval`` (``agentrl eval`` / ``export``) → ``_cli`` (the
commands, registered into ``agentrl.cli``).

Only ``add_train_commands`` is imported eagerly (``agentrl --help`` stays fast); the rest loads
torch, DeepSpeed and transformers on first use.
"""

from importlib import import_module
from typing import Any

from ._cli import add_train_commands as add_train_commands

_LAZY = {
    "TrainConfig": "_config",
    "apply_overrides": "_config",
    "dump_config": "_config",
    "load_train_config": "_config",
    "aevaluate": "_eval",
    "export_run": "_eval",
    "find_checkpoint": "_eval",
    "Ledger": "_ledger",
    "read_ledger": "_ledger",
    "rollout_metrics": "_ledger",
    "EngineWeightSink": "_train",
    "TaskStream": "_train",
    "TrainResult": "_train",
    "atrain": "_train",
    "train": "_train",
}

__all__ = ["add_train_commands", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'agentrl.loop' has no attribute {name!r}")
