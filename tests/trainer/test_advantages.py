"""Advantage estimators by hand and against their definitions; advantage placement on tokens."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from numerics import EMULATION_SAFETY, emulated_rounding_error, gamma, unit_roundoff
from trajectories import trajectory_from_pieces

from agentrl.trainer import (
    causal_lm_token_logprobs,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    gae_advantages,
    group_index,
    grpo_advantages,
    masked_whiten,
    overlong_penalty,
    pack_trajectories,
    policy_loss,
    rloo_advantages,
    terminal_rewards,
)

U64 = unit_roundoff(torch.float64)
HAND = 32 * 16 * U64
"""The by-hand examples: at most 32 float64 roundings, each of an intermediate of magnitude at
most 16; errors add at most linearly (Higham's γ_n)."""

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0], dtype=torch.float64)
GROUPS = group_index(["a", "a", "a", "a", "b", "b", "c"])


def test_group_index_numbers_in_first_appearance_order():
    assert group_index(["x", "y", "x", "z", "y"]).tolist() == [0, 1, 0, 2, 1]
    assert GROUPS.tolist() == [0, 0, 0, 0, 1, 1, 2]


def test_grpo_by_hand():
    # group a: mean 0.5, unbiased std sqrt((4 · 0.25) / 3); b: all equal; c: singleton
    std = math.sqrt(1.0 / 3.0)
    want = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0, 0.0]
    got = grpo_advantages(REWARDS, GROUPS, eps=1e-12)
    # eps in the denominator moves 0.5 / std by 0.5 eps / std² (relative eps / std)
    assert got.tolist() == pytest.approx(want, abs=HAND + 0.5 * 1e-12 / std**2)
    assert dr_grpo_advantages(REWARDS, GROUPS).tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0], abs=HAND
    )


def test_grpo_matches_definition_on_random_groups(rng):
    seed = rng.randrange(2**31)
    r = random_rewards(seed)
    groups = torch.tensor([i // 5 for i in range(len(r))])
    got = grpo_advantages(torch.tensor(r, dtype=torch.float64), groups, eps=1e-6)
    for g in range(int(groups.max()) + 1):
        members = [r[i] for i in range(len(r)) if groups[i] == g]
        mean, std = statistics.fmean(members), statistics.stdev(members)
        for i in range(len(r)):
            if groups[i] == g:
                want = (r[i] - mean) / (std + 1e-6)
                assert got[i].item() == pytest.approx(want, abs=HAND), f"seed={seed}"


def random_rewards(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (20,), generator=gen).double().div(3).tolist()


def test_rloo_by_hand_and_definition(rng):
    got = rloo_advantages(REWARDS, GROUPS).tolist()
    # r=1 against the mean of the other three (0, 0, 1) = 1/3; r=0 against (1, 0, 1) = 2/3
    assert got == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0], abs=HAND)
    seed = rng.randrange(2**31)
    r = random_rewards(seed)
    groups = torch.tensor([i % 3 for i in range(len(r))])  # interleaved groups
    got = rloo_advantages(torch.tensor(r, dtype=torch.float64), groups)
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if groups[j] == groups[i] and j != i]
        want = r[i] - statistics.fmean(others)
        assert got[i].item() == pytest.approx(want, abs=HAND), f"seed={seed}"


def test_dynamic_sampling_drops_all_equal_groups():
    assert dynamic_sampling_mask(REWARDS, GROUPS).tolist() == [True] * 4 + [False] * 3
    r = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.5])
    assert dynamic_sampling_mask(r, torch.tensor([0, 0, 1, 1, 2, 2])).tolist() == [
        False, False, False, False, True, True
    ]  # fmt: skip


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 80, 90, 100, 101])
    got = overlong_penalty(lengths, max_length=100, buffer_length=20, penalty=1.0)
    # a subtraction, a division and a product in torch's default dtype: 3 fp32 roundings
    u32 = unit_roundoff(torch.float32)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0], rel=3 * u32, abs=0)


def gae_reference(rewards, values, gamma, lam):
    """Plain Python: δ_t = r_t + γ V_{t+1} - V_t, A_t = Σ_l (γλ)^l δ_{t+l}, V past the end = 0."""
    n = len(rewards)
    deltas = [
        rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)
    ]
    return [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]


def test_gae_by_hand():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], γ = 0.9, λ = 0.8
    # δ2 = 1 - 0.7 = 0.3; δ1 = 0 + 0.9·0.7 - 0.6 = 0.03; δ0 = 0 + 0.9·0.6 - 0.5 = 0.04
    # A2 = 0.3; A1 = 0.03 + 0.72·0.3 = 0.246; A0 = 0.04 + 0.72·0.246 = 0.21712
    out = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64),
        torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64),
        torch.ones(1, 3, dtype=torch.bool),
        gamma=0.9,
        lam=0.8,
    )
    assert out.advantages[0].tolist() == pytest.approx([0.21712, 0.246, 0.3], abs=HAND)
    assert out.returns[0].tolist() == pytest.approx([0.71712, 0.846, 1.0], abs=HAND)


def test_gae_skips_unmasked_steps_and_respects_packed_boundaries(rng):
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 4, 9]
    seqs = []
    for n in lengths:
        r = torch.randn(n, generator=gen, dtype=torch.float64)
        v = torch.randn(n, generator=gen, dtype=torch.float64)
        m = torch.rand(n, generator=gen) < 0.6
        m[-1] = True
        seqs.append((r, v, m))
    # packed into one row: sequence boundaries come from sequence_index
    rewards = torch.cat([s[0] for s in seqs])[None]
    values = torch.cat([s[1] for s in seqs])[None]
    mask = torch.cat([s[2] for s in seqs])[None]
    index = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    out = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9, sequence_index=index)
    start = 0
    for r, v, m in seqs:
        # the reference sees only the action steps, as if tool tokens were not there
        want = gae_reference(r[m].tolist(), v[m].tolist(), 0.95, 0.9)
        got = out.advantages[0, start : start + len(r)]
        # two float64 evaluations of ≤ 6 roundings per step over n steps, of values no larger
        # than Σ|r| + 2Σ|V|
        n = int(m.sum())
        scale = r[m].abs().sum().item() + 2 * v[m].abs().sum().item()
        bound = 2 * gamma(6 * n, U64) * scale
        assert got[m].tolist() == pytest.approx(want, abs=bound), f"seed={seed}"
        assert (got[~m] == 0).all(), f"seed={seed}"
        start += len(r)


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    r = torch.tensor([[0.0, 1.0, 0.0, 2.0]], dtype=torch.float64)
    v = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    out = gae_advantages(r, v, torch.ones(1, 4, dtype=torch.bool), gamma=1.0, lam=1.0)
    assert out.advantages[0].tolist() == pytest.approx([2.9, 2.8, 1.7, 1.6], abs=HAND)
    assert out.returns[0].tolist() == pytest.approx([3.0, 3.0, 2.0, 2.0], abs=HAND)


def test_terminal_rewards_land_on_last_masked_position():
    mask = torch.tensor([[False, True, True, False, True, True, False]])
    index = torch.tensor([[0, 0, 0, 0, 1, 1, -1]])
    out = terminal_rewards(torch.tensor([3.0, -1.0]), mask, index)
    assert out.tolist() == [[0.0, 0.0, 3.0, 0.0, 0.0, -1.0, 0.0]]


def test_masked_whiten(rng):
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 9, generator=gen, dtype=torch.float64) * 3 + 2
    mask = torch.rand(4, 9, generator=gen) < 0.7
    out = masked_whiten(x, mask)
    # mean, deviations, variance, the division, and the checks' own mean and std: each a sum
    # over n values of magnitude ≤ |x - mean| / std (≤ 16 here) in float64, γ of a few n
    n = int(mask.sum())
    bound = gamma(8 * n, U64) * 16
    assert out[mask].mean().item() == pytest.approx(0.0, abs=bound), f"seed={seed}"
    # and eps in the denominator: the std comes out as std / (std + eps)
    eps_effect = 1e-8 / x[mask].std().item()
    assert out[mask].std().item() == pytest.approx(1.0, abs=bound + eps_effect), f"seed={seed}"
    assert (out[~mask] == 0).all()


# --- advantage placement: an advantage lands exactly on the token that was sampled ---------


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).double().eval()


def trajectory(token_ids, sampled, logprobs):
    """``token_ids`` with the positions in ``sampled`` as model tokens (their ``logprobs[i]``),
    the others as tool tokens: one piece per run of equal mask values."""
    n, pieces, start = len(token_ids), [], 0
    for i in range(1, n + 1):
        if i == n or (i in sampled) != (start in sampled):
            pieces.append(("model" if start in sampled else "tool", token_ids[start:i], 0))
            start = i
    return trajectory_from_pieces(pieces, logprob=lambda i: logprobs[i], id="t")


def test_single_token_advantage_placement():
    """One sampled token x[k] with advantage +1 (and x[j] with -2): the loss gradient reaches the
    logprob of exactly those tokens, each computed from its own prefix."""
    model = tiny_model()
    ids = [5, 17, 33, 2, 40, 9, 11, 60, 2, 7, 30]
    k, j = 4, 8
    traj = trajectory(ids, {k, j}, {k: -3.0, j: -1.0})
    per_token = [0.0] * len(ids)
    per_token[k], per_token[j] = 1.0, -2.0
    (batch,) = pack_trajectories([traj], 64, pad_id=2, advantages=[per_token])
    positions = batch.loss_mask[0].nonzero().squeeze(1).tolist()
    assert positions == [k - 1, j - 1]
    assert batch.targets[0, k - 1].item() == ids[k] and batch.targets[0, j - 1].item() == ids[j]
    assert batch.advantages[0].nonzero().squeeze(1).tolist() == [k - 1, j - 1]
    assert batch.advantages[0, k - 1].item() == 1.0 and batch.advantages[0, j - 1].item() == -2.0

    scored = causal_lm_token_logprobs(model, batch, chunk_size=4)
    logprobs = scored.logprobs.detach().requires_grad_()
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        batch.advantages.double(),
        batch.loss_mask,
        surrogate="clip",
        agg="token-mean",
    )
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    assert grad[0].nonzero().squeeze(1).tolist() == [k - 1, j - 1]
    assert grad[0, k - 1].item() == pytest.approx(-1.0 / 2, abs=HAND)
    assert grad[0, j - 1].item() == pytest.approx(2.0 / 2, abs=HAND)
    for t in (k, j):  # the trainer's logprob of x[t] is the model's prediction from x[:t]

        def prefix(t=t) -> torch.Tensor:
            logits = model(input_ids=torch.tensor([ids[:t]])).logits[0, -1]
            return torch.log_softmax(logits, -1).detach()

        # two float64 evaluations (HF's RMSNorm in fp32 inside): each within the emulated error
        want, dev = emulated_rounding_error(prefix, emulate=torch.float64)
        bound = 2 * EMULATION_SAFETY * dev.max().item()
        assert scored.logprobs[0, t - 1].item() == pytest.approx(want[ids[t]].item(), abs=bound)
