"""``agentrl_varlen`` attention: packed sequences attend only to themselves without any mask,
with the same log-probs and gradients as the dense block-causal mask (and as padded rows); the
shared-prefix layout gives the same log-probs and gradients as plain packing."""

from __future__ import annotations

import pytest
import torch
from numerics import (
    EMULATION_SAFETY,
    assert_within,
    emulated_gradients,
    emulated_rounding_error,
    float64_transformers,
)
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


def _dense_logprob_bound(dense, batch) -> float:
    """How far an fp32 evaluation of ``batch``'s log-probs may be from exact: ``EMULATION_SAFETY``
    times their largest emulated fp32 deviation (the dense path in float64)."""
    model64 = float64_transformers(dense)
    _, deviation = emulated_rounding_error(
        lambda: causal_lm_token_logprobs(model64, batch).logprobs.detach()
    )
    return EMULATION_SAFETY * float(deviation.max())


def _grad_bounds(dense, batches) -> dict[str, torch.Tensor]:
    """Per element, how far an fp32 evaluation of ``_grads`` may be from exact
    (``numerics.emulated_gradients`` on the dense path in float64)."""
    model64 = float64_transformers(dense)
    names, params = zip(*model64.named_parameters(), strict=True)

    def loss() -> torch.Tensor:
        scores = [causal_lm_token_logprobs(model64, b).logprobs for b in batches]
        return sum(s.sum() / b.step_loss_tokens for s, b in zip(scores, batches, strict=True))

    _, deviations = emulated_gradients(loss, list(params))
    return {n: EMULATION_SAFETY * d.max() for n, d in zip(names, deviations, strict=True)}


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
    # two fp32 evaluations (dense mask, varlen): each within its bound of exact
    for b in packed:
        want = causal_lm_token_logprobs(dense, b).logprobs
        got = _varlen_logprobs(varlen, b)
        assert_within(got, want, 2 * _dense_logprob_bound(dense, b), f"seed={seed}")
    g_dense = _grads(dense, packed, lambda m, b: causal_lm_token_logprobs(m, b).logprobs)
    g_varlen = _grads(varlen, packed, _varlen_logprobs)
    bounds = _grad_bounds(dense, packed)
    for name, grad in g_dense.items():
        assert_within(g_varlen[name], grad, 2 * bounds[name], f"{name}; seed={seed}")


def test_padded_rows_need_no_mask(models, make_groups, rng):
    """Right padding with causal attention: real positions never see the padding after them."""
    seed = rng.randrange(2**31)
    dense, varlen = models
    for b in pad_trajectories(make_groups(seed), 64, pad_id=2):
        want = causal_lm_token_logprobs(dense, b).logprobs
        bound = 2 * _dense_logprob_bound(dense, b)
        assert_within(_varlen_logprobs(varlen, b), want, bound, f"seed={seed}")


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
    dense, varlen = models
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
    bound = 2 * max(_dense_logprob_bound(dense, b) for b in plain)
    for i in want:
        assert_within(got[i], want[i], bound, f"trajectory {i}; seed={seed}")
    g_plain = _grads(varlen, plain, _varlen_logprobs)
    g_shared = _grads(varlen, shared, _varlen_logprobs)
    bounds = _grad_bounds(dense, plain)
    for name, grad in g_plain.items():
        assert_within(g_shared[name], grad, 2 * bounds[name], f"{name}; seed={seed}")
