"""The per-token pass of the fused clipped policy loss (see ``_policy_loss``): one program per
``BLOCK`` tokens computes every term, its derivative with respect to ``log π_θ`` and the entropy,
and this block's partial sums of the loss and of every statistic (no atomics: the partials are
reduced in a fixed order by torch, so the result is deterministic)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns of the partials buffer (one row per program).
(
    LOSS,
    POLICY,
    KL,
    ENTROPY,
    LOW,
    HIGH,
    RATIO_SUM,
    RATIO_MIN,
    RATIO_MAX,
    APPROX_KL,
    TIS_SUM,
    TIS_CLIP,
    DUAL,
) = range(13)
NUM_STATS = 13
STATS_PAD = 16  # power of two for tl.arange

ALGOS = {"clip": 0, "gspo": 1, "cispo": 2}
KL_ESTIMATORS = {None: 0, "k1": 1, "k2": 2, "k3": 3}


@triton.jit
def _fused_policy_loss_fwd_kernel(
    LOGPROB,
    OLD_LOGPROB,
    ADVANTAGE,
    KEEP,
    WEIGHT,
    SEQ_LOG_RATIO,
    REF_LOGPROB,
    ENTROPY,
    ROLLOUT_LOGPROB,
    GRAD_LOGPROB,
    GRAD_ENTROPY,
    PARTIALS,
    num_tokens,
    clip_low,
    clip_high,
    max_log_ratio,
    kl_coef,
    entropy_coef,
    tis_cap,
    clip_ratio_c,
    k3_max,
    ALGO: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_TIS: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    STATS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offs < num_tokens
    keep = (tl.load(KEEP + offs, mask=in_bounds, other=0) != 0) & in_bounds
    # every input is zeroed where not kept *before* any arithmetic: NaN there cannot leak
    lp = tl.where(keep, tl.load(LOGPROB + offs, mask=in_bounds, other=0.0).to(tl.float32), 0.0)
    old = tl.where(keep, tl.load(OLD_LOGPROB + offs, mask=in_bounds, other=0.0).to(tl.float32), 0.0)
    adv = tl.where(keep, tl.load(ADVANTAGE + offs, mask=in_bounds, other=0.0).to(tl.float32), 0.0)
    w = tl.where(keep, tl.load(WEIGHT + offs, mask=in_bounds, other=0.0).to(tl.float32), 0.0)
    raw = lp - old
    log_ratio = tl.minimum(tl.maximum(raw, -max_log_ratio), max_log_ratio)
    if ALGO == 1:  # GSPO: the sequence ratio, gradient s_i ∇ log π_θ
        log_ratio = tl.where(keep, tl.load(SEQ_LOG_RATIO + offs, mask=in_bounds, other=0.0), 0.0)
        ratio = tl.exp(log_ratio)
        d_ratio = ratio
    else:  # the clamp passes no gradient outside ±max_log_ratio
        ratio = tl.exp(log_ratio)
        d_ratio = tl.where((raw >= -max_log_ratio) & (raw <= max_log_ratio), ratio, 0.0)
    lo = 1.0 - clip_low
    hi = 1.0 + clip_high
    clipped = tl.minimum(tl.maximum(ratio, lo), hi)
    if ALGO == 2:  # CISPO: -sg[clip(r)] Â log π_θ
        surrogate = -clipped * adv * lp
        d_surrogate = -clipped * adv
        low_hit = keep & (ratio < lo)
        high_hit = keep & (ratio > hi)
    else:  # -min(r Â, clip(r) Â) = max(-r Â, -clip(r) Â)
        plain = -adv * ratio
        capped = -adv * clipped
        surrogate = tl.maximum(plain, capped)
        d_plain = -adv * d_ratio
        d_capped = tl.where((ratio >= lo) & (ratio <= hi), d_plain, 0.0)
        d_surrogate = tl.where(
            plain > capped, d_plain, tl.where(capped > plain, d_capped, 0.5 * (d_plain + d_capped))
        )
        low_hit = keep & (adv < 0) & (ratio < lo)
        high_hit = keep & (adv > 0) & (ratio > hi)
    dual_hit = keep & (offs < 0)  # all False
    if HAS_DUAL:  # -Â c caps a negative-advantage term; a constant there: no gradient
        bound = -adv * clip_ratio_c
        dual_hit = keep & (adv < 0) & (surrogate > bound)
        surrogate = tl.where(dual_hit, bound, surrogate)
        d_surrogate = tl.where(dual_hit, 0.0, d_surrogate)
    tis = tl.full((BLOCK,), 1.0, dtype=tl.float32)
    if HAS_TIS:
        roll = tl.where(
            keep, tl.load(ROLLOUT_LOGPROB + offs, mask=in_bounds, other=0.0).to(tl.float32), 0.0
        )
        tis = tl.minimum(tl.exp(tl.minimum(old - roll, max_log_ratio)), tis_cap)
        surrogate = surrogate * tis
        d_surrogate = d_surrogate * tis
    term = surrogate
    d_term = d_surrogate
    kl = tl.zeros((BLOCK,), dtype=tl.float32)
    if KL_ESTIMATOR != 0:
        ref = tl.where(
            keep, tl.load(REF_LOGPROB + offs, mask=in_bounds, other=0.0).to(tl.float32), 0.0
        )
        log_r = ref - lp
        if KL_ESTIMATOR == 1:
            kl = -log_r
            d_kl = tl.full((BLOCK,), 1.0, dtype=tl.float32)
        elif KL_ESTIMATOR == 2:
            kl = 0.5 * log_r * log_r
            d_kl = -log_r
        else:  # log r clamped to ±max_log_ratio, the estimate to k3_max: no gradient past either
            inside = (log_r >= -max_log_ratio) & (log_r <= max_log_ratio)
            log_r = tl.minimum(tl.maximum(log_r, -max_log_ratio), max_log_ratio)
            r = tl.exp(log_r)
            # expm1 without cancellation near 0: (r - 1) via a short series below 1e-3
            expm1 = tl.where(tl.abs(log_r) < 1e-3, log_r * (1.0 + 0.5 * log_r), r - 1.0)
            kl = expm1 - log_r
            d_kl = tl.where(inside & (kl <= k3_max), 1.0 - r, 0.0)
            kl = tl.minimum(kl, k3_max)
        kl = tl.where(keep, kl, 0.0)
        term = term + kl_coef * kl
        d_term = d_term + kl_coef * d_kl
    ent = tl.zeros((BLOCK,), dtype=tl.float32)
    if HAS_ENTROPY:
        ent = tl.where(keep, tl.load(ENTROPY + offs, mask=in_bounds, other=0.0).to(tl.float32), 0.0)
        term = term - entropy_coef * ent
        tl.store(GRAD_ENTROPY + offs, tl.where(keep, -entropy_coef * w, 0.0), mask=in_bounds)
    tl.store(GRAD_LOGPROB + offs, tl.where(keep, w * d_term, 0.0), mask=in_bounds)

    ones = tl.where(keep, 1.0, 0.0)
    approx = tl.where(
        tl.abs(log_ratio) < 1e-3,
        0.5 * log_ratio * log_ratio,
        tl.exp(log_ratio) - 1.0 - log_ratio,
    )
    cols = tl.arange(0, STATS)
    row = tl.zeros((STATS,), dtype=tl.float32)
    row = tl.where(cols == 0, tl.sum(tl.where(keep, w * term, 0.0), 0), row)
    row = tl.where(cols == 1, tl.sum(tl.where(keep, w * surrogate, 0.0), 0), row)
    row = tl.where(cols == 2, tl.sum(w * kl, 0), row)
    row = tl.where(cols == 3, tl.sum(ent, 0), row)
    row = tl.where(cols == 4, tl.sum(tl.where(low_hit, 1.0, 0.0), 0), row)
    row = tl.where(cols == 5, tl.sum(tl.where(high_hit, 1.0, 0.0), 0), row)
    row = tl.where(cols == 6, tl.sum(tl.where(keep, ratio, 0.0), 0), row)
    row = tl.where(cols == 7, tl.min(tl.where(keep, ratio, float("inf")), 0), row)
    row = tl.where(cols == 8, tl.max(tl.where(keep, ratio, -float("inf")), 0), row)
    row = tl.where(cols == 9, tl.sum(tl.where(keep, approx, 0.0), 0), row)
    row = tl.where(cols == 10, tl.sum(ones * tis, 0), row)
    row = tl.where(cols == 11, tl.sum(tl.where(keep & (tis >= tis_cap), 1.0, 0.0), 0), row)
    row = tl.where(cols == 12, tl.sum(tl.where(dual_hit, 1.0, 0.0), 0), row)
    tl.store(PARTIALS + pid * STATS + cols, row)


def policy_loss_pass(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    weight: torch.Tensor,
    seq_log_ratio: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    *,
    algo: str,
    kl_estimator: str | None,
    clip_low: float,
    clip_high: float,
    max_log_ratio: float,
    kl_coef: float,
    entropy_coef: float,
    tis_cap: float | None,
    clip_ratio_c: float | None = None,
    k3_max: float = 10.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(grad_logprob [N], grad_entropy [N] | None, partials [programs, STATS_PAD])``, fp32;
    every input flat ``[N]`` and contiguous."""
    n = logprobs.numel()
    dev = logprobs.device
    block = 1024 if dev.type == "cuda" else 128
    programs = max(triton.cdiv(n, block), 1)
    grad_lp = torch.empty(n, dtype=torch.float32, device=dev)
    grad_ent = torch.empty(n, dtype=torch.float32, device=dev) if entropy is not None else None
    partials = torch.empty(programs, STATS_PAD, dtype=torch.float32, device=dev)
    dummy = grad_lp  # never read: its branch is compiled out
    _fused_policy_loss_fwd_kernel[(programs,)](
        logprobs,
        old_logprobs,
        advantages,
        keep,
        weight,
        seq_log_ratio if seq_log_ratio is not None else dummy,
        ref_logprobs if ref_logprobs is not None else dummy,
        entropy if entropy is not None else dummy,
        rollout_logprobs if rollout_logprobs is not None else dummy,
        grad_lp,
        grad_ent if grad_ent is not None else dummy,
        partials,
        n,
        float(clip_low),
        float(clip_high),
        float(max_log_ratio),
        float(kl_coef),
        float(entropy_coef),
        float(tis_cap) if tis_cap is not None else float("inf"),
        float(clip_ratio_c) if clip_ratio_c is not None else 0.0,
        float(k3_max),
        ALGO=ALGOS[algo],
        KL_ESTIMATOR=KL_ESTIMATORS[kl_estimator],
        HAS_ENTROPY=entropy is not None,
        HAS_TIS=tis_cap is not None,
        HAS_DUAL=clip_ratio_c is not None,
        BLOCK=block,
        STATS=STATS_PAD,
    )
    return grad_lp, grad_ent, partials
