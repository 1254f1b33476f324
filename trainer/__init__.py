"""The learner: DeepSpeed ZeRO-3 on token-level masks.

It publishes weights through a ``WeightSink`` protocol and never imports the engine.

Layering (pure torch, each module imports only those above it): ``_batch`` (trajectories →
micro-batches, the alignment convention) → ``_logprob`` (chunked log-prob + entropy) →
``_kl`` → ``_advantages`` → ``_losses`` → ``_algorithms`` (the algorithm table: estimator,
surrogate, defaults). On top: ``_config`` (algorithm and optimizer settings), ``_attention``
(varlen attention) and ``_prefix`` (shared-prefix packing), ``_schedule`` (LR), ``_engine``
(DeepSpeed ZeRO-3 policy / reference / critic; deepspeed is imported lazily), ``_deepspeed``
(the config's ``deepspeed`` section, checked against DeepSpeed's own parser), ``_stats`` and
``_learner`` (one training step), ``_in_flight`` (which objectives off-policy samples
need), ``_manifest`` (a checkpoint's file sizes and hashes),
``_lookup`` (the loop state, the newest intact checkpoint), ``_reshard`` (another world size),
``_diskfull`` (a failed save), ``_rng`` (the RNG states, read without unpickling code),
``_checkpoint`` (atomic, verified loop checkpoints), ``_export`` (a checkpoint as an HF folder) and
``_sink`` (the ``WeightSink`` protocol the loop implements).

The settings (``_names``, ``_algorithms``, ``_config``, ``_deepspeed``, ``_in_flight``) and the
checkpoint lookup import without torch, so that a config is checked before torch loads; the rest
loads on first use.
"""

from typing import TYPE_CHECKING

from agentrl import _lazy

from ._algorithms import AlgorithmSpec as AlgorithmSpec
from ._algorithms import GroupEstimator as GroupEstimator
from ._algorithms import algorithm_names as algorithm_names
from ._algorithms import algorithm_spec as algorithm_spec
from ._algorithms import register_algorithm as register_algorithm
from ._algorithms import unregister_algorithm as unregister_algorithm
from ._config import AlgorithmConfig as AlgorithmConfig
from ._config import OptimizerConfig as OptimizerConfig
from ._deepspeed import DeepSpeedSection as DeepSpeedSection
from ._deepspeed import ZeroSection as ZeroSection
from ._in_flight import IN_FLIGHT_RULES as IN_FLIGHT_RULES
from ._in_flight import check_in_flight_objective as check_in_flight_objective
from ._lookup import CHECKPOINT_FORMAT as CHECKPOINT_FORMAT
from ._lookup import IN_FLIGHT_RULE as IN_FLIGHT_RULE
from ._lookup import CheckpointLookup as CheckpointLookup
from ._lookup import CheckpointWarning as CheckpointWarning
from ._lookup import LoopState as LoopState
from ._lookup import find_intact_checkpoint as find_intact_checkpoint
from ._lookup import latest_checkpoint as latest_checkpoint
from ._lookup import list_checkpoints as list_checkpoints
from ._lookup import read_state as read_state
from ._lookup import verify_checkpoint as verify_checkpoint
from ._manifest import CheckpointError as CheckpointError
from ._manifest import CheckpointTooNew as CheckpointTooNew
from ._manifest import CheckpointUnreadable as CheckpointUnreadable
from ._manifest import fsync_dir as fsync_dir
from ._names import Aggregation as Aggregation
from ._names import KLEstimator as KLEstimator
from ._names import Surrogate as Surrogate
from ._schedule import LRSchedule as LRSchedule
from ._schedule import lr_multiplier as lr_multiplier

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from ._advantages import GAE as GAE
    from ._advantages import dr_grpo_advantages as dr_grpo_advantages
    from ._advantages import dynamic_sampling_mask as dynamic_sampling_mask
    from ._advantages import gae_advantages as gae_advantages
    from ._advantages import group_index as group_index
    from ._advantages import grpo_advantages as grpo_advantages
    from ._advantages import masked_whiten as masked_whiten
    from ._advantages import overlong_penalty as overlong_penalty
    from ._advantages import rloo_advantages as rloo_advantages
    from ._advantages import terminal_rewards as terminal_rewards
    from ._batch import PackedBatch as PackedBatch
    from ._batch import block_causal_mask as block_causal_mask
    from ._batch import model_inputs as model_inputs
    from ._batch import overlong_filter as overlong_filter
    from ._batch import pack_trajectories as pack_trajectories
    from ._batch import pad_trajectories as pad_trajectories
    from ._batch import turn_advantages as turn_advantages
    from ._checkpoint import consolidated_state_dict as consolidated_state_dict
    from ._checkpoint import load_checkpoint as load_checkpoint
    from ._checkpoint import save_checkpoint as save_checkpoint
    from ._checkpoint import step_dir as step_dir
    from ._checkpoint import verify_state as verify_state
    from ._dist import barrier as barrier
    from ._dist import rank_world as rank_world
    from ._engine import DistInfo as DistInfo
    from ._engine import ModelEngine as ModelEngine
    from ._engine import TokenScorer as TokenScorer
    from ._engine import deepspeed_config as deepspeed_config
    from ._engine import init_distributed as init_distributed
    from ._engine import open_critic as open_critic
    from ._engine import open_policy as open_policy
    from ._engine import open_reference as open_reference
    from ._export import export_checkpoint as export_checkpoint
    from ._kl import kl_estimate as kl_estimate
    from ._kl import kl_in_reward as kl_in_reward
    from ._learner import Learner as Learner
    from ._learner import LearnerSettings as LearnerSettings
    from ._logprob import TokenLogprobs as TokenLogprobs
    from ._logprob import causal_lm_token_logprobs as causal_lm_token_logprobs
    from ._logprob import token_logprobs_and_entropy as token_logprobs_and_entropy
    from ._losses import LossMetrics as LossMetrics
    from ._losses import LossOutput as LossOutput
    from ._losses import ValueLossOutput as ValueLossOutput
    from ._losses import aggregate as aggregate
    from ._losses import policy_loss as policy_loss
    from ._losses import value_loss as value_loss
    from ._prefix import pack_shared_prefix as pack_shared_prefix
    from ._rng import rng_state as rng_state
    from ._sink import WeightSink as WeightSink
    from ._stats import PairStats as PairStats
    from ._stats import StepStats as StepStats

_LAZY = {
    "GAE": "_advantages",
    "dr_grpo_advantages": "_advantages",
    "dynamic_sampling_mask": "_advantages",
    "gae_advantages": "_advantages",
    "group_index": "_advantages",
    "grpo_advantages": "_advantages",
    "masked_whiten": "_advantages",
    "overlong_penalty": "_advantages",
    "rloo_advantages": "_advantages",
    "terminal_rewards": "_advantages",
    "PackedBatch": "_batch",
    "block_causal_mask": "_batch",
    "model_inputs": "_batch",
    "overlong_filter": "_batch",
    "pack_trajectories": "_batch",
    "pad_trajectories": "_batch",
    "turn_advantages": "_batch",
    "consolidated_state_dict": "_checkpoint",
    "load_checkpoint": "_checkpoint",
    "save_checkpoint": "_checkpoint",
    "step_dir": "_checkpoint",
    "verify_state": "_checkpoint",
    "barrier": "_dist",
    "rank_world": "_dist",
    "DistInfo": "_engine",
    "ModelEngine": "_engine",
    "TokenScorer": "_engine",
    "deepspeed_config": "_engine",
    "init_distributed": "_engine",
    "open_critic": "_engine",
    "open_policy": "_engine",
    "open_reference": "_engine",
    "export_checkpoint": "_export",
    "kl_estimate": "_kl",
    "kl_in_reward": "_kl",
    "Learner": "_learner",
    "LearnerSettings": "_learner",
    "TokenLogprobs": "_logprob",
    "causal_lm_token_logprobs": "_logprob",
    "token_logprobs_and_entropy": "_logprob",
    "LossMetrics": "_losses",
    "LossOutput": "_losses",
    "ValueLossOutput": "_losses",
    "aggregate": "_losses",
    "policy_loss": "_losses",
    "value_loss": "_losses",
    "pack_shared_prefix": "_prefix",
    "rng_state": "_rng",
    "WeightSink": "_sink",
    "PairStats": "_stats",
    "StepStats": "_stats",
}

__all__ = [
    "Aggregation",
    "AlgorithmConfig",
    "AlgorithmSpec",
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "CheckpointTooNew",
    "CheckpointUnreadable",
    "CheckpointLookup",
    "CheckpointWarning",
    "DeepSpeedSection",
    "DistInfo",
    "GAE",
    "GroupEstimator",
    "IN_FLIGHT_RULE",
    "IN_FLIGHT_RULES",
    "KLEstimator",
    "LRSchedule",
    "Learner",
    "LearnerSettings",
    "LoopState",
    "LossMetrics",
    "LossOutput",
    "ModelEngine",
    "OptimizerConfig",
    "PackedBatch",
    "PairStats",
    "StepStats",
    "Surrogate",
    "TokenLogprobs",
    "TokenScorer",
    "ValueLossOutput",
    "WeightSink",
    "ZeroSection",
    "aggregate",
    "algorithm_names",
    "algorithm_spec",
    "barrier",
    "block_causal_mask",
    "causal_lm_token_logprobs",
    "check_in_flight_objective",
    "consolidated_state_dict",
    "deepspeed_config",
    "dr_grpo_advantages",
    "dynamic_sampling_mask",
    "export_checkpoint",
    "find_intact_checkpoint",
    "fsync_dir",
    "gae_advantages",
    "group_index",
    "grpo_advantages",
    "init_distributed",
    "kl_estimate",
    "kl_in_reward",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "lr_multiplier",
    "masked_whiten",
    "model_inputs",
    "open_critic",
    "open_policy",
    "open_reference",
    "overlong_filter",
    "overlong_penalty",
    "pack_shared_prefix",
    "pack_trajectories",
    "pad_trajectories",
    "policy_loss",
    "rank_world",
    "read_state",
    "register_algorithm",
    "rloo_advantages",
    "rng_state",
    "save_checkpoint",
    "step_dir",
    "terminal_rewards",
    "token_logprobs_and_entropy",
    "turn_advantages",
    "unregister_algorithm",
    "value_loss",
    "verify_checkpoint",
    "verify_state",
]


__dir__ = _lazy.lazy_dir(__name__, __all__)
if not TYPE_CHECKING:  # hidden from type checkers, so a misspelt name is an error there
    __getattr__ = _lazy.lazy_getattr(__name__, _LAZY)

del TYPE_CHECKING
