"""KL to the reference policy: per-token estimators, in the loss or in the reward.

With tokens sampled from the policy π and ``log r = log π_ref(y) - log π(y)``, Schulman's
"Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html) gives three
single-sample estimators of KL(π ‖ π_ref)::

    k1 = -log r                   unbiased, high variance, can be negative
    k2 = ½ (log r)²               biased (low bias when π ≈ π_ref), low variance, ≥ 0
    k3 = (r - 1) - log r          unbiased, low variance, ≥ 0   (GRPO, Shao et al. 2024, eq. 4)

Their *gradients* differ from their values' roles: as a loss term on on-policy samples, k2's
gradient is in expectation the gradient of KL(π ‖ π_ref), k1's vanishes in expectation and k3's is
the gradient of KL(π_ref ‖ π) (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient
estimation for RL"); k1 is the usual choice *in the reward* (PPO-RLHF, Ouyang et al. 2022, eq. 2).
"""

from __future__ import annotations

import torch

from agentrl.kernels import K3_MAX, MAX_LOG_RATIO

from ._names import KLEstimator


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator
) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from ``logprobs = log π(y)`` and ``ref_logprobs =
    log π_ref(y)`` of the same sampled tokens (any equal shapes; float). Elementwise; mask and
    aggregate outside.

    k3 is bounded as verl's ``low_var_kl`` is: ``log r`` clamped to ±``MAX_LOG_RATIO`` (20) and
    the estimate to ``K3_MAX`` (10), so one token the policy has moved far from the reference
    adds at most 10 (with no gradient) instead of an exponential that overflows."""
    log_r = ref_logprobs - logprobs
    match estimator:
        case "k1":
            return -log_r
        case "k2":
            return 0.5 * log_r.square()
        case "k3":
            # expm1 keeps (r - 1) - log r accurate when r ≈ 1 (no cancellation of two ~1 terms)
            log_r = log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
            return (torch.expm1(log_r) - log_r).clamp(max=K3_MAX)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def kl_in_reward(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """Per-token rewards with the KL penalty folded in: ``r_t - β · k(π, π_ref)_t`` on masked
    tokens, ``r_t`` elsewhere (Ouyang et al. 2022, eq. 2; Ziegler et al. 2019, §2).

    All tensors share one shape (e.g. ``[B, T]`` batch layout; ``mask`` bool). ``logprobs`` are
    the sampling policy's (old) logprobs; nothing here is differentiated (inputs are detached).
    Feed the result to GAE (``gae_advantages``) for PPO.
    """
    kl = kl_estimate(logprobs.detach(), ref_logprobs.detach(), estimator)
    return token_rewards - kl_coef * torch.where(mask.bool(), kl, torch.zeros_like(kl))
