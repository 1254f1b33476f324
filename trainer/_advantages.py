"""Advantage estimators: group-relative (GRPO, Dr.GRPO, RLOO), DAPO's sampling filters, GAE.

Group estimators take one reward per trajectory (``rewards [S]``) and a group index
(``group_index [S]`` int64, trajectories answering the same task share one; build it from
``Trajectory.group_id`` with :func:`group_index`) and return one advantage per trajectory, which
``pack_trajectories`` broadcasts onto the trajectory's sampled tokens. GAE works on per-token
tensors in the batch layout (``[B, T]``, aligned like ``PackedBatch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


def group_index(group_ids: Sequence[str]) -> torch.Tensor:
    """``[S]`` int64: groups numbered in order of first appearance."""
    numbers: dict[str, int] = {}
    return torch.tensor([numbers.setdefault(g, len(numbers)) for g in group_ids], dtype=torch.long)


def _group_stats(
    rewards: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-trajectory group size, group mean and unbiased group std (0 for singletons)."""
    if rewards.ndim != 1 or groups.shape != rewards.shape:
        raise ValueError(f"expected rewards [S] and groups [S]: {rewards.shape}, {groups.shape}")
    num = int(groups.max()) + 1 if groups.numel() else 0
    size = rewards.new_zeros(num).index_add_(0, groups, torch.ones_like(rewards))
    mean = rewards.new_zeros(num).index_add_(0, groups, rewards) / size.clamp(min=1)
    centered = rewards - mean[groups]
    sq = rewards.new_zeros(num).index_add_(0, groups, centered.square())
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    return size[groups], mean[groups], std[groups]


def grpo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO outcome-supervision advantage (Shao et al. 2024, DeepSeekMath, §4.1.2; objective
    eq. 3): ``Â_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the trajectory's group ``g``,
    the same for all of its tokens. ``std`` is the unbiased sample std (``torch.std``, as in
    TRL and verl); a singleton group gets 0. ``scale_by_std=False`` is Dr.GRPO."""
    _, mean, std = _group_stats(rewards, groups)
    centered = rewards - mean
    return centered / (std + eps) if scale_by_std else centered


def dr_grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    Fig. 1): ``Â_i = r_i - mean_g(r)``: GRPO without the std division (its question-level
    difficulty bias). Its other fix, no ``1/|o_i|`` length normalization, is the loss
    aggregation ``seq-mean-token-sum-norm`` (or ``token-mean``), not an advantage."""
    return grpo_advantages(rewards, groups, scale_by_std=False)


def rloo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE
    Style Optimization for Learning from Human Feedback in LLMs"; Kool et al. 2019):
    ``Â_i = r_i - 1/(k-1) Σ_{j≠i} r_j = k/(k-1) (r_i - mean_g(r))`` for a group of ``k``
    samples. A singleton group has no baseline and gets 0 (it carries no signal)."""
    size, mean, _ = _group_stats(rewards, groups)
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
    return scale * (rewards - mean)


def dynamic_sampling_mask(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, §3.2, "Dynamic Sampling": the constraint
    ``0 < |{o_i | is_equivalent(a, o_i)}| < G``): ``[S]`` bool, False for every trajectory of a
    group whose rewards are all equal (its group advantages are all 0: no gradient, only noise
    in the token count). Exact equality: rewards are verifier outputs, not noisy estimates."""
    num = int(groups.max()) + 1 if groups.numel() else 0
    inf = rewards.new_full((num,), float("inf"))
    low = inf.scatter_reduce(0, groups, rewards, "amin")
    high = (-inf).scatter_reduce(0, groups, rewards, "amax")
    return (high > low)[groups]


def overlong_penalty(
    lengths: torch.Tensor, *, max_length: int, buffer_length: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, §3.4, "Overlong Reward Shaping"), added to
    the reward: 0 for ``|y| <= L_max - L_cache``, ``((L_max - L_cache) - |y|) / L_cache`` inside
    the buffer, ``-1`` beyond ``L_max``; scaled by ``penalty``. ``lengths [S]`` are response
    (sampled) token counts."""
    safe = max_length - buffer_length
    lengths = lengths.to(torch.float64)
    inside = (safe - lengths) / buffer_length
    out = torch.where(lengths <= safe, torch.zeros_like(lengths), inside)
    return penalty * torch.where(lengths > max_length, torch.full_like(lengths, -1.0), out)


class GAE(NamedTuple):
    """Both ``[B, T]`` in the rewards' dtype, 0 where ``mask`` is False."""

    advantages: torch.Tensor
    returns: torch.Tensor
    """``advantages + values``: the critic's regression target (λ-return)."""


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    sequence_index: torch.Tensor | None = None,
) -> GAE:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16; PPO, Schulman et al. 2017,
    eqs. 11-12): ``δ_t = r_t + γ V_{t+1} - V_t``, ``Â_t = δ_t + γλ Â_{t+1}``, with ``V`` and
    ``Â`` past the last action equal to 0 (the episode ends).

    Steps are the positions where ``mask`` is True (the sampled tokens, batch-aligned). Positions
    in between (tool outputs, templates) are not actions: they are skipped, so ``t + 1`` is the
    *next sampled* token of the same sequence even across a tool call. ``rewards``, ``values``,
    ``mask`` are ``[B, T]`` (or ``[S, L]``); ``sequence_index [B, T]`` separates packed
    sequences (None: each row is one sequence). Place the outcome reward on the last sampled
    token with :func:`terminal_rewards`; fold a KL penalty in with ``kl_in_reward``.
    """
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(f"shapes differ: {rewards.shape}, {values.shape}, {mask.shape}")
    keep = mask.bool()
    rewards = torch.where(keep, rewards, torch.zeros_like(rewards))
    values = torch.where(keep, values.detach().to(rewards.dtype), torch.zeros_like(rewards))
    b, t = rewards.shape
    seq = (
        sequence_index
        if sequence_index is not None
        else torch.zeros_like(rewards, dtype=torch.long)
    )
    next_value = rewards.new_zeros(b)
    next_adv = rewards.new_zeros(b)
    next_seq = torch.full((b,), -2, dtype=torch.long, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    for i in reversed(range(t)):
        same = seq[:, i] == next_seq  # a new (later) sequence starts after i: reset the carry
        next_value = torch.where(same, next_value, 0.0)
        next_adv = torch.where(same, next_adv, 0.0)
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        adv = delta + gamma * lam * next_adv
        k = keep[:, i]
        advantages[:, i] = torch.where(k, adv, 0.0)
        next_value = torch.where(k, values[:, i], next_value)
        next_adv = torch.where(k, adv, next_adv)
        next_seq = seq[:, i]
    return GAE(advantages, torch.where(keep, advantages + values, 0.0))


def terminal_rewards(
    sequence_rewards: torch.Tensor, mask: torch.Tensor, sequence_index: torch.Tensor
) -> torch.Tensor:
    """``[B, T]`` per-token rewards: each sequence's reward (``sequence_rewards [S]``) on its
    last position with ``mask`` True, 0 elsewhere (the outcome reward for GAE)."""
    keep = mask.bool() & (sequence_index >= 0)
    flat_seq = sequence_index.flatten()
    positions = torch.arange(flat_seq.numel(), device=mask.device)
    last = torch.full((sequence_rewards.numel(),), -1, dtype=torch.long, device=mask.device)
    last = last.scatter_reduce(0, flat_seq[keep.flatten()], positions[keep.flatten()], "amax")
    out = torch.zeros(flat_seq.numel(), dtype=sequence_rewards.dtype, device=mask.device)
    present = last >= 0
    out[last[present]] = sequence_rewards[present]
    return out.view(mask.shape)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries (PPO's batch advantage normalization); 0
    elsewhere."""
    keep = mask.bool()
    selected = values[keep]
    if selected.numel() < 2:
        return torch.zeros_like(values)
    out = (values - selected.mean()) / (selected.std() + eps)
    return torch.where(keep, out, torch.zeros_like(out))
