"""``agentrl_varlen`` attention: packed sequences attend only to themselves without any mask,
with the same log-probs and gradients as the dense block-causal mask (and as padded rows); the
shared-prefix layout gives the same log-probs and gradients as plain packing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.trainer import (
    causal_lm_token_logprobs,
    pack_shared_prefix,
    pack_trajectories,
    pad_trajectories,
    token_logprobs_and_entropy,
)
from agentrl.trainer._attention import use_varlen_attention, varlen_kwargs


@pytest.fixture(scope="module")
def models(tiny_model_path):
    dense = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    varlen = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    use_varlen_attention(varlen)
    return dense, varlen


def _varlen_logprobs(model, batch):
    extra = varlen_kwargs(*batch.attention_segments) if batch.packed else {}
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **extra
    ).last_hidden_state
    b, t, h = hidden.shape
    out = token_logprobs_and_entropy(
        hidden.reshape(b * t, h),
        model.lm_head.weight,
        batch.targets.reshape(-1),
        mask=batch.loss_mask.reshape(-1),
    )
    return out.logprobs.view(b, t)


def _grads(model, batches, score) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for b in batches:
        (score(model, b).sum() / b.step_loss_tokens).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_varlen_equals_the_dense_block_mask(models, make_groups, rng):
    seed = rng.randrange(2**31)
    dense, varlen = models
    trajs = make_groups(seed, groups=3, size=3)
    packed = pack_trajectories(trajs, 48, pad_id=2)
    assert any(b.num_sequences > 1 for b in packed), f"nothing was packed; seed={seed}"
    for b in packed:
        want = causal_lm_token_logprobs(dense, b).logprobs
        got = _varlen_logprobs(varlen, b)
        assert (got - want).abs().max() < 1e-5, f"seed={seed}"
    g_dense = _grads(dense, packed, lambda m, b: causal_lm_token_logprobs(m, b).logprobs)
    g_varlen = _grads(varlen, packed, _varlen_logprobs)
    for name, grad in g_dense.items():
        assert torch.allclose(g_varlen[name], grad, atol=1e-6, rtol=1e-4), f"{name}; seed={seed}"


def test_padded_rows_need_no_mask(models, make_groups, rng):
    """Right padding with causal attention: real positions never see the padding after them."""
    seed = rng.randrange(2**31)
    dense, varlen = models
    for b in pad_trajectories(make_groups(seed), 64, pad_id=2):
        want = causal_lm_token_logprobs(dense, b).logprobs
        assert (_varlen_logprobs(varlen, b) - want).abs().max() < 1e-5, f"seed={seed}"


def _loss_logprobs(batches, scores) -> dict[int, list[float]]:
    """Per trajectory, its loss positions' log-probs in order."""
    out: dict[int, list[float]] = {}
    for b, lp in zip(batches, scores, strict=True):
        for s, (values, keep) in enumerate(
            zip(b.split_sequences(lp), b.split_sequences(b.loss_mask), strict=True)
        ):
            out[int(b.trajectory_index[s])] = values[keep].tolist()
    return out


def test_shared_prefix_equals_plain_packing(models, make_groups, rng):
    """Each group's prompt once per micro-batch: the same log-probs and gradients as plain
    packing, with fewer positions computed."""
    seed = rng.randrange(2**31)
    _, varlen = models
    trajs = make_groups(seed, groups=3, size=4, shared_prompt=True)
    plain = pack_trajectories(trajs, 96, pad_id=2)
    shared = pack_shared_prefix(trajs, 96, pad_id=2)
    assert sum(b.input_ids.numel() for b in shared) < sum(b.input_ids.numel() for b in plain)
    assert all(b.segment_parents is not None and (b.segment_parents >= 0).any() for b in shared)
    assert (shared[0].step_loss_tokens, shared[0].step_sequences) == (
        plain[0].step_loss_tokens,
        plain[0].step_sequences,
    )
    with torch.no_grad():
        want = _loss_logprobs(plain, [_varlen_logprobs(varlen, b) for b in plain])
        got = _loss_logprobs(shared, [_varlen_logprobs(varlen, b) for b in shared])
    assert want.keys() == got.keys() == set(range(len(trajs)))
    for i in want:
        assert got[i] == pytest.approx(want[i], abs=1e-5), f"trajectory {i}; seed={seed}"
    g_plain = _grads(varlen, plain, _varlen_logprobs)
    g_shared = _grads(varlen, shared, _varlen_logprobs)
    for name, grad in g_plain.items():
        assert torch.allclose(g_shared[name], grad, atol=1e-6, rtol=1e-4), f"{name}; seed={seed}"
