"""What people write about the learner: the algorithm, the optimizer and the DeepSpeed section
(pydantic, documented fields, extras refused). ``agentrl.loop``'s one YAML config embeds them.

``AlgorithmConfig.resolved()`` returns a copy with every ``None`` filled from the named
algorithm's row of the table in ``_algorithms``, so the learner reads plain values.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic

from agentrl._config import NumbersNotBools

from ._algorithms import AlgorithmSpec, algorithm_spec
from ._names import Aggregation, KLEstimator, Surrogate

_DOCS = pydantic.ConfigDict(
    extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
)


_Beta = Annotated[float, pydantic.Field(ge=0, lt=1)]
"""An Adam moment decay: torch's AdamW refuses anything outside [0, 1)."""


class AlgorithmConfig(NumbersNotBools):
    """The RL algorithm: advantage estimator, surrogate, KL, entropy and aggregation."""

    model_config = _DOCS

    name: str = "grpo"
    """A registered algorithm (the table of algorithms in the configuration reference,
    ``agentrl.trainer.algorithm_names()``): it decides the advantage estimator, the surrogate
    and every default below. Group estimators need ``rollout.group_size >= 2``."""
    clip_low: float | None = pydantic.Field(None, gt=0)
    """ε_low of the ratio clip (default: the algorithm's)."""
    clip_high: float | None = pydantic.Field(None, gt=0)
    """ε_high (DAPO clip-higher 0.28; default: the algorithm's)."""
    agg: Aggregation | None = None
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm (default: the algorithm's)."""
    norm_length: float | None = pydantic.Field(None, gt=0)
    """Constant length for seq-mean-token-sum-norm (Dr.GRPO); default: the generation budget
    (max_turns × max_new_tokens)."""
    kl_coef: float | None = pydantic.Field(None, ge=0)
    """β of the KL to the frozen reference; 0 skips the reference model entirely (default: the
    algorithm's, 0 for every built-in one)."""
    kl_estimator: KLEstimator = "k3"
    """k1, k2 or k3 (Schulman 2020); GRPO uses k3 in the loss, PPO-RLHF k1 in the reward. k3 is
    bounded as verl's ``low_var_kl``: log-ratio clamped to ±20, the estimate to 10."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """Add β·KL per token to the loss, or subtract it from the reward before advantages."""
    entropy_coef: float = pydantic.Field(0.0, ge=0)
    """Entropy bonus c: the loss subtracts c·H per token."""
    clip_ratio_c: float | None = pydantic.Field(3.0, gt=1)
    """Dual clip (Ye et al. 2020; verl's ``clip_ratio_c``) of the ``clip`` surrogate: a token with
    a negative advantage adds at most ``-c·Â`` to the loss, however far its ratio has run above
    1 (no gradient there, like a clipped token); None turns it off. GSPO and CISPO ignore it."""
    tis_cap: float | None = pydantic.Field(None, gt=0)
    """Truncated importance sampling cap C against the rollout's logprobs (needs
    ``old_logprobs: recompute``); None disables TIS."""
    old_logprobs: Literal["rollout", "recompute"] = "rollout"
    """π_old for the ratio: the engine's logprobs, or the trainer's recomputation (one more
    forward per step; the rollout↔trainer gap is then corrected by TIS)."""
    dynamic_sampling: bool | None = None
    """Drop groups whose rewards are all equal (DAPO's dynamic sampling; default: the
    algorithm's)."""
    overlong_filter: bool | None = None
    """Mask trajectories cut by a length limit (DAPO's overlong filter; default: the
    algorithm's)."""
    epochs: int = pydantic.Field(1, ge=1)
    """Passes over one step's trajectories."""
    mini_batches: int = pydantic.Field(1, ge=1)
    """Optimizer updates per epoch (trajectories split by group; every rank makes the same
    number, taking empty mini-batches when it holds fewer groups than this)."""
    gamma: float = pydantic.Field(1.0, ge=0, le=1)
    """GAE discount (algorithms with a critic)."""
    lam: float = pydantic.Field(0.95, ge=0, le=1)
    """GAE λ (algorithms with a critic)."""
    value_clip: float | None = pydantic.Field(0.2, gt=0)
    """Critic value clipping range (None: plain squared error)."""
    critic_lr: float | None = pydantic.Field(None, gt=0)
    """Critic learning rate (default: the optimizer's lr)."""
    whiten_advantages: bool = True
    """GAE: normalize advantages over the step's tokens."""

    @pydantic.field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        algorithm_spec(name)  # ValueError naming the registered algorithms
        return name

    @pydantic.model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.tis_cap is not None and self.old_logprobs != "recompute":
            raise ValueError("tis_cap needs old_logprobs: recompute (TIS corrects π_old/π_rollout)")
        return self

    @property
    def spec(self) -> AlgorithmSpec:
        """The algorithm's row of the table (estimator, surrogate, defaults, needs)."""
        return algorithm_spec(self.name)

    @property
    def surrogate(self) -> Surrogate:
        """The ``policy_loss`` surrogate this algorithm minimizes."""
        return self.spec.surrogate

    @property
    def needs_reference(self) -> bool:
        """Does the learner score a frozen reference (a KL coefficient above 0)?"""
        return (self.kl_coef if self.kl_coef is not None else self.spec.kl_coef) > 0

    def resolved(self) -> AlgorithmConfig:
        """A copy with every unset (``None``) setting filled from the algorithm's row."""
        spec = self.spec
        defaults = {
            "clip_low": spec.clip_low,
            "clip_high": spec.clip_high,
            "agg": spec.agg,
            "kl_coef": spec.kl_coef,
            "dynamic_sampling": spec.dynamic_sampling,
            "overlong_filter": spec.overlong_filter,
        }
        return self.model_copy(
            update={k: v for k, v in defaults.items() if getattr(self, k) is None}
        )


class OptimizerConfig(NumbersNotBools):
    """AdamW (torch's, through DeepSpeed: no JIT build), gradient clipping and the LR schedule."""

    model_config = _DOCS

    lr: float = pydantic.Field(1e-6, gt=0)
    """Peak learning rate."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """Adam's β1, β2, each in [0, 1)."""
    eps: float = pydantic.Field(1e-8, gt=0)
    """Adam's ε."""
    weight_decay: float = pydantic.Field(0.0, ge=0)
    """Decoupled (AdamW) weight decay."""
    warmup_steps: int = pydantic.Field(0, ge=0)
    """Linear warmup from 0 over this many optimizer updates. The schedule counts
    ``epochs × mini_batches`` updates per step even when a step makes fewer (fewer groups than
    mini-batches, nothing left to train on), so it ends at the last of the ``max_steps`` the run
    started with (a resume with more steps keeps that length)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: constant, linear decay to ``min_lr_ratio``·lr, or cosine to it."""
    min_lr_ratio: float = pydantic.Field(0.0, ge=0, le=1)
    """Where linear and cosine decay end, as a fraction of ``lr``."""
    grad_clip: float | None = pydantic.Field(1.0, gt=0)
    """Global gradient-norm clip (None: off)."""
