"""Statistics of one learner step, accumulated over micro-batches (what the ledger records)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ._kl import kl_estimate
from ._losses import LossOutput

_TOKEN_MEANS = (
    "entropy",
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "clip_fraction_dual",
    "ratio_mean",
    "approx_kl",
    "tis_weight_mean",
    "tis_clip_fraction",
)


@dataclass
class PairStats:
    """Token-level comparison of two logprob tensors ``a`` (the trainer's) and ``b`` over a
    mask: mean |a - b|, max |a - b| and the k3 estimate of KL(π_b ‖ π_a) (tokens sampled from
    ``b``'s policy, e.g. the rollout)."""

    tokens: int = 0
    abs_sum: float = 0.0
    abs_max: float = 0.0
    kl_sum: float = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> None:
        keep = mask.bool().cpu()
        if not keep.any():
            return
        a, b = a.detach().cpu().double()[keep], b.detach().cpu().double()[keep]
        diff = (a - b).abs()
        self.tokens += int(keep.sum())
        self.abs_sum += float(diff.sum())
        self.abs_max = max(self.abs_max, float(diff.max()))
        self.kl_sum += float(kl_estimate(b, a, "k3").sum())

    def summary(self) -> dict[str, float | None]:
        n = self.tokens
        return {
            "abs_mean": self.abs_sum / n if n else None,
            "abs_max": self.abs_max if n else None,
            "kl": self.kl_sum / n if n else None,
        }


@dataclass
class TokenStats:
    """What the first pass over a step's tokens sees: the trainer's KL to the reference (k3 of
    KL(π_θ ‖ π_ref), averaged over sampled tokens) and token counts."""

    tokens: int = 0
    positions: int = 0
    kl_sum: float = 0.0
    kl_tokens: int = 0

    def add(self, logprobs, rollout_logprobs, mask, ref_logprobs) -> None:
        keep = mask.bool().cpu()
        self.tokens += int(keep.sum())
        self.positions += int(mask.numel())
        if ref_logprobs is not None and keep.any():
            lp = logprobs.detach().cpu().double()[keep]
            ref = ref_logprobs.detach().cpu().double()[keep]
            self.kl_sum += float(kl_estimate(lp, ref, "k3").sum())
            self.kl_tokens += int(keep.sum())


@dataclass
class StepStats:
    """One ``Learner.train_step``: counts, timings (s), losses and token statistics."""

    trajectories_in: int = 0
    trajectories_used: int = 0
    """Trajectories with a reward and a nonzero algorithm mask."""
    groups_filtered: int = 0
    """Groups dropped by DAPO's dynamic sampling (all rewards equal)."""
    reference_s: float = 0.0
    logprob_s: float = 0.0
    update_s: float = 0.0
    updates: int = 0
    micro_batches: int = 0
    loss: float = 0.0
    policy_loss: float = 0.0
    kl_loss: float = 0.0
    value_loss: float = 0.0
    norms: list[float] = field(default_factory=list)
    """Each update's pre-clip gradient norm, as DeepSpeed reported it (``grad_norm``)."""
    lr: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    learner_tokens: int = 0
    """Model positions computed per pass (packed: no padding)."""
    loss_tokens: int = 0
    """Sampled tokens trained on (the loss mask), per pass."""
    token_means: dict[str, float] = field(default_factory=dict)
    tokens: TokenStats = field(default_factory=TokenStats)
    mismatch: PairStats = field(default_factory=PairStats)
    _weight: float = 0.0

    @property
    def grad_norm(self) -> float:
        """The largest pre-clip gradient norm of the step's updates (an overflowed one, inf or
        NaN, wins: it is the one to see); NaN when no update reported one."""
        overflow = [n for n in self.norms if not math.isfinite(n)]
        return overflow[0] if overflow else max(self.norms, default=math.nan)

    def add_loss(self, out: LossOutput, mask: torch.Tensor) -> None:
        m = out.metrics
        n = float(m.num_tokens)
        self.micro_batches += 1
        self.loss += float(out.loss.detach())
        self.policy_loss += float(m.policy_loss)
        self.kl_loss += float(m.kl_loss)
        if n > 0:
            self.ratio_min = min(self.ratio_min, float(m.ratio_min))
            self.ratio_max = max(self.ratio_max, float(m.ratio_max))
        for name in _TOKEN_MEANS:
            self.token_means[name] = self.token_means.get(name, 0.0) + n * float(getattr(m, name))
        self._weight += n

    def finish(self, lr: float) -> StepStats:
        self.lr = lr
        per_update = max(1, self.updates)
        self.loss /= per_update
        self.policy_loss /= per_update
        self.kl_loss /= per_update
        self.value_loss /= per_update
        w = self._weight
        self.token_means = {k: (v / w if w else 0.0) for k, v in self.token_means.items()}
        self.learner_tokens = self.tokens.positions
        self.loss_tokens = self.tokens.tokens
        return self

    def as_dict(self) -> dict[str, object]:
        """Flat, JSON-ready: token means inlined, ``kl`` (None without a reference) and the
        rollout↔trainer ``mismatch_*`` fields."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.name.startswith("_")
            and f.name not in ("token_means", "tokens", "mismatch", "norms")
        }
        out["grad_norm"] = self.grad_norm
        out.update(self.token_means)
        t = self.tokens
        out["kl"] = t.kl_sum / t.kl_tokens if t.kl_tokens else None
        out.update({f"mismatch_{k}": v for k, v in self.mismatch.summary().items()})
        for key in ("ratio_min", "ratio_max", "grad_norm"):
            if not math.isfinite(out[key]):  # type: ignore[arg-type]
                out[key] = None
        return out
