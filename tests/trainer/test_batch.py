"""Trajectories → micro-batches: alignment, packing, padding, masks, and the model forward
(packed logits == per-sequence logits; packed loss and gradients == padded ones)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from numerics import (
    EMULATION_SAFETY,
    LAMBDA,
    assert_within,
    emulated_gradients,
    emulated_rounding_error,
    emulated_std,
    unit_roundoff,
)
from trajectories import trajectory_from_pieces

from agentrl.trainer import (
    block_causal_mask,
    causal_lm_token_logprobs,
    model_inputs,
    overlong_filter,
    pack_trajectories,
    pad_trajectories,
    policy_loss,
    turn_advantages,
)

EOS = 2  # SmolLM2: pad id == EOS id


def make_trajectory(gen, turns, *, name="t", vocab=64, reason="stop"):
    """prompt, then per turn: model tokens ending in EOS, a template newline, a tool reply."""
    rand = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()  # noqa: E731
    pieces = [("prompt", [1, *rand(int(torch.randint(2, 6, (1,), generator=gen)))], 0)]
    for turn in range(turns):
        pieces.append(("model", [*rand(int(torch.randint(1, 6, (1,), generator=gen))), EOS], turn))
        pieces.append(("template", [EOS + 7], turn))
        if turn + 1 < turns:
            pieces.append(("tool", [1, *rand(3), EOS, 9, 1, 11, 9], turn))
    return trajectory_from_pieces(
        pieces,
        logprob=lambda i: -3 * torch.rand(1, generator=gen).item(),
        id=name,
        policy_version=3,
        termination_reason=reason,
    )


u32 = unit_roundoff(torch.float32)


def make_batch_trajs(seed, count=7):
    gen = torch.Generator().manual_seed(seed)
    return [
        make_trajectory(gen, int(torch.randint(1, 4, (1,), generator=gen)), name=f"t{i}")
        for i in range(count)
    ]


def test_alignment_every_field_follows_the_docstring(rng):
    seed = rng.randrange(2**31)
    trajs = make_batch_trajs(seed)
    advantages = [float(i) - 3.0 for i in range(len(trajs))]
    for layout in (pack_trajectories, pad_trajectories):
        for batch in layout(trajs, 80, pad_id=EOS, advantages=advantages):
            for s, positions in enumerate(batch.split_sequences(batch.input_ids)):
                i = int(batch.trajectory_index[s])
                x, m, lp = trajs[i].token_ids, trajs[i].loss_mask, trajs[i].logprobs
                last = max(k for k in range(len(x)) if m[k])
                assert len(positions) == last, f"seed={seed}"
                r, start = int(batch.sequence_row[s]), int(batch.sequence_start[s])
                for p in range(last):
                    at = (r, start + p)
                    assert batch.input_ids[at] == x[p], f"seed={seed}"
                    assert batch.position_ids[at] == p
                    assert batch.targets[at] == x[p + 1], f"seed={seed}"
                    assert batch.loss_mask[at] == bool(m[p + 1]), f"seed={seed}"
                    want_lp = lp[p + 1] if m[p + 1] else 0.0
                    # stored in fp32: one rounding of the float64 value
                    got_lp = batch.rollout_logprobs[at].item()
                    assert_within(got_lp, want_lp, u32 * abs(want_lp), f"seed={seed}")
                    assert batch.advantages[at] == (advantages[i] if m[p + 1] else 0.0)
                    assert batch.sequence_index[at] == s and batch.attention_mask[at]


def test_packing_has_no_padding_and_respects_the_budget(rng):
    seed = rng.randrange(2**31)
    trajs = make_batch_trajs(seed, count=12)
    budget = 60
    batches = pack_trajectories(trajs, budget, pad_id=EOS)
    seen = sorted(int(i) for b in batches for i in b.trajectory_index)
    assert seen == list(range(12)), f"every trajectory exactly once; seed={seed}"
    for b in batches:
        assert b.packed and b.input_ids.shape[0] == 1
        assert b.input_ids.shape[1] == b.num_tokens <= budget, f"seed={seed}"
        assert (b.sequence_index >= 0).all() and b.attention_mask.all()
        assert b.cu_seqlens.tolist() == [0, *torch.cumsum(b.sequence_lengths, 0).tolist()]
        # positions restart at each sequence start
        starts = b.position_ids[0] == 0
        assert starts.nonzero().squeeze(1).tolist() == b.cu_seqlens[:-1].tolist()
    total = sum(b.loss_mask.sum().item() for b in batches)
    assert all(b.step_loss_tokens == total and b.step_sequences == 12 for b in batches)
    # first-fit decreasing: no two bins could have been merged
    sizes = sorted(b.num_tokens for b in batches)
    assert len(sizes) < 2 or sizes[0] + sizes[1] > budget, f"seed={seed}"
    again = pack_trajectories(trajs, budget, pad_id=EOS)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again, strict=True))


def test_padded_layout_never_infers_lengths_from_pad_ids(rng):
    seed = rng.randrange(2**31)
    # a two-turn trajectory always has EOS among its inputs (the first turn ends with it; a
    # sequence's inputs stop before its last sampled token, so one turn alone may have none)
    trajs = [*make_batch_trajs(seed, count=4), make_trajectory(torch.Generator(), 2, name="two")]
    batches = pad_trajectories(trajs, 200, pad_id=EOS)
    real_eos = 0
    for b in batches:
        assert not b.packed
        assert b.input_ids.shape[0] * b.input_ids.shape[1] <= 200
        for s in range(b.num_sequences):
            row, n = int(b.sequence_row[s]), int(b.sequence_lengths[s])
            assert b.attention_mask[row].sum() == n and b.attention_mask[row, :n].all()
            assert (b.input_ids[row, n:] == EOS).all() and (b.sequence_index[row, n:] == -1).all()
            assert not b.loss_mask[row, n:].any() and (b.advantages[row, n:] == 0).all()
            assert b.input_ids[row, :n].tolist() == trajs[int(b.trajectory_index[s])].token_ids[:n]
        real_eos += int(((b.input_ids == EOS) & b.attention_mask).sum())
    # EOS inside real sequences counts as real: the mask, not the id, decides the length
    want = 0
    for t in trajs:
        last = max(k for k, m in enumerate(t.loss_mask) if m)
        want += t.token_ids[:last].count(EOS)
    assert real_eos == want > 0, f"seed={seed}"
    with pytest.raises(ValueError, match="cu_seqlens"):
        batches[0].cu_seqlens  # noqa: B018


def test_algorithm_mask_is_combined_and_never_rewrites_the_trajectory(rng):
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    keep = make_trajectory(gen, 2, name="keep")
    cut = make_trajectory(gen, 2, name="cut", reason="max_tokens")
    partial = make_trajectory(gen, 3, name="partial")
    before = [msgspec.json.encode(t) for t in (keep, cut, partial)]
    # per-token algorithm mask on `partial`: drop its first model turn only
    first_model = next(s for s in partial.spans if s.source == "model")
    per_token = [0.0 if first_model.start <= i < first_model.end else 1.0 for i in range(
        len(partial.token_ids))]  # fmt: skip
    overlong = overlong_filter([keep, cut, partial])
    assert overlong == [1.0, 0.0, 1.0]
    alg = [overlong[0], overlong[1], per_token]
    (batch,) = pack_trajectories([keep, cut, partial], 500, pad_id=EOS, algorithm_mask=alg)
    assert batch.trajectory_index.tolist() == [2, 0]  # `cut` has nothing left to train on
    sequences = dict(zip(batch.trajectory_index.tolist(), batch.split_sequences(batch.loss_mask),
                         strict=True))  # fmt: skip
    want = [bool(m) and a == 1.0 for m, a in zip(partial.loss_mask, per_token, strict=True)]
    assert sequences[2].tolist() == want[1 : len(sequences[2]) + 1]
    assert sequences[0].sum() == sum(keep.loss_mask)
    assert batch.step_sequences == 2
    assert [msgspec.json.encode(t) for t in (keep, cut, partial)] == before


def test_refuses_inconsistent_input(rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    traj = make_trajectory(gen, 2)
    with pytest.raises(ValueError, match="exceed max_tokens_per_micro_batch"):
        pack_trajectories([traj], 3, pad_id=EOS)
    bad = msgspec.structs.replace(traj, loss_mask=[1, *traj.loss_mask[1:]])
    with pytest.raises(ValueError, match="token 0"):
        pad_trajectories([bad], 500, pad_id=EOS)
    k = traj.loss_mask.index(1)
    bad = msgspec.structs.replace(
        traj, logprobs=[*traj.logprobs[:k], None, *traj.logprobs[k + 1 :]]
    )
    with pytest.raises(ValueError, match="no logprob"):
        pack_trajectories([bad], 500, pad_id=EOS)
    with pytest.raises(ValueError, match="advantages has 3 entries"):
        pack_trajectories([traj], 500, pad_id=EOS, advantages=[[0.0, 1.0, 2.0]])
    with pytest.raises(ValueError, match="lengths differ"):
        pack_trajectories([msgspec.structs.replace(traj, loss_mask=[0])], 500, pad_id=EOS)


def test_turn_advantages_follow_spans(rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    traj = make_trajectory(gen, 3)
    per_token = turn_advantages(traj, [0.5, -1.0, 2.0])
    for span in traj.spans:
        values = per_token[span.start : span.end]
        want = [0.5, -1.0, 2.0][span.turn] if span.source == "model" else 0.0
        assert values == [want] * len(values)
    with pytest.raises(ValueError, match="turn 2"):
        turn_advantages(traj, [0.5, -1.0])


def test_block_causal_mask_against_its_definition(rng):
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    index = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, -1, -1, -1]])
    index = index[torch.randperm(2, generator=gen)]
    allowed = block_causal_mask(index, dtype=torch.bool)
    additive = block_causal_mask(index, dtype=torch.float32)
    assert allowed.shape == additive.shape == (2, 1, 10, 10)
    for b in range(2):
        for q in range(10):
            for k in range(10):
                real = index[b, q] >= 0
                want = (k <= q and index[b, q] == index[b, k]) if real else k == q
                assert bool(allowed[b, 0, q, k]) == want, f"{b} {q} {k} seed={seed}"
                assert additive[b, 0, q, k].item() == (0.0 if want else torch.finfo().min)


def tiny_model(attn_implementation="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config).double().eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_and_padded_forward_equal_per_sequence_forward(rng, attn):
    seed = rng.randrange(2**31)
    trajs = make_batch_trajs(seed, count=5)
    model = tiny_model(attn)
    # a float64 model, but HF's RMSNorm (and eager attention's softmax) run in fp32: two
    # evaluations each within the error emulated with every op at its own dtype
    bounds: dict[tuple[int, ...], float] = {}
    for layout in (pack_trajectories, pad_trajectories):
        for batch in layout(trajs, 120, pad_id=EOS):
            logits = model(**model_inputs(batch, dtype=torch.float64)).logits
            for s, got in enumerate(batch.split_sequences(logits)):
                ids = batch.split_sequences(batch.input_ids)[s]
                want = model(input_ids=ids[None]).logits[0]
                key = tuple(ids.tolist())
                if key not in bounds:
                    _, dev = emulated_rounding_error(
                        lambda ids=ids: model(input_ids=ids[None]).logits[0].detach(),
                        emulate=torch.float64,
                    )
                    bounds[key] = 2 * EMULATION_SAFETY * float(dev.max())
                assert_within(got, want, bounds[key], f"{layout.__name__} seed={seed}")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_and_padded_loss_and_gradients_equal(rng, agg):
    """One optimizer step's worth of micro-batches: Σ micro-batch losses (step denominators)
    and the accumulated parameter gradients agree between the two layouts."""
    seed = rng.randrange(2**31)
    trajs = make_batch_trajs(seed, count=6)
    advantages = torch.randn(6, generator=torch.Generator().manual_seed(seed)).tolist()
    model = tiny_model()
    results = []

    def step_loss(layout) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for batch in layout(trajs, 70, pad_id=EOS, advantages=advantages):
            scored = causal_lm_token_logprobs(model, batch, chunk_size=16)
            out = policy_loss(
                scored.logprobs,
                batch.rollout_logprobs,
                batch.advantages,
                batch.loss_mask,
                surrogate="clip",
                clip_low=0.2,
                clip_high=0.28,
                agg=agg,
                sequence_index=batch.sequence_index,
                denominator=batch.step_loss_tokens if agg == "token-mean" else batch.step_sequences,
                entropy=scored.entropy,
                entropy_coef=0.01,
            )
            total = total + out.loss
        return total

    for layout in (pack_trajectories, pad_trajectories):
        model.zero_grad()
        loss = step_loss(layout)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (packed_loss, packed_grads), (padded_loss, padded_grads) = results
    # two float64 evaluations (HF's RMSNorm in fp32 inside), each within the emulated error
    names, params = zip(*model.named_parameters(), strict=True)
    _, loss_std = emulated_std(lambda: step_loss(pad_trajectories).detach(), emulate=torch.float64)
    _, deviations = emulated_gradients(
        lambda: step_loss(pad_trajectories), list(params), emulate=torch.float64
    )
    assert_within(packed_loss, padded_loss, 2 * LAMBDA * loss_std, f"loss seed={seed}")
    for name, dev in zip(names, deviations, strict=True):
        bound = 2 * EMULATION_SAFETY * dev.max()
        assert_within(packed_grads[name], padded_grads[name], bound, f"{name} seed={seed}")
    assert any(g.abs().sum() > 0 for g in packed_grads.values())


def test_gradient_on_tool_and_template_positions_is_exactly_zero(rng):
    """Autograd hook on the final hidden states: positions whose target is a prompt, tool or
    template token get exactly zero gradient, even when their logprobs are computed."""
    seed = rng.randrange(2**31)
    trajs = make_batch_trajs(seed, count=3)
    model = tiny_model()
    (batch,) = pack_trajectories(trajs, 500, pad_id=EOS, advantages=[1.0, -0.5, 2.0])
    captured = []

    def capture(_module, _inputs, hidden):
        hidden.register_hook(captured.append)  # returns None: the output is left as it is

    handle = model.get_decoder().norm.register_forward_hook(capture)
    try:
        scored = causal_lm_token_logprobs(model, batch, only_loss_tokens=False)
        assert (scored.logprobs[~batch.loss_mask] != 0).any()  # computed, so the mask must act
        out = policy_loss(
            scored.logprobs,
            batch.rollout_logprobs,
            batch.advantages,
            batch.loss_mask,
            surrogate="clip",
            agg="seq-mean-token-mean",
            sequence_index=batch.sequence_index,
            ref_logprobs=scored.logprobs.detach() - 0.1,
            kl_coef=0.1,
            entropy=scored.entropy,
            entropy_coef=0.01,
        )
        out.loss.backward()
    finally:
        handle.remove()
    (grad,) = captured
    per_position = grad[0].abs().sum(-1)
    assert (per_position[~batch.loss_mask[0]] == 0).all(), f"seed={seed}"
    assert (per_position[batch.loss_mask[0]] > 0).all(), f"seed={seed}"
