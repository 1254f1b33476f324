"""fused_policy_loss: the one-pass Triton loss against the per-token float64 reference and the
trainer's torch path (``agentrl.trainer.policy_loss``), loss, metrics and gradients."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from kernel_devices import DEVICES, needs_triton
from numerics import LAMBDA, assert_within, emulated_std, unit_roundoff

from agentrl.kernels import fused_policy_loss, reference
from agentrl.trainer import LossMetrics, aggregate, policy_loss

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


class _Emulated(NamedTuple):
    """The trainer's torch path in float64 on the same values (``want``) and ``LAMBDA`` times
    each output's emulated fp32 rounding deviation (``bound``: how far an fp32 evaluation, the
    kernel's or the torch path's, may be from ``want``; ``numerics.emulated_std``)."""

    want: dict[str, torch.Tensor]
    bound: dict[str, torch.Tensor]


def _float64(inputs: dict) -> dict:
    """float64 CPU copies; logprobs and entropy as leaves that take gradients."""
    out = {k: v.detach().cpu() for k, v in inputs.items()}
    out = {k: v.double() if v.is_floating_point() else v for k, v in out.items()}
    for k in ("logprobs", "entropy"):
        if k in out:
            out[k].requires_grad_()
    return out


def _emulated(inputs: dict, opts: dict) -> _Emulated:
    c64 = _float64(inputs)
    leaves = [c64[k] for k in ("logprobs", "entropy") if k in c64]

    def outputs() -> torch.Tensor:
        out = policy_loss(**c64, **opts, kernels="torch")
        grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
        grads = [
            torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)
        ]
        metrics = torch.stack([m.double() for m in out.metrics])
        return torch.cat([out.loss.reshape(1), metrics, *grads])

    want, std = emulated_std(outputs)
    fields = LossMetrics._fields
    names = ["loss", *fields, "grad_logprobs", "grad_entropy"][: 1 + len(fields) + len(leaves)]
    sizes = [1] * (1 + len(LossMetrics._fields)) + [leaves[0].numel()] * len(leaves)

    def split(x: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = dict(zip(names, x.split(sizes), strict=True))
        return {k: v if k.startswith("grad") else v.squeeze(0) for k, v in parts.items()}

    return _Emulated(split(want), split(LAMBDA * std))


def _assert_fp32(e: _Emulated, loss, metrics: dict, grads, what: str, extra=None) -> None:
    """One fp32 evaluation (loss, metrics by name, (grad logprobs, grad entropy)) within bound,
    plus ``extra[name]`` where that evaluation computes a quantity less accurately than the
    torch path the bound emulates (``_kernel_cancellation``)."""
    extra = extra or {}
    assert_within(loss, e.want["loss"], e.bound["loss"] + extra.get("loss", 0.0), f"{what} loss")
    for name, value in metrics.items():
        bound = e.bound[name] + extra.get(name, 0.0)
        assert_within(float(value), e.want[name], bound, f"{what} {name}")
    for name, g in zip(("grad_logprobs", "grad_entropy"), grads, strict=False):
        if name in e.want:
            assert_within(g, e.want[name], e.bound[name], f"{what} {name}")


def _kernel_cancellation(inputs: dict, opts: dict) -> dict[str, torch.Tensor]:
    """What the kernel adds to the torch path's rounding: for ``|x| ≥ 1e-3`` it computes
    ``approx_kl``'s ``e^x - 1 - x`` and the k3 estimator's ``(r - 1) - log r`` as ``exp(x) -
    1 - x``, whose rounding (exp's ~2u of ``e^x``, the subtractions' u each) is absolute, ``≤
    4u (e^x + 1)`` per token, where the torch path's ``expm1(x) - x`` errs relative to the
    (small) result. Aggregated like the metric (``approx_kl``: a mean) or the loss (k3)."""
    u = unit_roundoff(torch.float32)
    c64 = {k: v.detach().cpu().double() for k, v in inputs.items() if v.is_floating_point()}
    keep = inputs["mask"].cpu().bool()
    lr = (c64["logprobs"] - c64["old_logprobs"]).clamp(-20, 20).abs()
    if opts["surrogate"] == "gspo":  # a sequence's mean log ratio is no larger than its largest
        lr = torch.where(keep, lr, 0.0).max().expand_as(lr)
    per_token = torch.where(keep, 4 * u * (lr.exp() + 1), 0.0)
    extra = {"approx_kl": per_token.sum() / keep.sum().clamp(min=1)}
    if opts.get("kl_estimator") == "k3" and "ref_logprobs" in c64:
        r = (c64["ref_logprobs"] - c64["logprobs"]).exp()
        agg = {k: opts[k] for k in ("agg", "norm_length", "denominator") if k in opts}
        index = inputs["sequence_index"].cpu()
        kl = aggregate(torch.where(keep, 4 * u * (r + 1), 0.0), keep, sequence_index=index, **agg)
        extra |= {"kl_loss": kl, "loss": opts["kl_coef"] * kl}
    return extra


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
        "clip_ratio_c": 3.0 if surrogate == "clip" else None,
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
    e = _emulated(inputs, opts)
    extra = _kernel_cancellation(inputs, opts)
    _assert_fp32(e, got, stats._asdict(), _grads(got, case), "kernel", extra)
    torch_metrics = torch_out.metrics._asdict()
    _assert_fp32(e, torch_out.loss, torch_metrics, _grads(torch_out.loss, case), "torch")
    if device == "cpu":  # the per-token float64 reference loops in Python: small n only
        # float64 against float64: the fp32 bound scaled to float64's unit roundoff, twice
        to64 = 2 * unit_roundoff(torch.float64) / unit_roundoff(torch.float32)
        ref_inputs = _float64(inputs)
        ref_loss, ref_metrics = reference.policy_loss(**ref_inputs, **opts)
        (g_ref,) = torch.autograd.grad(ref_loss, [ref_inputs["logprobs"]])
        assert_within(ref_loss, e.want["loss"], to64 * e.bound["loss"], "reference loss")
        assert_within(g_ref, e.want["grad_logprobs"], to64 * e.bound["grad_logprobs"], "grad")
        for name, value in ref_metrics.items():
            bound = to64 * e.bound[name]
            if name.endswith("fraction") or name.startswith("clip_fraction"):
                bound = bound + unit_roundoff(torch.float32) * value  # count / count: fp32
            assert_within(value, e.want[name], bound, f"reference {name}")


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
    e = _emulated(case, opts)  # fp32 arithmetic on the bf16 values
    extra = _kernel_cancellation(case, opts)["loss"]
    assert_within(got, e.want["loss"], e.bound["loss"] + extra, "kernel loss")
    assert_within(ref, e.want["loss"], e.bound["loss"], "reference loss")
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
    for surrogate, kl in (("clip", "k2"), ("cispo", "k3"), ("gspo", "k1")):
        opts = _options(surrogate, "token-mean", kl, tis=True, entropy_coef=0.0)
        got, stats = fused_policy_loss(**case, **opts)
        want = policy_loss(**case, **opts, kernels="torch")
        assert torch.isfinite(got)
        g, _ = _grads(got, case)
        gw, _ = _grads(want.loss, case)
        assert torch.isfinite(g).all() and (g[off] == 0).all()
        e = _emulated(case, opts)  # each fp32 evaluation within its bound of float64
        extra = _kernel_cancellation(case, opts)
        _assert_fp32(e, got, stats._asdict(), (g,), f"{surrogate} kernel", extra)
        _assert_fp32(e, want.loss, want.metrics._asdict(), (gw,), f"{surrogate} torch")
        # exp(20) in fp32: the exponential's ~1 ulp and the result's rounding
        assert float(stats.ratio_max) <= math.exp(20) * (1 + 4 * unit_roundoff(torch.float32))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_dual_clip_caps_negative_advantage_terms(device):
    """Â < 0 with a ratio past c: the term is -c·Â and its gradient 0 (the plain clipped
    surrogate would give -r·Â with gradient -r·Â); below c, or with Â > 0, nothing changes.
    Kernel, torch path and reference agree, and the tokens are counted."""
    log_ratio = torch.tensor([0.5, 1.5, 5.0, 30.0, 1.5, -3.0])
    adv = torch.tensor([-1.0, -2.0, -0.5, -1.0, 2.0, -1.0])
    lp = torch.full((6,), -1.0, device=device, requires_grad=True)
    case = {
        "logprobs": lp,
        "old_logprobs": (lp.detach() - log_ratio.to(device)),
        "advantages": adv.to(device),
        "mask": torch.ones(6, dtype=torch.bool, device=device),
    }
    opts = {"surrogate": "clip", "clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 3.0}
    r = log_ratio.double().clamp(-20, 20).exp()
    clipped = r.clamp(0.8, 1.28)
    plain = torch.maximum(-adv.double() * r, -adv.double() * clipped)
    capped = torch.where((adv < 0) & (plain > -3.0 * adv.double()), -3.0 * adv.double(), plain)
    assert capped.tolist()[:4] == pytest.approx([1.0 * 1.6487212707, 6.0, 1.5, 3.0], rel=1e-9)
    # d(-Â r)/d log π = -Â r on token 0 (Â = -1); every other token is capped or clipped
    want_grad = torch.tensor([math.exp(0.5), 0.0, 0.0, 0.0, 0.0, 0.0]) / 6
    for name, fn in (
        ("kernel", lambda: fused_policy_loss(**case, **opts)),
        ("torch", lambda: tuple(policy_loss(**case, **opts, kernels="torch"))),
    ):
        loss, stats = fn()
        (g,) = torch.autograd.grad(loss, [lp])
        u = unit_roundoff(torch.float32)
        assert_within(loss, capped.mean().item(), 16 * u * capped.abs().mean().item(), name)
        assert_within(g.cpu(), want_grad, 8 * u * want_grad.abs().max(), f"{name} grad")
        assert float(stats.clip_fraction_dual) == pytest.approx(3 / 6)
        assert float(stats.clip_fraction_low) == pytest.approx(1 / 6)
        assert float(stats.clip_fraction_high) == pytest.approx(1 / 6)
        assert float(stats.clip_fraction) == pytest.approx(5 / 6)
    ref_loss, ref_metrics = reference.policy_loss(**_float64(case), **opts)
    assert ref_loss.item() == pytest.approx(capped.mean().item(), rel=1e-12)
    assert ref_metrics["clip_fraction_dual"] == 3 / 6
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(**case, **{**opts, "clip_ratio_c": 1.0}, kernels="torch")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_k3_far_from_the_reference_is_bounded_in_the_kernel(device):
    """k3 with log r = ±30, ±100 (fp32 exp overflows at 88): the kernel clamps as the torch
    path does (log r to ±20, the estimate to 10, no gradient there): finite and equal."""
    log_r = torch.tensor([0.3, -0.7, 30.0, -30.0, 100.0, -100.0, 2.0, 3.0])
    lp = torch.full((8,), -2.0, device=device, requires_grad=True)
    case = {
        "logprobs": lp,
        "old_logprobs": lp.detach().clone(),
        "advantages": torch.zeros(8, device=device),
        "mask": torch.ones(8, dtype=torch.bool, device=device),
        "ref_logprobs": lp.detach() + log_r.to(device),
    }
    opts = {"kl_coef": 1.0, "kl_estimator": "k3"}
    x = log_r.double().clamp(-20, 20)
    k3 = (torch.expm1(x) - x).clamp(max=10.0)
    want_grad = torch.where((x.abs() < 20) & (torch.expm1(x) - x <= 10), 1 - x.exp(), 0.0) / 8
    for name, fn in (
        ("kernel", lambda: fused_policy_loss(**case, **opts)),
        ("torch", lambda: tuple(policy_loss(**case, **opts, kernels="torch"))),
    ):
        loss, stats = fn()
        (g,) = torch.autograd.grad(loss, [lp])
        assert torch.isfinite(loss) and torch.isfinite(g).all(), name
        u = unit_roundoff(torch.float32)
        # per token ≤ 4u (e^x + 1) absolute (the kernel's exp(x) - 1 - x), then the mean
        bound = (4 * u * (x.exp() + 1)).mean().item() + 8 * u * k3.mean().item()
        assert_within(loss, k3.mean().item(), bound, f"{name} loss")
        assert_within(stats.kl_loss, k3.mean().item(), bound, f"{name} kl_loss")
        assert_within(g.cpu().double(), want_grad, 8 * u * 20 * x.exp().max() / 8, f"{name} grad")
        assert (g.cpu()[2:6] == 0).all(), name


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
    parts, bound = 0.0, _emulated(case, opts).bound["loss"]
    for sl in (slice(0, 50), slice(50, 120)):
        part = {k: v[sl] for k, v in case.items()}
        loss, _ = fused_policy_loss(**part, **opts, denominator=float(tokens))
        parts += loss.item()
        bound = bound + _emulated(part, {**opts, "denominator": float(tokens)}).bound["loss"]
    # three fp32 evaluations, each within its own bound of the exact value
    assert_within(parts, full.item(), bound, "parts")


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
