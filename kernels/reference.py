"""Plain torch references for every kernel in ``agentrl.kernels``: written to be read, not to be
fast. Each materializes whatever it needs (full logits, per-token Python loops) and computes in
``float64`` by default, so it is the yardstick the kernels and the chunked torch paths are
tested against. Nothing here is used on a hot path.
"""

from __future__ import annotations

import math

import torch

__all__ = ["logprob_entropy", "paged_decode_attention", "paged_prefill_attention", "policy_loss"]


def logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probability of ``targets`` and entropy, from the full logits.

    With logits ``z = h Wᵀ / τ`` (``hidden [T, H]``, ``weight [V, H]``) and ``p = softmax(z)``::

        logprob_t = z_t[y_t] - log Σ_j exp(z_t[j])
        entropy_t = -Σ_j p_t[j] log p_t[j]

    the log-probability an engine records for a token sampled at temperature ``τ`` and the
    Shannon entropy (nats) of that distribution. Positions where ``mask`` is False return 0 and
    get no gradient. Differentiable in ``hidden`` and ``weight`` (in ``dtype``).
    """
    logits = (hidden.to(dtype) @ weight.to(dtype).T) / temperature  # [T, V]: all of it
    log_p = torch.log_softmax(logits, dim=-1)
    logprob = log_p.gather(1, targets.long()[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    if mask is not None:
        keep = mask.bool()
        logprob = torch.where(keep, logprob, torch.zeros_like(logprob))
        entropy = torch.where(keep, entropy, torch.zeros_like(entropy))
    return logprob, entropy


def _kl(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    estimator: str,
    max_log_ratio: float = 20.0,
    k3_max: float = 10.0,
) -> torch.Tensor:
    """Schulman's estimators of KL(π ‖ π_ref) from one sample, ``log r = log π_ref - log π``
    (http://joschu.net/blog/kl-approx.html): k1 = -log r, k2 = ½ (log r)², k3 = (r - 1) - log r,
    the last with ``log r`` clamped to ``±max_log_ratio`` and its value to ``k3_max`` (no
    gradient where either clamp acts)."""
    log_r = ref_logprob - logprob
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        log_r = torch.clamp(log_r, -max_log_ratio, max_log_ratio)
        return torch.clamp(torch.exp(log_r) - 1 - log_r, max=k3_max)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    surrogate: str = "clip",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    agg: str = "token-mean",
    sequence_index: torch.Tensor | None = None,
    denominator: float | None = None,
    norm_length: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    clip_ratio_c: float | None = None,
    max_log_ratio: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy loss of the GRPO/PPO family, one token at a time (1-D inputs).

    For each kept token ``t`` of sequence ``i`` (``sequence_index``; -1 = none; default: one
    sequence) with ``r_t = exp(clamp(log π_θ - log π_old, ±max_log_ratio))``:

    - ``clip`` (PPO/GRPO/Dr.GRPO/DAPO): ``-min(r Â, clip(r, 1-ε_low, 1+ε_high) Â)`` (Schulman et
      al. 2017, eq. 7; Shao et al. 2024, eq. 3; Yu et al. 2025 §3.1 for ``ε_high > ε_low``).
    - ``gspo``: the same with ``r`` replaced by the sequence ratio ``s_i = exp(mean_t log r_t)``
      (Zheng et al. 2025, eq. 7), whose gradient flows through each token as ``s_i ∇ log π_θ``.
    - ``cispo``: ``-sg[clip(r)] Â log π_θ`` (MiniMax-M1, 2025).

    With ``clip_ratio_c`` (``clip`` only), a token with ``Â < 0`` contributes at most ``-c Â``
    (dual clip, Ye et al. 2020, eq. 5), a constant where that bound is the smaller.
    times ``sg[min(π_old / π_rollout, C)]`` with ``tis_cap`` (Yao et al. 2025), plus
    ``β k(π_θ, π_ref)`` and minus ``c H``. Aggregation: token-mean ``Σ x / N``;
    seq-mean-token-sum ``1/S Σ_i Σ_t x``; seq-mean-token-mean ``1/S Σ_i 1/|o_i| Σ_t x``;
    seq-mean-token-sum-norm ``1/(S L) Σ_i Σ_t x``; ``denominator`` replaces N or S.

    Returns the loss (differentiable in ``logprobs`` and ``entropy``, float64) and metrics
    (floats): policy_loss, kl_loss, clip_fraction(_low/_high/_dual), ratio_mean/min/max, approx_kl,
    tis_weight_mean, tis_clip_fraction, num_tokens.
    """
    high = clip_low if clip_high is None else clip_high
    n = logprobs.shape[0]
    keep = [bool(m) for m in mask.reshape(-1).tolist()]
    if sequence_index is None:
        seq = [0 if k else -1 for k in keep]
    else:
        seq = [int(s) if k else -1 for s, k in zip(sequence_index.tolist(), keep, strict=True)]
    lp = logprobs.to(torch.float64)
    old = old_logprobs.detach().to(torch.float64)
    adv = advantages.detach().to(torch.float64)

    def log_ratio(t: int) -> torch.Tensor:
        return torch.clamp(lp[t] - old[t], -max_log_ratio, max_log_ratio)

    members: dict[int, list[int]] = {}
    for t in range(n):
        if seq[t] >= 0:
            members.setdefault(seq[t], []).append(t)
    seq_log_ratio = {i: sum(log_ratio(t).item() for t in ts) / len(ts) for i, ts in members.items()}

    terms: dict[int, torch.Tensor] = {}
    surrogates: dict[int, float] = {}
    kls: dict[int, float] = {}
    ratios: list[float] = []
    low_hits = high_hits = dual_hits = 0
    approx_kl = 0.0
    tis_weights: list[float] = []
    tis_clipped = 0
    for t in range(n):
        if seq[t] < 0:
            continue
        if surrogate == "gspo":
            # value s_i, gradient s_i ∇ log π_θ(y_t): exp(lp - sg(lp)) is 1 with derivative 1
            ratio = math.exp(seq_log_ratio[seq[t]]) * torch.exp(lp[t] - lp[t].detach())
        else:
            ratio = torch.exp(log_ratio(t))
        clipped = torch.clamp(ratio, 1 - clip_low, 1 + high)
        if surrogate == "cispo":
            objective = -clipped.detach() * adv[t] * lp[t]
            low_hits += ratio.item() < 1 - clip_low
            high_hits += ratio.item() > 1 + high
        else:
            objective = torch.maximum(-adv[t] * ratio, -adv[t] * clipped)
            low_hits += float(adv[t]) < 0 and ratio.item() < 1 - clip_low
            high_hits += float(adv[t]) > 0 and ratio.item() > 1 + high
            if clip_ratio_c is not None and surrogate == "clip" and float(adv[t]) < 0:
                bound = -adv[t] * clip_ratio_c
                if objective.item() > bound.item():
                    objective = bound
                    dual_hits += 1
        if tis_cap is not None:
            assert rollout_logprobs is not None, "tis_cap needs rollout_logprobs"
            w = min(
                math.exp(min(float(old[t] - rollout_logprobs[t].detach()), max_log_ratio)), tis_cap
            )
            tis_weights.append(w)
            tis_clipped += w >= tis_cap
            objective = objective * w
        term = objective
        if ref_logprobs is not None:
            kl = _kl(lp[t], ref_logprobs[t].detach().double(), kl_estimator, max_log_ratio)
            kls[t] = kl.item()
            term = term + kl_coef * kl
        if entropy is not None:
            term = term - entropy_coef * entropy[t].to(torch.float64)
        terms[t], surrogates[t] = term, objective.item()
        ratios.append(ratio.item())
        lr = seq_log_ratio[seq[t]] if surrogate == "gspo" else log_ratio(t).item()
        approx_kl += math.expm1(lr) - lr

    def reduce(values: dict[int, torch.Tensor] | dict[int, float]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        if agg == "token-mean":
            for x in values.values():
                total = total + x
            return total / (denominator if denominator is not None else max(len(values), 1))
        for ts in members.values():
            per_seq = torch.zeros((), dtype=torch.float64)
            for t in ts:
                per_seq = per_seq + values[t]
            if agg == "seq-mean-token-mean":
                per_seq = per_seq / len(ts)
            elif agg == "seq-mean-token-sum-norm":
                assert norm_length, "seq-mean-token-sum-norm needs norm_length"
                per_seq = per_seq / norm_length
            elif agg != "seq-mean-token-sum":
                raise ValueError(f"unknown aggregation {agg!r}")
            total = total + per_seq
        return total / (denominator if denominator is not None else max(len(members), 1))

    count = max(len(terms), 1)
    metrics = {
        "policy_loss": reduce(surrogates).item(),
        "kl_loss": reduce(kls).item() if ref_logprobs is not None else 0.0,
        "entropy": (sum(entropy[t].item() for t in terms) / count if entropy is not None else 0.0),
        "clip_fraction": (low_hits + high_hits + dual_hits) / count,
        "clip_fraction_low": low_hits / count,
        "clip_fraction_high": high_hits / count,
        "clip_fraction_dual": dual_hits / count,
        "ratio_mean": sum(ratios) / len(ratios) if ratios else 1.0,
        "ratio_min": min(ratios, default=1.0),
        "ratio_max": max(ratios, default=1.0),
        "approx_kl": approx_kl / count,
        "tis_weight_mean": sum(tis_weights) / len(tis_weights) if tis_weights else 1.0,
        "tis_clip_fraction": tis_clipped / count,
        "num_tokens": float(len(terms)),
    }
    return reduce(terms), metrics


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | list[int],
    scale: float,
) -> torch.Tensor:
    """One decode step of attention over a paged KV cache, a token at a time.

    ``q [B, H, D]`` is each sequence's newest query; ``k_cache``/``v_cache``
    ``[num_blocks, block_size, KVH, D]``; sequence ``b``'s token ``i`` sits in block
    ``block_tables[b, i // block_size]`` at offset ``i % block_size``; it attends to its
    ``seq_lens[b]`` keys. Query head ``h`` reads KV head ``h // (H / KVH)`` (grouped-query
    attention, Ainslie et al. 2023). ``out[b, h] = softmax(scale · q Kᵀ) V`` (Vaswani et al.
    2017, eq. 1), computed in float64 and returned in ``q``'s dtype.
    """
    batch, heads, _ = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    lens = [int(n) for n in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        n = lens[b]
        blocks = [int(block_tables[b, i // block_size]) for i in range(n)]
        offsets = [i % block_size for i in range(n)]
        keys = torch.stack([k_cache[blk, off] for blk, off in zip(blocks, offsets, strict=True)])
        values = torch.stack([v_cache[blk, off] for blk, off in zip(blocks, offsets, strict=True)])
        for h in range(heads):
            kv = h // group
            scores = (keys[:, kv].double() @ q[b, h].double()) * scale  # [n]
            weights = torch.softmax(scores, dim=0)
            out[b, h] = weights @ values[:, kv].double()
    return out.to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | list[int],
    query_starts: torch.Tensor | list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed prefill chunks over a paged KV cache, a query at a time.

    ``q [T, H, D]`` packs the rows' queries: row ``b``'s are ``q[query_starts[b]:query_starts[b
    + 1]]``, the last ``q_len`` of its ``seq_lens[b]`` positions, so query ``i`` sits at
    position ``seq_lens[b] - q_len + i`` and attends to keys ``0..`` that position (causal
    attention after a cached context). Keys as in ``paged_decode_attention``. Float64, returned
    in ``q``'s dtype.
    """
    heads = q.shape[1]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    lens = [int(n) for n in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
    starts = [
        int(s) for s in (query_starts.tolist() if torch.is_tensor(query_starts) else query_starts)
    ]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        blocks = [int(block_tables[b, i // block_size]) for i in range(n)]
        keys = torch.stack([k_cache[blk, i % block_size] for i, blk in enumerate(blocks)])
        values = torch.stack([v_cache[blk, i % block_size] for i, blk in enumerate(blocks)])
        first, q_len = starts[b], starts[b + 1] - starts[b]
        for i in range(q_len):
            seen = n - q_len + i + 1
            for h in range(heads):
                kv = h // group
                scores = (keys[:seen, kv].double() @ q[first + i, h].double()) * scale
                out[first + i, h] = torch.softmax(scores, dim=0) @ values[:seen, kv].double()
    return out.to(q.dtype)
