"""What people write about the learner: the algorithm and the optimizer (pydantic, documented
fields, extras refused). ``agentrl.loop``'s one YAML config embeds both sections.

``AlgorithmConfig.resolved()`` fills every ``None`` with the named algorithm's default (the table
in ``_losses``), so the learner reads plain values.
"""

from __future__ import annotations

from typing import Literal

import pydantic

from ._kl import KLEstimator
from ._losses import Aggregation, PolicyAlgorithm

AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "ppo"]

_CLIP: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),  # MiniMax-M1: no lower bound on the IS weight
    "rloo": (0.2, 0.2),
    "ppo": (0.2, 0.2),
}
_AGG: dict[str, Aggregation] = {
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "gspo": "seq-mean-token-mean",
    "cispo": "token-mean",
    "rloo": "token-mean",
    "ppo": "token-mean",
}
_SURROGATE: dict[str, PolicyAlgorithm] = {
    "grpo": "grpo",
    "dr_grpo": "dr_grpo",
    "dapo": "dapo",
    "gspo": "gspo",
    "cispo": "cispo",
    "rloo": "grpo",  # REINFORCE with a leave-one-out baseline: the clipped surrogate at r = 1
    "ppo": "ppo",
}


class AlgorithmConfig(pydantic.BaseModel):
    """The RL algorithm: advantage estimator, surrogate, KL, entropy and aggregation."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)

    name: AlgorithmName = "grpo"
    """grpo, dr_grpo, dapo (clip-higher, token-mean, dynamic sampling, overlong filter), gspo
    (sequence ratio), cispo (clipped IS-weight REINFORCE), rloo (leave-one-out baseline) or ppo
    (GAE with a critic)."""
    group_size: int | None = pydantic.Field(None, ge=1)
    """Samples per task (G). Sets ``rollout.group_size``; giving both with different values is
    an error. Group estimators need G >= 2."""
    clip_low: float | None = pydantic.Field(None, gt=0)
    """ε_low of the ratio clip (default: the algorithm's, e.g. 0.2)."""
    clip_high: float | None = pydantic.Field(None, gt=0)
    """ε_high (DAPO clip-higher 0.28; default: the algorithm's)."""
    agg: Aggregation | None = None
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm (default: the algorithm's)."""
    norm_length: float | None = pydantic.Field(None, gt=0)
    """Constant length for seq-mean-token-sum-norm (Dr.GRPO); default: the generation budget
    (max_turns × max_new_tokens)."""
    kl_coef: float = pydantic.Field(0.0, ge=0)
    """β of the KL to the frozen reference; 0 skips the reference model entirely."""
    kl_estimator: KLEstimator = "k3"
    """k1, k2 or k3 (Schulman 2020); GRPO uses k3 in the loss, PPO-RLHF k1 in the reward."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """Add β·KL per token to the loss, or subtract it from the reward before advantages."""
    entropy_coef: float = pydantic.Field(0.0, ge=0)
    """Entropy bonus c: the loss subtracts c·H per token."""
    tis_cap: float | None = pydantic.Field(None, gt=0)
    """Truncated importance sampling cap C against the rollout's logprobs (needs
    ``old_logprobs: recompute``); None disables TIS."""
    old_logprobs: Literal["rollout", "recompute"] = "rollout"
    """π_old for the ratio: the engine's logprobs, or the trainer's recomputation (one more
    forward per step; the rollout↔trainer gap is then corrected by TIS)."""
    dynamic_sampling: bool | None = None
    """Drop groups whose rewards are all equal (DAPO; default on for dapo only)."""
    overlong_filter: bool | None = None
    """Mask trajectories cut by a length limit (DAPO; default on for dapo only)."""
    epochs: int = pydantic.Field(1, ge=1)
    """Passes over one step's trajectories."""
    mini_batches: int = pydantic.Field(1, ge=1)
    """Optimizer updates per epoch (trajectories split by group)."""
    gamma: float = pydantic.Field(1.0, ge=0, le=1)
    """PPO: GAE discount."""
    lam: float = pydantic.Field(0.95, ge=0, le=1)
    """PPO: GAE λ."""
    value_clip: float | None = pydantic.Field(0.2, gt=0)
    """PPO: critic value clipping range (None: plain squared error)."""
    critic_lr: float | None = pydantic.Field(None, gt=0)
    """PPO: critic learning rate (default: the optimizer's lr)."""
    whiten_advantages: bool = True
    """PPO: normalize advantages over the step's tokens."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.tis_cap is not None and self.old_logprobs != "recompute":
            raise ValueError("tis_cap needs old_logprobs: recompute (TIS corrects π_old/π_rollout)")
        return self

    def resolved(self) -> AlgorithmConfig:
        """A copy with every default filled in for ``name``."""
        low, high = _CLIP[self.name]
        dapo = self.name == "dapo"
        dynamic = dapo if self.dynamic_sampling is None else self.dynamic_sampling
        return self.model_copy(
            update={
                "clip_low": self.clip_low if self.clip_low is not None else low,
                "clip_high": self.clip_high if self.clip_high is not None else high,
                "agg": self.agg or _AGG[self.name],
                "dynamic_sampling": dynamic,
                "overlong_filter": dapo if self.overlong_filter is None else self.overlong_filter,
            }
        )

    @property
    def surrogate(self) -> PolicyAlgorithm:
        """The ``policy_loss`` algorithm this name uses."""
        return _SURROGATE[self.name]


class OptimizerConfig(pydantic.BaseModel):
    """AdamW (torch's, through DeepSpeed: no JIT build), gradient clipping and the LR schedule."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)

    lr: float = pydantic.Field(1e-6, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's β1, β2."""
    eps: float = pydantic.Field(1e-8, gt=0)
    """Adam's ε."""
    weight_decay: float = pydantic.Field(0.0, ge=0)
    """Decoupled (AdamW) weight decay."""
    warmup_steps: int = pydantic.Field(0, ge=0)
    """Linear warmup from 0 over this many optimizer updates."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: constant, linear decay to ``min_lr_ratio``·lr, or cosine to it."""
    min_lr_ratio: float = pydantic.Field(0.0, ge=0, le=1)
    """Where linear and cosine decay end, as a fraction of ``lr``."""
    grad_clip: float | None = pydantic.Field(1.0, gt=0)
    """Global gradient-norm clip (None: off)."""
