"""Error models behind the tests' floating-point tolerances.

Every tolerance in these tests is a bound derived from how the computation rounds, evaluated on
the actual inputs, never a number one machine printed: CPUs (AVX-512, AVX2 or plain C++ kernels,
see ``ATEN_CPU_CAPABILITY``) and GPUs block and order their sums differently, so two correct
implementations agree with each other, and with a float64 reference, only to within the rounding
their sums make.

Rounding model
--------------
``u`` is the unit roundoff of the dtype a result is rounded to (``unit_roundoff``): a rounded
result is ``x (1 + δ)`` with ``|δ| ≤ u`` (round to nearest; a truncating cast, which Triton's
interpreter does from fp32 to bf16/fp16, has ``|δ| < 2u``). A sum of ``n`` terms ``t_i``
accumulated in precision ``u`` (a dot product, a reduction) errs by

- at most ``γ_n Σ|t_i|`` in any order and blocking, ``γ_n = nu / (1 - nu)`` (Higham, *Accuracy
  and Stability of Numerical Algorithms*, 2nd ed., §3.1, §3.5): the worst case;
- at most ``λ √n u Σ|t_i|`` with probability at least ``1 - 2n exp(-λ²(1 - u)²/2)`` if the
  rounding errors are independent and mean zero (Higham & Mary, *A New Approach to Probabilistic
  Rounding Error Analysis*, SIAM J. Sci. Comput. 41(5), 2019). ``LAMBDA = 6``: a failure
  probability below ``3e-8 n`` per result.

``accumulation_factor`` takes the smaller of the two (the worst case is the tighter one while
``n < λ²``); ``fp_bound`` and ``dot_bound`` apply it to magnitudes.

Deep computations
-----------------
Through a whole network the per-operation errors compound in ways no closed form tracks without
becoming useless. ``emulated_rounding_error`` propagates a per-operation model numerically
(Monte Carlo arithmetic, Parker, Pierce & Eggert, *Computing in Science & Engineering* 2(4),
2000): it reruns a float64 computation with an independent Gaussian error added to every
operation's result, with the standard deviation of that operation's rounding at the emulated
precision (``EmulatedRounding`` lists the rules; sums use ``summation_std``, the error of adding
the terms one by one in a random order, which blocked and tree-shaped kernels beat), and reports
how far the outputs move. The largest move over many outputs is a stable measure (the maximum
of a Gaussian field concentrates); ``EMULATION_SAFETY`` times it bounds an evaluation at that
precision. Outputs checked one by one (a loss, a metric) use ``emulated_std`` instead: a
per-output standard deviation from 16 draws, times ``LAMBDA``.

Measured on tiny-random and SmolLM2-135M (AVX-512, AVX2 and plain kernels), real fp32 errors
stay at 7-16 % of these bounds, while a wrong rope, norm epsilon or weight exceeds them.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

LAMBDA = 6.0
"""The probabilistic bounds' constant λ (see the module docstring)."""

EMULATION_SAFETY = 3.0
"""``emulated_rounding_error``'s bound is this many times the largest deviation its draws saw.
A draw's largest deviation over many outputs concentrates tightly around its mean (the maximum
of a Gaussian field fluctuates by a fraction of one standard deviation), and the emulated
per-operation errors already overstate real ones, so a factor of 3 leaves a real rounding error
no plausible way past the bound while a wrong result (an error of the size of the output) still
fails by orders of magnitude."""

TF32_UNIT_ROUNDOFF = 2.0**-11
"""tf32 keeps fp16's 10 explicit mantissa bits: what an fp32 ``tl.dot`` or cuBLAS GEMM rounds its
operands to when it runs on tensor cores without ``input_precision="ieee"``."""

SPLIT_FP32_UNIT_ROUNDOFF = 2.0**-21
"""fp32 products computed as three tf32 products (CUTLASS's ``OpMultiplyAddFastF32``, which
torch's memory-efficient attention uses for fp32 on sm80+): the dropped low × low term is below
2^-22 of each product, so each product errs by up to ~2^-21 before the fp32 sum."""

_UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of a floating dtype: half the distance from 1 to the next number."""
    try:
        return _UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"no unit roundoff known for {dtype}") from None


def gamma(n: int, u: float) -> float:
    """Higham's ``γ_n = nu / (1 - nu)``: the worst-case relative error of ``n`` roundings."""
    if n * u >= 1:
        raise ValueError(f"γ_n undefined: n = {n} roundings at u = {u:g} reach 1")
    return n * u / (1 - n * u)


def accumulation_factor(n: int, u: float, *, lam: float = LAMBDA) -> float:
    """Relative error factor of a sum of ``n`` terms in precision ``u``: ``min(γ_n, λ√n u)``
    (at least ``u``: even one term is rounded once)."""
    n = max(int(n), 1)
    probabilistic = lam * math.sqrt(n) * u
    return min(gamma(n, u), probabilistic) if n * u < 1 else probabilistic


def fp_bound(
    magnitude: torch.Tensor | float, n: int = 1, *, u: float, lam: float = LAMBDA
) -> torch.Tensor | float:
    """Error bound of a result computed as a sum of ``n`` terms whose absolute values add up to
    ``magnitude`` (``Σ|t_i|``; for a single rounded value, its ``|x|`` and ``n = 1``)."""
    return accumulation_factor(n, u, lam=lam) * magnitude


def dot_bound(a: torch.Tensor, b: torch.Tensor, *, u: float, lam: float = LAMBDA) -> torch.Tensor:
    """Elementwise error bound of ``a @ b`` accumulated in precision ``u`` (float64, from the
    values the implementation multiplied): ``accumulation_factor(k, u) · (|a| @ |b|)``."""
    a64, b64 = to64(a, b)
    return fp_bound(a64.abs() @ b64.abs(), a.shape[-1], u=u, lam=lam)


def to64(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Detached float64 CPU copies (exact: every working dtype embeds in float64)."""
    return tuple(t.detach().to(device="cpu", dtype=torch.float64) for t in tensors)


def float64_call(fn: Callable[..., object], *args: object, **kwargs: object) -> object:
    """``fn`` recomputed in float64: every floating tensor among the arguments is cast first."""

    def cast(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().to(torch.float64)
        return x

    return fn(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})


def _float64_tensor(x: torch.Tensor | float | list[float]) -> torch.Tensor:
    """A float64 CPU tensor of ``x`` (Python floats go straight to float64, never via fp32)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.tensor(x, dtype=torch.float64)


def assert_within(
    got: torch.Tensor | float,
    want: torch.Tensor | float,
    bound: torch.Tensor | float,
    what: str = "",
) -> None:
    """``|got - want| ≤ bound`` elementwise (float64; ``bound`` broadcasts), with the worst
    element, its error and its bound in the message. NaN or inf in ``got`` fails."""
    g, w, b = (_float64_tensor(x) for x in (got, want, bound))
    b = b.expand_as(w)
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    assert torch.isfinite(g).all(), f"{what}: non-finite values"
    error = (g - w).abs()
    if bool((error <= b).all()):
        return
    worst = int((error - b).flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), w.shape))
    raise AssertionError(
        f"{what}: |Δ| {error.flatten()[worst]:.3g} > bound {b.flatten()[worst]:.3g} at {index} "
        f"(got {g.flatten()[worst]:.9g}, want {w.flatten()[worst]:.9g}; "
        f"{int((error > b).sum())} of {error.numel()} elements out)"
    )


def attention_error_bound(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    *,
    u_acc: float = _UNIT_ROUNDOFF[torch.float32],
    u_operand: float = 0.0,
    u_score: float = 0.0,
    u_prob: float = 0.0,
    u_out: float = 0.0,
    exp_error: float = 2.0**-21,
    splits: int = 1,
) -> torch.Tensor:
    """Error bound ``[dv]`` of ``softmax(scale · keys @ q) @ values`` for one query ``q [d]``
    over ``keys [n, d]``, ``values [n, dv]`` (the values the implementation read, as float64).

    Precisions: sums accumulate at ``u_acc``; ``u_operand``: q and k are rounded before their
    product (e.g. pre-scaled in the working dtype); ``u_score``: scores are stored in the working
    dtype; ``u_prob``: probabilities are rounded before multiplying V; ``u_out``: the output cast
    (twice the unit roundoff where the cast truncates); ``exp_error``: the exponential's
    relative error; ``splits``: partial results merged by log-sum-exp.

    Each score ``s_i`` then moves by at most ``D_i = f(d)·scale·Σ_j|q_j k_ij|`` (its dot product,
    ``f = accumulation_factor``) ``+ 2 u_operand scale Σ_j|q_j k_ij| + u_score |s_i| + 4 u_acc
    (|s_i| + max|s| + ln n)`` (scaling, the max subtraction, the exp argument, a split's
    log-sum-exp) ``+ exp_error``. If every score moves by at most ``D``, every weight moves by a
    factor within ``e^{±2D}`` and, as ``Σ δp = 0``, ``|δo_d| ≤ (e^{2D} - 1) Σ_i p_i |v_id - o_d|``
    exactly, however large the scores: a decisive row is checked tightly, a near-tie loosely.
    Rounding the weights adds ``u_prob Σ p|v|``; accumulating ``Σ p v`` and ``Σ p`` over ``n``
    keys ``f(n) (Σ p|v| + |o|)``; the division ``u_acc |o|``; merging splits ``f(splits + 1)
    (Σ p|v| + |o|)``; the output cast ``u_out |o|``. A wrong key or a lost rescaling errs by
    ``~|v|``.
    """
    q, keys, values = to64(q, keys, values)
    n, d = keys.shape
    qk = q[None, :] * keys  # [n, d]
    s = scale * qk.sum(-1)
    magnitude = scale * qk.abs().sum(-1)
    shift = (
        (accumulation_factor(d, u_acc) + 2 * u_operand) * magnitude
        + u_score * s.abs()
        + 4 * u_acc * (s.abs() + s.abs().max() + math.log(n))
        + exp_error
    )
    p = torch.softmax(s, -1)
    o = p @ values
    weighted = p @ values.abs()
    spread = p @ (values - o).abs()
    merge = accumulation_factor(splits + 1, u_acc) if splits > 1 else 0.0
    summed = (accumulation_factor(n, u_acc) + merge) * (weighted + o.abs())
    return (
        torch.expm1(2 * shift.max()) * spread
        + u_prob * weighted
        + summed
        + (u_acc + u_out) * o.abs()
    )


def triton_decode_rounding(
    dtype: torch.dtype, device: str, num_splits: int | None, max_seq_len: int
) -> dict[str, float]:
    """``attention_error_bound`` arguments for the Triton paged-decode kernel: every load
    upcast to fp32, fp32 products and sums (``tl.sum``, not ``tl.dot``: no tf32 on a GPU
    either), an output cast to ``dtype`` (Triton's interpreter truncates fp32 to bf16/fp16, up
    to one ulp; a GPU rounds, half an ulp). A split holds at least one 16-key tile, so without
    ``num_splits`` there are at most ``⌈max_seq_len / 16⌉``."""
    u_out = 0.0 if dtype == torch.float32 else unit_roundoff(dtype)
    if device == "cpu":
        u_out *= 2
    return {"u_out": u_out, "splits": num_splits or -(-max_seq_len // 16)}


def triton_prefill_rounding(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``attention_error_bound`` arguments for the Triton paged-prefill kernel: loads upcast to
    fp32 and both products in ``tl.dot`` on fp32 operands. fp32 inputs: ``"ieee"`` products,
    exact. 16-bit inputs: ``"tf32"``, which holds bf16/fp16 values exactly, so only the
    probabilities lose bits before ``P V``: on a GPU the tensor cores *truncate* the fp32 operand
    to tf32 (sm_90's PTX has no rounding ``cvt`` before the ``wgmma``), up to one tf32 ulp,
    twice ``TF32_UNIT_ROUNDOFF``; the interpreter multiplies in fp32. The output cast as in
    ``triton_decode_rounding``."""
    if dtype == torch.float32:
        return {}
    u_out = unit_roundoff(dtype) * (2 if device == "cpu" else 1)
    return {"u_out": u_out, "u_prob": 2 * TF32_UNIT_ROUNDOFF if device != "cpu" else 0.0}


def paged_prefill_bound(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    **rounding: float,
) -> torch.Tensor:
    """``attention_error_bound`` for every (query token, head) of packed prefill chunks over a
    paged cache (``q [T, H, D]``; row ``b``'s queries ``query_starts[b]:query_starts[b + 1]``
    are its last positions and see the keys up to their own): ``[T, H, D]``."""
    q64, k64, v64 = to64(q, k_cache, v_cache)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    tables, starts = block_tables.cpu(), query_starts.tolist()
    bound = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        blocks = tables[b, pos // block_size]
        keys, values = k64[blocks, pos % block_size], v64[blocks, pos % block_size]
        first, q_len = starts[b], starts[b + 1] - starts[b]
        for i in range(q_len):
            seen = n - q_len + i + 1
            for h in range(q.shape[1]):
                kv = h // group
                bound[first + i, h] = attention_error_bound(
                    q64[first + i, h], keys[:seen, kv], values[:seen, kv], scale, **rounding
                )
    return bound


def sdpa_rounding(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``attention_error_bound`` arguments for torch SDPA, over its backends: in bf16/fp16 the
    math backend pre-scales q and k and stores scores and probabilities in the working dtype,
    flash backends round the probabilities before ``P @ V``, all accumulate in fp32 and cast
    the output; CPU flash attention's exponential is a fast approximation (``exp_u20``, taken
    as 32 ulps); on CUDA, fp32 attention runs the memory-efficient kernel, whose products, in
    ``Q Kᵀ`` and in ``P V`` alike, are split tf32 products (``SPLIT_FP32_UNIT_ROUNDOFF``)."""
    exp = 32 * unit_roundoff(torch.float32)
    if dtype != torch.float32:
        u = unit_roundoff(dtype)
        return {"u_operand": u, "u_score": u, "u_prob": u, "u_out": u, "exp_error": exp}
    if device == "cuda":
        split = SPLIT_FP32_UNIT_ROUNDOFF
        return {"u_operand": split, "u_prob": split, "exp_error": exp}
    return {"exp_error": exp}


def paged_decode_bound(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    **rounding: float,
) -> torch.Tensor:
    """``attention_error_bound`` for every (sequence, head) of one decode step over a paged
    cache (``q [B, H, D]``, caches ``[blocks, block_size, kv_heads, D]``): ``[B, H, D]``."""
    q64, k64, v64 = to64(q, k_cache, v_cache)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    tables = block_tables.cpu()
    bound = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        blocks = tables[b, pos // block_size]
        keys, values = k64[blocks, pos % block_size], v64[blocks, pos % block_size]
        for h in range(q.shape[1]):
            kv = h // group
            bound[b, h] = attention_error_bound(
                q64[b, h], keys[:, kv], values[:, kv], scale, **rounding
            )
    return bound


def logprob_entropy_bounds(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
    *,
    u: float = _UNIT_ROUNDOFF[torch.float32],
    u_dz: float = 0.0,
    u_out: float = 0.0,
    u_operand: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Error bounds of per-token log-prob and entropy from ``z = hidden @ weightᵀ / τ`` (see
    ``agentrl.kernels.reference.logprob_entropy``) computed at unit roundoff ``u`` (float64,
    from the values the implementation read), and of the gradients of ``Σ g_lp logprob + g_ent
    entropy``: ``(logprob [T], entropy [T], grad_hidden [T, H], grad_weight [V, H])``.

    Forward, ``f = accumulation_factor``: a logit ``z_j = h·w_j / τ``
    errs by ``dz_j = f(H) Σ_k|h_k w_jk| / τ + 2u|z_j|``; the log-sum-exp by ``δlse = Σ_j p_j dz_j
    + f(V) + 4u + u|lse|`` (the weights' sum over the vocabulary, the exps, the log); so each
    ``log p_j`` by ``ε_j = dz_j + δlse``, the logprob by ``ε_y + u|logprob|``, and the entropy
    ``-Σ p log p`` by ``Σ_j p_j (1 + |log p_j| + |log p_j + H|) ε_j + (f(V) + 4u)(Σ_j p_j
    |log p_j| + H + 1)``: ``p_j |log p_j + H|`` is its derivative along a shift of ``z_j`` (which
    the normalizer partly absorbs), ``p_j |1 + log p_j|`` along an error of ``log p_j`` alone
    (``z_j - lse`` rounded: with logits of 1e3 that alone is ~6e-5).

    Backward: ``dL/dz_j = (g_lp (1[j=y] - p_j) - g_H p_j (log p_j + H)) / τ`` errs by
    ``(|g_lp| p_j ε_j + |g_H| p_j (ε_j |log p_j + H| + ε_j + δH)) / τ`` plus ``4u`` of its terms;
    ``u_dz``: the kernel rounds ``dL/dz`` to the weights' dtype before its products (bf16
    ``tl.dot`` on a GPU). The gradients ``dz @ W`` and ``dzᵀ @ h`` then err by the propagated
    ``|δdz| @ |W|`` plus their own sums over ``V`` (``T``), and the cast to the input dtype,
    ``u_out |grad|``. ``u_operand``: every GEMM rounds its operands first (tf32 on tensor
    cores: ``2 u_operand`` of its absolute products)."""
    h, w, g_lp, g_ent = to64(hidden, weight, g_lp, g_ent)
    v = w.shape[0]
    z = h @ w.T / temperature
    dz = (dot_bound(h, w.T, u=u) + 2 * u_operand * (h.abs() @ w.abs().T)) / temperature
    dz = dz + 2 * u * z.abs()
    log_p = z.log_softmax(-1)
    p = log_p.exp()
    lse = torch.logsumexp(z, -1)
    entropy = -(p * log_p).sum(-1)
    d_lse = (p * dz).sum(-1) + accumulation_factor(v, u) + 4 * u + u * lse.abs()
    eps = dz + d_lse[:, None]  # [T, V]: each log p_j
    lp = log_p.gather(1, targets.cpu().long()[:, None])[:, 0]
    lp_bound = eps.gather(1, targets.cpu().long()[:, None])[:, 0] + u * lp.abs()
    centred = (log_p + entropy[:, None]).abs()
    sum_term = accumulation_factor(v, u) + 4 * u
    # each log p_j errs on its own (not as a shift of the logits the normalizer absorbs), so
    # entropy's sensitivity to it is p_j |1 + log p_j| as well as the logits' p_j |log p_j + H|
    sensitivity = p * (1 + log_p.abs() + centred)
    ent_bound = (sensitivity * eps).sum(-1) + sum_term * ((p * log_p.abs()).sum(-1) + entropy + 1)
    onehot = torch.zeros_like(p).scatter_(1, targets.cpu().long()[:, None], 1.0)
    grad_z = g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (log_p + entropy[:, None])
    grad_z = grad_z / temperature
    size = g_lp.abs()[:, None] * (onehot + p) + g_ent.abs()[:, None] * p * centred
    d_grad_z = (
        g_lp.abs()[:, None] * p * eps
        + g_ent.abs()[:, None] * p * (eps * centred + eps + ent_bound[:, None])
        + 4 * u * size
    ) / temperature + u_dz * grad_z.abs()
    grad_h, grad_w = grad_z @ w, grad_z.T @ h
    gh_sums = dot_bound(grad_z, w, u=u) + 2 * u_operand * (grad_z.abs() @ w.abs())
    gw_sums = dot_bound(grad_z.T, h, u=u) + 2 * u_operand * (grad_z.abs().T @ h.abs())
    gh_bound = d_grad_z @ w.abs() + gh_sums + u_out * grad_h.abs()
    gw_bound = d_grad_z.T @ h.abs() + gw_sums + u_out * grad_w.abs()
    return lp_bound, ent_bound, gh_bound, gw_bound


# -- Monte Carlo propagation through deep computations -----------------------------------------

_EXACT = frozenset(
    """view _unsafe_view reshape t transpose permute expand slice select unsqueeze squeeze
    clone alias detach lift_fresh contiguous cat stack split split_with_sizes unbind chunk
    index_select index gather embedding where masked_fill neg abs amax amin max min maximum
    minimum clamp clamp_min clamp_max relu fill zero zeros zeros_like ones ones_like empty
    empty_like new_zeros new_ones new_empty full full_like scalar_tensor arange index_copy
    index_put scatter tril triu flip roll repeat constant_pad_nd sort topk argmax argmin
    as_strided unfold narrow diagonal masked_select nonzero sign""".split()
)
"""aten ops whose floating results are exact (moves, selections, sign flips)."""

_ONE_ROUNDING = frozenset("add sub rsub mul div sqrt reciprocal addcmul addcdiv".split())
"""Correctly rounded: one rounding each (error ≤ u)."""

_MATMUL = {
    "mm": torch.ops.aten.mm,
    "bmm": torch.ops.aten.bmm,
    "mv": torch.ops.aten.mv,
    "dot": torch.ops.aten.dot,
    "addmm": torch.ops.aten.mm,
    "baddbmm": torch.ops.aten.bmm,
    "addmv": torch.ops.aten.mv,
}
"""Products over an inner dimension, and the plain product their absolute values go through."""
_SUM = frozenset("sum mean".split())


def summation_std(
    n: int | torch.Tensor, total: torch.Tensor, squares: torch.Tensor, u: float
) -> torch.Tensor:
    """Standard deviation of the rounding error of a sum of ``n`` terms ``t_i`` added one by one
    in a random order, each partial sum ``s_k`` rounded with an independent error uniform in
    ``±u s_k`` (variance ``u² s_k² / 3``): for exchangeable terms ``E Σ_k s_k² ≈ n (S²/3 +
    Σt²/2)`` (``S = Σ t_i`` is ``total``, ``Σ t_i²`` is ``squares``), so the error's standard
    deviation is ``u √(n (S²/9 + Σt²/6))``. Blocked, vectorized and tree-shaped sums, which real
    kernels use, have smaller partial sums and so smaller errors."""
    return u * (n * (total.square() / 9 + squares / 6)).sqrt()


class EmulatedRounding(TorchDispatchMode):
    """Adds to every floating aten result an independent Gaussian error with the standard
    deviation of that operation's rounding, at ``u = max(emulated u, u of the result's dtype)``
    (float64 operations become ``emulate``-precision ones; an operation already in a coarser
    dtype keeps its own u):

    - exact ops (views, indexing, ``cat``, ``where``, ``abs``, max/min, ...): nothing;
    - ``add``/``mul``/``div``/``sqrt``... (correctly rounded): ``u |out|``; other elementwise
      functions (``exp``, ``log``, ``cos``, ``silu``, ``rsqrt``, ``pow``; vectorized libraries
      promise about one ulp): ``2u |out|``;
    - ``mm``/``bmm``/``addmm``... over ``k`` terms: ``summation_std`` of the ``k`` products, plus
      ``u |out|``;
    - ``sum``/``mean`` of ``n`` terms, ``index_add``/``scatter_add``/``embedding_dense_backward``
      (segment sums):
      ``summation_std``, plus ``u |out|``;
    - ``softmax`` / ``log_softmax`` / ``logsumexp`` over ``n``: the normalizer ``S = Σ e^(x -
      max)`` errs by ``summation_std`` (plus ``2u S`` for the exps) once for the whole row;
      each element adds its own exp and division (``2u p``) or subtractions (``u (|x - max| +
      |out|)``);
    - a cast to a dtype coarser than both its source and the emulated one: ``u_target |out|``;
    - anything else that reduces (fewer output than input elements), or a fused attention
      kernel: ``NotImplementedError`` naming it, so no reduction passes for one rounding.

    ``overrides`` gives some ops another unit roundoff (``{"bmm": TF32_UNIT_ROUNDOFF}``: the
    attention products of a GPU kernel that may run them on tensor cores); ``accumulate``, the
    precision sums accumulate at where it is finer than the results' (bf16 GEMMs and reductions
    accumulate in fp32 and round once at the end).

    Run the computation under ``sdpa_kernel(SDPBackend.MATH)`` so that attention decomposes into
    these ops (``emulated_rounding_error`` does).
    """

    def __init__(
        self,
        emulate: torch.dtype,
        generator: torch.Generator,
        overrides: dict[str, float] | None = None,
        accumulate: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.u = unit_roundoff(emulate)
        self.generator = generator
        self.overrides = overrides or {}
        self.u_acc = None if accumulate is None else unit_roundoff(accumulate)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _EXACT:
            return out
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            if isinstance(out, tuple | list) and name not in _EXACT:
                if any(isinstance(o, torch.Tensor) and o.is_floating_point() for o in out):
                    raise NotImplementedError(f"EmulatedRounding has no model for {func}")
            return out
        inplace = name.endswith("_") and not name.startswith("_")
        std = self._std(name[:-1] if inplace else name, func, args, kwargs, out)
        if std is None:
            return out
        shared = torch.zeros((), dtype=torch.float64)
        if isinstance(std, tuple):  # one error shared along the reduced dim, one per element
            row_std, row_scale, std = std
            draw = torch.randn(row_std.shape, generator=self.generator, dtype=torch.float64)
            shared = draw * row_std * row_scale
        each = torch.randn(out.shape, generator=self.generator, dtype=torch.float64)
        noise = (shared + each * std).nan_to_num(0.0, 0.0, 0.0).to(out.dtype)  # ±inf stay
        return out.add_(noise) if inplace else out + noise

    def _std(self, name, func, args, kwargs, out):
        if name in _EXACT:
            return None
        u = max(self.overrides.get(name, self.u), unit_roundoff(out.dtype))
        acc = u if self.u_acc is None else self.u_acc  # what sums accumulate at
        mag = out.detach().to(torch.float64).abs()
        if name in ("_to_copy", "to", "copy", "_copy_from"):
            src = args[1] if name == "copy" else args[0]
            if not isinstance(src, torch.Tensor) or not src.is_floating_point():
                return u * mag
            target = unit_roundoff(out.dtype)
            source = max(self.u, unit_roundoff(src.dtype))
            return target * mag if target > source else None
        if name in _MATMUL:
            biased = name.startswith("add") or name == "baddbmm"
            a, b = (args[1], args[2]) if biased else (args[0], args[1])
            alpha = abs(float(kwargs.get("alpha", 1))) if biased else 1.0
            total = out.to(torch.float64)
            if biased:
                total = total - float(kwargs.get("beta", 1)) * args[0].to(torch.float64)
            # Σt² only sizes the error: fp32 holds it well enough, at half the cost
            squares = _MATMUL[name](a.float().square(), b.float().square()).double()
            return summation_std(a.shape[-1], total, alpha**2 * squares, acc) + u * mag
        if name in ("index_add", "scatter_add"):
            dim, index, source = args[1], args[2], args[3]
            source = source.to(torch.float64)
            zeros = torch.zeros(out.shape, dtype=torch.float64)
            added = func.overloadpacket(zeros, dim, index, source)
            counts = func.overloadpacket(zeros, dim, index, torch.ones_like(source)) + 1
            squares = (out.double() - added).square() + func.overloadpacket(
                zeros, dim, index, source.square()
            )
            return summation_std(counts, out.double(), squares, acc) + u * mag
        if name == "embedding_dense_backward":  # rows of the output gradient summed per id
            grad, indices, num_weights = args[0].to(torch.float64), args[1], args[2]
            rows = grad.reshape(-1, grad.shape[-1])
            ids = indices.reshape(-1)
            zeros = torch.zeros(num_weights, grad.shape[-1], dtype=torch.float64)
            counts = torch.bincount(ids, minlength=num_weights).to(torch.float64)[:, None]
            squares = zeros.index_add(0, ids, rows.square())
            return summation_std(counts, out.double(), squares, acc) + u * mag
        if name in _SUM:
            x = args[0].to(torch.float64)
            n = max(x.numel() // max(out.numel(), 1), 1)
            scale = n if name == "mean" else 1
            total = torch.ops.aten.sum(x, *args[1:3]) if len(args) > 1 else x.sum()
            squares = torch.ops.aten.sum(x.square(), *args[1:3]) if len(args) > 1 else None
            squares = (x.square().sum() if squares is None else squares).reshape(total.shape)
            return summation_std(n, total, squares, acc).reshape(out.shape) / scale + u * mag
        if name in ("_softmax", "_safe_softmax", "_log_softmax", "logsumexp"):
            return self._normalizer_std(name, args, kwargs, out, u, acc)
        if name.startswith("_scaled_dot_product") or "attention" in name:
            raise NotImplementedError(
                f"{func} is fused: run under sdpa_kernel(SDPBackend.MATH) so it decomposes"
            )
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if any(a.numel() > out.numel() for a in inputs):
            raise NotImplementedError(f"EmulatedRounding has no model for the reduction {func}")
        return (1 if name in _ONE_ROUNDING else 2) * u * mag

    def _normalizer_std(self, name, args, kwargs, out, u, acc):
        x, dim = args[0].to(torch.float64), args[1]
        dim = dim[0] if isinstance(dim, list | tuple) else dim
        n = x.shape[dim]
        e = (x - x.amax(dim=dim, keepdim=True)).exp()  # the terms of S, each ≤ 1
        total = e.sum(dim, keepdim=True)
        relative = summation_std(n, total, e.square().sum(dim, keepdim=True), acc) / total + 2 * u
        if name == "logsumexp":
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            return (relative if keepdim else relative.squeeze(dim)), 1.0, u * out.abs()
        if name == "_log_softmax":
            spread = (x - x.amax(dim=dim, keepdim=True)).abs()
            return relative, 1.0, u * (spread + out.abs())
        return relative, out.abs(), 2 * u * out.abs()


def emulated_rounding_error(
    fn: Callable[[], torch.Tensor],
    *,
    emulate: torch.dtype = torch.float32,
    draws: int = 1,
    seed: int = 0,
    reference: torch.Tensor | None = None,
    overrides: dict[str, float] | None = None,
    accumulate: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``fn()`` (a float64 computation) plainly (unless its ``reference`` result is given)
    and ``draws`` times under ``EmulatedRounding(emulate)``; return ``(reference, deviation)``,
    ``deviation`` the largest ``|noisy - reference|`` per output element over the draws
    (float64, ``reference``'s shape).

    ``EMULATION_SAFETY * deviation.max()`` bounds the error of an ``emulate``-precision
    evaluation of the same computation. One draw is enough where there are many outputs: the
    largest deviation over them varies by about ±25% from draw to draw (the maximum of a
    Gaussian field concentrates), well inside ``EMULATION_SAFETY``."""
    with sdpa_kernel(SDPBackend.MATH):
        if reference is None:
            reference = fn().detach().to(torch.float64)
        deviation = torch.zeros_like(reference)
        for draw in range(draws):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + draw)
            with EmulatedRounding(emulate, generator, overrides, accumulate):
                noisy = fn()
            deviation = torch.maximum(deviation, (noisy.detach().double() - reference).abs())
    return reference, deviation


def emulated_std(
    fn: Callable[[], torch.Tensor],
    *,
    emulate: torch.dtype = torch.float32,
    draws: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``emulated_rounding_error``, for outputs checked one by one (a loss, its metrics, a
    gradient): ``(reference, std)``, ``std`` each output's root-mean-square deviation over
    ``draws`` draws, an estimate of its rounding error's standard deviation. ``LAMBDA * std``
    bounds an ``emulate``-precision evaluation: with 16 draws the estimate falls below half the
    true deviation with probability ~3e-4 (χ² with 16 degrees of freedom), and even then a
    Gaussian error exceeds the resulting 3σ with probability 0.3%; at the estimate's usual
    value, 6σ, with probability 2e-9."""
    with sdpa_kernel(SDPBackend.MATH):
        reference = fn().detach().to(torch.float64)
        squares = torch.zeros_like(reference)
        for draw in range(draws):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + draw)
            with EmulatedRounding(emulate, generator):
                noisy = fn()
            squares += (noisy.detach().double() - reference).square()
    return reference, (squares / draws).sqrt()


def emulated_gradients(
    loss: Callable[[], torch.Tensor],
    params: list[torch.Tensor],
    *,
    emulate: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of ``loss()`` (a float64 computation) in ``params`` and their emulated
    ``emulate``-precision deviation (``emulated_rounding_error``, one draw), per element.

    Per parameter, ``EMULATION_SAFETY * deviation.max()`` bounds how far an ``emulate``
    forward and backward may put any of its elements (a parameter's many elements make one
    draw's maximum a stable measure), and over all of them ``EMULATION_SAFETY`` times the
    deviations' 2-norm bounds the gradient's error in 2-norm (a sum of many squares
    concentrates too). Parameters without a gradient get zeros."""

    def flat() -> torch.Tensor:
        grads = torch.autograd.grad(loss(), params, allow_unused=True)
        pairs = zip(params, grads, strict=True)
        return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in pairs])

    want, deviation = emulated_rounding_error(flat, emulate=emulate)
    sizes = [p.numel() for p in params]

    def shaped(x: torch.Tensor) -> list[torch.Tensor]:
        return [v.view_as(p) for v, p in zip(x.split(sizes), params, strict=True)]

    return shaped(want), shaped(deviation)


def float64_transformers(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a transformers causal LM that computes in float64 throughout, but for
    its rope tables (fp32 by design, in our engine as well).

    transformers' RMSNorm casts its input to fp32 (to protect half precision) and back: in a
    float64 model that rounds the residual stream to fp32 at every norm. The copy runs the same
    formula without the two casts."""
    copy64 = copy.deepcopy(model).to(torch.float64)
    for module in copy64.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = functools.partial(_rms_norm_float64, module)
    return copy64


def _rms_norm_float64(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return module.weight * (hidden_states * torch.rsqrt(variance + module.variance_epsilon))


class LogprobError:
    """``error(prompt, output, temperature)``: how far a causal LM's log-probs of ``output``
    (``log_softmax(logits / temperature)``, temperature 0 counting as 1) evaluated at
    ``emulate`` precision may be from exact: ``EMULATION_SAFETY`` times the largest emulated
    deviation (``emulated_rounding_error``) of the whole log-softmax rows at those positions.
    Two such evaluations (a cache hit and a recompute, two batch shapes) differ by at most
    twice that. ``overrides``, ``accumulate``: as in ``EmulatedRounding``;
    ``round_weights``: the weights themselves are stored at ``emulate`` precision (a bf16
    engine), emulated as one rounding of each.

    ``exact(...)``: the float64 log-probs (transformers in float64) and their own error bound
    (their rope tables are fp32: emulated at fp32, the rest at float64). Cached per call."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        emulate: torch.dtype = torch.float32,
        overrides: dict[str, float] | None = None,
        accumulate: torch.dtype | None = None,
        round_weights: bool = False,
    ) -> None:
        self.model64 = float64_transformers(model)
        self.emulate, self.overrides, self.round_weights = emulate, overrides, round_weights
        self.accumulate = accumulate
        self._fp32: dict[tuple, tuple[torch.Tensor, float]] = {}
        self._exact: dict[tuple, tuple[torch.Tensor, float]] = {}

    def _logprobs(self, prompt: list[int], output: list[int], temperature: float, rounded: bool):
        ids = torch.tensor([prompt + output])
        params = dict(self.model64.named_parameters())

        def run() -> torch.Tensor:
            with torch.no_grad():  # logits of the positions that predict ``output`` only
                if rounded:  # p * 1 is exact, but emulated it is one rounding of p
                    weights = {name: p * 1.0 for name, p in params.items()}
                    out = torch.func.functional_call(
                        self.model64, weights, (ids,), {"logits_to_keep": len(output) + 1}
                    )
                else:
                    out = self.model64(ids, logits_to_keep=len(output) + 1)
            return torch.log_softmax(out.logits[0, :-1] / (temperature or 1.0), dim=-1)

        return run

    def _emulated(self, prompt: list[int], output: list[int], temperature: float):
        key = (tuple(prompt), tuple(output), temperature)
        if key not in self._fp32:
            fn = self._logprobs(prompt, output, temperature, self.round_weights)
            want, e = emulated_rounding_error(
                fn, emulate=self.emulate, overrides=self.overrides, accumulate=self.accumulate
            )
            self._fp32[key] = want, EMULATION_SAFETY * float(e.max())
        return key, *self._fp32[key]

    def __call__(self, prompt: list[int], output: list[int], temperature: float = 1.0) -> float:
        return self._emulated(prompt, output, temperature)[2]

    def rows(
        self, prompt: list[int], output: list[int], temperature: float = 1.0
    ) -> tuple[torch.Tensor, float]:
        """The float64 log-softmax rows ``[len(output), vocab]`` of the positions that predict
        ``output`` and the bound on an fp32 evaluation's distance from them (``self(...)`` plus
        the float64 evaluation's own error)."""
        _, want, bound = self._emulated(prompt, output, temperature)
        return want, bound + self.exact(prompt, output, temperature)[1]

    def exact(
        self, prompt: list[int], output: list[int], temperature: float = 1.0
    ) -> tuple[torch.Tensor, float]:
        key, want, _ = self._emulated(prompt, output, temperature)
        if key not in self._exact:
            fn = self._logprobs(prompt, output, temperature, False)
            _, e64 = emulated_rounding_error(fn, emulate=torch.float64, reference=want)
            picked = want.gather(1, torch.tensor(output).view(-1, 1)).view(-1)
            self._exact[key] = picked, EMULATION_SAFETY * float(e64.max())
        return self._exact[key]
