"""fused_policy_loss: the one-pass Triton loss against the per-token float64 reference and the
trainer's torch path (``agentrl.trainer.policy_loss``), loss, metrics and gradients."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES, needs_triton

from agentrl.kernels import fused_policy_loss, reference
from agentrl.trainer import policy_loss

SURROGATES = ["clip", "gspo", "cispo"]
AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _case(gen, n, device, *, seqs=5, spread=0.3):
    lengths = torch.randint(1, 2 * n // seqs, (seqs * 2,), generator=gen)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:n]
    seq = torch.cat([seq, torch.full((n - len(seq),), len(lengths) - 1)])
    data = {
        "logprobs": -torch.rand(n, generator=gen) * 4,
        "old_delta": torch.randn(n, generator=gen) * spread,
        "advantages": torch.randn(n, generator=gen),
        "mask": torch.rand(n, generator=gen) > 0.2,
        "ref_delta": torch.randn(n, generator=gen) * 0.2,
        "rollout_delta": torch.randn(n, generator=gen) * 0.3,
        "entropy": torch.rand(n, generator=gen) * 2,
    }
    mask = data["mask"]
    mask[seq == 1] = False  # a sequence with no loss token at all
    lp = data["logprobs"].to(device, copy=True).requires_grad_()
    ent = data["entropy"].to(device, copy=True).requires_grad_()
    old = (data["logprobs"] + data["old_delta"]).to(device)
    return {
        "logprobs": lp,
        "old_logprobs": old,
        "advantages": data["advantages"].to(device),
        "mask": mask.to(device),
        "sequence_index": seq.to(device),
        "ref_logprobs": (data["logprobs"] + data["ref_delta"]).to(device),
        "rollout_logprobs": old + data["rollout_delta"].to(device),
        "entropy": ent,
    }


def _grads(loss, case):
    lp, ent = case["logprobs"], case["entropy"]
    g_lp, g_ent = torch.autograd.grad(loss, [lp, ent], allow_unused=True)
    return g_lp, (g_ent if g_ent is not None else torch.zeros_like(ent))


def _options(surrogate, agg, kl, tis, entropy_coef):
    clip_low = {"clip": 0.2, "gspo": 3e-3, "cispo": 1.0}[surrogate]
    return {
        "surrogate": surrogate,
        "clip_low": clip_low,
        "clip_high": 0.28 if surrogate != "gspo" else 4e-3,
        "agg": agg,
        "norm_length": 50.0,
        "kl_coef": 0.05 if kl else 0.0,
        "kl_estimator": kl or "k3",
        "entropy_coef": entropy_coef,
        "tis_cap": 2.0 if tis else None,
    }


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("surrogate", SURROGATES)
@pytest.mark.parametrize("agg", AGGS)
def test_three_way_every_surrogate_and_aggregation(gen, device, surrogate, agg):
    n = 157 if device == "cpu" else 100_003
    case = _case(gen, n, device)
    kl = ["k1", "k2", "k3"][AGGS.index(agg) % 3]
    opts = _options(surrogate, agg, kl, tis=AGGS.index(agg) % 2 == 0, entropy_coef=0.01)
    inputs = {k: v for k, v in case.items() if k != "ref_logprobs" or kl}
    got, stats = fused_policy_loss(**inputs, **{k: v for k, v in opts.items()})
    torch_out = policy_loss(**inputs, **opts, kernels="torch")
    g_kernel, g_torch = _grads(got, case), _grads(torch_out.loss, case)
    assert abs(got.item() - torch_out.loss.item()) < 1e-5 * max(1.0, abs(got.item()))
    for a, b in zip(g_kernel, g_torch, strict=True):
        assert (a - b).abs().max() < 1e-6 + 1e-5 * b.abs().max()
    for name, value in torch_out.metrics._asdict().items():
        assert abs(float(getattr(stats, name)) - float(value)) < 1e-5 * max(1.0, abs(value)), name
    if device == "cpu":  # the per-token float64 reference loops in Python: small n only
        ref_loss, ref_metrics = reference.policy_loss(**inputs, **opts)
        (g_ref,) = torch.autograd.grad(ref_loss, [case["logprobs"]])
        assert abs(got.item() - ref_loss.item()) < 1e-5 * max(1.0, abs(ref_loss.item()))
        assert (g_kernel[0].double() - g_ref).abs().max() < 1e-6 + 1e-5 * g_ref.abs().max()
        for name, value in ref_metrics.items():
            assert abs(float(getattr(stats, name)) - value) < 1e-5 * max(1.0, abs(value)), name


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_inputs(gen, device):
    """Logprobs in bf16 (the working dtype on a GPU): the kernel computes in fp32 from the same
    bf16 values, so it matches the float64 reference of those values closely."""
    case = _case(gen, 97, device)
    case["logprobs"] = case["logprobs"].detach().bfloat16().requires_grad_()
    opts = _options("clip", "token-mean", "k3", tis=False, entropy_coef=0.0)
    got, _ = fused_policy_loss(**case, **opts)
    ref, _ = reference.policy_loss(**{k: v.cpu() for k, v in case.items()}, **opts)
    assert abs(got.item() - ref.item()) < 1e-3 * max(1.0, abs(ref.item()))
    (g,) = torch.autograd.grad(got, [case["logprobs"]])
    assert g.dtype == torch.bfloat16


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_extreme_ratios_and_nan_in_masked_positions(gen, device):
    """Log ratios beyond ±20 are clamped (no inf, no gradient through the clamp), and NaN in
    positions outside the mask never reaches the loss or the gradient."""
    case = _case(gen, 64, device, spread=40.0)
    with torch.no_grad():
        off = ~case["mask"]
        case["old_logprobs"][off] = float("nan")
        case["advantages"][off] = float("nan")
    for surrogate in ("clip", "cispo", "gspo"):
        opts = _options(surrogate, "token-mean", "k2", tis=True, entropy_coef=0.0)
        got, stats = fused_policy_loss(**case, **opts)
        want = policy_loss(**case, **opts, kernels="torch")
        assert torch.isfinite(got) and abs(got.item() - want.loss.item()) < 1e-4 * max(
            1.0, abs(want.loss.item())
        )
        g, _ = _grads(got, case)
        gw, _ = _grads(want.loss, case)
        assert torch.isfinite(g).all() and (g[off] == 0).all()
        assert (g - gw).abs().max() <= 1e-5 * max(1.0, gw.abs().max().item())
        assert float(stats.ratio_max) <= float(torch.exp(torch.tensor(20.0))) * 1.0001


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_nothing_to_train_on(gen, device):
    case = _case(gen, 33, device)
    case["mask"] = torch.zeros_like(case["mask"])
    got, stats = fused_policy_loss(**case, **_options("clip", "seq-mean-token-mean", "k3", 0, 0))
    assert got.item() == 0.0 and stats.num_tokens.item() == 0
    assert stats.ratio_mean.item() == stats.ratio_min.item() == stats.ratio_max.item() == 1.0
    g, _ = _grads(got, case)
    assert (g == 0).all()


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_denominator_splits_a_batch_into_micro_batches(gen, device):
    """With the step's token count as denominator, micro-batch losses sum to the full loss."""
    case = _case(gen, 120, device)
    opts = _options("clip", "token-mean", "k1", tis=False, entropy_coef=0.0)
    full, _ = fused_policy_loss(**case, **opts)
    tokens = case["mask"].sum().item()
    parts = 0.0
    for sl in (slice(0, 50), slice(50, 120)):
        part = {k: v[sl] for k, v in case.items()}
        loss, _ = fused_policy_loss(**part, **opts, denominator=float(tokens))
        parts += loss.item()
    assert abs(parts - full.item()) < 1e-5


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"surrogate": "ppg"}, "unknown surrogate 'ppg'"),
        ({"agg": "seq-sum"}, "unknown aggregation 'seq-sum'"),
        ({"kl_estimator": "k4"}, "unknown KL estimator 'k4'"),
        ({"tis_cap": 2.0}, "tis_cap needs rollout_logprobs"),
        ({"advantages": torch.zeros(4)}, "advantages has shape"),
    ],
)
def test_bad_arguments_are_named(change, match):
    args = {
        "logprobs": torch.zeros(3),
        "old_logprobs": torch.zeros(3),
        "advantages": torch.zeros(3),
        "mask": torch.ones(3, dtype=torch.bool),
    }
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fused_policy_loss(**args)


def test_trainer_dispatch(gen, monkeypatch):
    """``kernels='auto'`` on CPU keeps the torch path; ``kernels='triton'`` runs the kernel."""
    import agentrl.trainer._losses as losses

    calls = []
    real = losses.fused_policy_loss
    monkeypatch.setattr(
        losses, "fused_policy_loss", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    case = _case(gen, 40, "cpu")
    policy_loss(**{k: case[k] for k in ("logprobs", "old_logprobs", "advantages", "mask")})
    assert calls == []
    if losses.use_triton.__module__ and pytest.importorskip("triton"):
        from agentrl.kernels import interpreting

        if interpreting():
            out = policy_loss(
                **{k: case[k] for k in ("logprobs", "old_logprobs", "advantages", "mask")},
                kernels="triton",
            )
            assert calls == [1] and torch.isfinite(out.loss)
