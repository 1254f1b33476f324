"""The learner (issue D): DeepSpeed ZeRO-3 on token-level masks.

It publishes weights through a ``WeightSink`` protocol and never imports the engine.

Layering (pure torch, each module imports only those above it): ``_batch`` (trajectories →
micro-batches, the alignment convention) → ``_logprob`` (chunked log-prob + entropy) →
``_kl`` → ``_advantages`` → ``_losses``. The DeepSpeed engine, loop and checkpoint build on these.
"""

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
from ._kl import KLEstimator as KLEstimator
from ._kl import kl_estimate as kl_estimate
from ._kl import kl_in_reward as kl_in_reward
from ._logprob import TokenLogprobs as TokenLogprobs
from ._logprob import causal_lm_token_logprobs as causal_lm_token_logprobs
from ._logprob import token_logprobs_and_entropy as token_logprobs_and_entropy
from ._losses import Aggregation as Aggregation
from ._losses import LossMetrics as LossMetrics
from ._losses import LossOutput as LossOutput
from ._losses import PolicyAlgorithm as PolicyAlgorithm
from ._losses import ValueLossOutput as ValueLossOutput
from ._losses import aggregate as aggregate
from ._losses import policy_loss as policy_loss
from ._losses import value_loss as value_loss
