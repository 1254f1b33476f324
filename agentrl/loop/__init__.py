"""The training loop (a composition root: it may import everything).

``_config`` (the one YAML run config, ``--set`` overrides) → ``_ledger`` (ledger.jsonl,
TensorBoard, progress) → the runtime's roles: ``_tasks`` (the task stream and its accounting),
``_actors`` (rollouts on the engines), ``_buffer`` (the trajectory buffer), ``_learner`` (what
each step trains on, and the update), ``_publisher`` (weights to the engines),
``_checkpointer`` (the loop's checkpoints) → ``_runtime`` (composes them: ``atrain``) →
``_eval`` (``agentrl eval`` / ``export``) → ``_cli`` (the commands, registered into
``agentrl.cli``).

Only ``add_train_commands`` is imported eagerly (``agentrl --help`` stays fast); the rest loads
torch, DeepSpeed and transformers on first use.
"""

from typing import TYPE_CHECKING

from agentrl import _lazy

from ._cli import add_train_commands as add_train_commands

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from ._config import TrainConfig as TrainConfig
    from ._config import apply_overrides as apply_overrides
    from ._config import dump_config as dump_config
    from ._config import load_train_config as load_train_config
    from ._eval import aevaluate as aevaluate
    from ._eval import export_run as export_run
    from ._eval import find_checkpoint as find_checkpoint
    from ._ledger import Ledger as Ledger
    from ._ledger import read_ledger as read_ledger
    from ._ledger import rollout_metrics as rollout_metrics
    from ._publisher import EngineWeightSink as EngineWeightSink
    from ._records import TrainingStalled as TrainingStalled
    from ._runtime import TrainResult as TrainResult
    from ._runtime import atrain as atrain
    from ._runtime import train as train
    from ._tasks import TaskStream as TaskStream

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
    "EngineWeightSink": "_publisher",
    "TaskStream": "_tasks",
    "TrainResult": "_runtime",
    "TrainingStalled": "_records",
    "atrain": "_runtime",
    "train": "_runtime",
}

__all__ = [
    "EngineWeightSink",
    "Ledger",
    "TaskStream",
    "TrainConfig",
    "TrainResult",
    "TrainingStalled",
    "add_train_commands",
    "aevaluate",
    "apply_overrides",
    "atrain",
    "dump_config",
    "export_run",
    "find_checkpoint",
    "load_train_config",
    "read_ledger",
    "rollout_metrics",
    "train",
]


__dir__ = _lazy.lazy_dir(__name__, __all__)
if not TYPE_CHECKING:  # hidden from type checkers, so a misspelt name is an error there
    __getattr__ = _lazy.lazy_getattr(__name__, _LAZY)

del TYPE_CHECKING
