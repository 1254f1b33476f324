"""Per-request sampling with unfiltered logprobs.

The logprob recorded for a sampled token is ``log_softmax(logits / temperature)`` over the full
vocabulary, taken *before* top-k / top-p / min-p filtering (what SGLang returns and what the
trainer recomputes). ``temperature == 0`` means greedy (argmax, lowest id on ties), and so
does one below ``GREEDY_BELOW`` (as in SGLang); its logprob is then ``log_softmax(logits)``,
i.e. temperature 1 for the logprob only.

A sampled token is drawn by inverse CDF from one uniform number of the request's own
``torch.Generator`` (``draw_uniform``), so a seed gives the same tokens whatever other requests
share the batch, whether the step samples its rows one by one on the CPU (``sample_token``) or
all at once where the logits are (``sample_rows``, the engine's path on a GPU): both run the same
operations on a row (up to the last-bit differences a device's reductions may have).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from agentrl._errors import EngineError, GenerationError
from agentrl._types import GREEDY_BELOW, SamplingParams


def effective_sampling(sampling: SamplingParams) -> SamplingParams:
    """``sampling`` as the engine runs it: a temperature in ``(0, GREEDY_BELOW)`` is 0."""
    if 0 < sampling.temperature < GREEDY_BELOW:
        return msgspec.structs.replace(sampling, temperature=0.0)
    return sampling


def check_sampling(sampling: SamplingParams) -> None:
    """Raise ``EngineError`` naming the first invalid field."""
    if sampling.max_new_tokens < 0:
        raise EngineError(f"max_new_tokens must be >= 0, got {sampling.max_new_tokens}")
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise EngineError(f"temperature must be finite and >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise EngineError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k != -1 and sampling.top_k < 1:
        raise EngineError(f"top_k must be -1 (off) or >= 1, got {sampling.top_k}")
    if not 0 <= sampling.min_p <= 1:
        raise EngineError(f"min_p must be in [0, 1], got {sampling.min_p}")
    if any(not s for s in sampling.stop):
        raise EngineError("stop strings must be non-empty")


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``; ``None`` draws a seed from ``os.urandom``."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    generator = torch.Generator()
    try:
        generator.manual_seed(seed)
    except (RuntimeError, ValueError, OverflowError) as exc:
        raise EngineError(f"seed {seed} is out of range for torch.Generator") from exc
    return generator


def draw_uniform(generator: torch.Generator) -> float:
    """The one uniform number in ``[0, 1)`` a sampled token consumes from its request's
    generator (float64, 53 random bits)."""
    return float(torch.rand((), dtype=torch.float64, generator=generator, device="cpu"))


def sample_token(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Sample one token from ``logits`` (shape ``[vocab]``, float32).

    Returns ``(token_id, logprob)`` with the unfiltered logprob described in the module docstring.
    Raises ``GenerationError`` when the logits are not finite.
    """
    if sampling.temperature == 0:
        token = int(torch.argmax(logits))
        logprob = float(torch.log_softmax(logits, dim=-1)[token])
    else:
        ids, logprobs = sample_rows(logits.view(1, -1), [sampling], [draw_uniform(generator)])
        token, logprob = ids[0], logprobs[0]
    check_logprob(token, logprob)
    return token, logprob


def check_logprob(token: int, logprob: float) -> None:
    """``GenerationError`` when a sampled token's logprob is not finite (the logits were
    not)."""
    if not math.isfinite(logprob):
        raise GenerationError(f"non-finite logprob {logprob} for token {token}")


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Greedy picks for every row of ``logits`` (``[R, vocab]`` float32, on any device) at
    once: the same ids and logprobs as ``sample_token`` at temperature 0 row by row (argmax,
    lowest id on ties; ``log_softmax`` of the row at the id), computed where the logits are, and
    read back in one device-to-host copy of ``2 * R`` numbers (float64 holds both the int ids
    and the float32 logprobs exactly). Finiteness is not checked (``check_logprob``)."""
    return read_back(*greedy_picks(logits))


def greedy_picks(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_tokens`` left on the logits' device: ids ``[R]`` int64, logprobs ``[R]``."""
    ids = torch.argmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids.view(-1, 1)).view(-1)
    return ids, logprobs


def read_back(ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Device ids and logprobs as Python lists, in one copy of ``2 * R`` float64 numbers."""
    if not len(ids):
        return [], []
    packed = torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)]).cpu()
    host_ids, host_logprobs = packed.tolist()
    return [int(i) for i in host_ids], host_logprobs


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[list[int], list[float]]:
    """Sample a token for every row of ``logits`` (``[R, vocab]`` float32, on any device) at
    once, row ``r`` with ``params[r]`` (temperature > 0) and the uniform ``uniforms[r]``
    (``draw_uniform``); ids and unfiltered logprobs, read back in one copy (``read_back``).
    Finiteness is not checked (``check_logprob``)."""
    return read_back(*sampled_picks(logits, params, uniforms))


def sampled_picks(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_rows`` left on the logits' device: ids ``[R]`` int64, logprobs ``[R]`` float32.

    Inverse CDF: a row's token is the first whose running sum of weights exceeds ``u`` times
    their total, the sums in float64 (float32 sums would leave tokens below ~1e-7 undrawable
    late in the vocabulary). A row without top-k and top-p sums its probabilities (those below
    ``min_p`` times the largest zeroed) in vocabulary order. A row with either orders them by
    probability, descending, ties by lower id (its ``top_k`` candidates from ``topk``, or the
    whole vocabulary sorted when it has no top-k), keeps its ``top_k``, then the tokens whose
    kept mass above them is below ``top_p`` of the kept total, then those of at least ``min_p``
    times the first kept one, and sums in that order. Which of the two a row takes depends on
    its own parameters only, so a row draws the same token in any batch. A token of zero
    weight is never drawn.
    """
    rows, vocab = logits.shape
    device = logits.device
    ids = torch.empty(rows, dtype=torch.long, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    sort = [0 < p.top_k < vocab or p.top_p < 1 for p in params]
    for filtered in (False, True):
        members = [r for r in range(rows) if sort[r] == filtered]
        if not members:
            continue
        top_k = [params[r].top_k if 0 < params[r].top_k < vocab else vocab for r in members]
        settings = [
            [params[r].temperature, params[r].top_p, params[r].min_p, uniforms[r], r, k]
            for r, k in zip(members, top_k, strict=True)
        ]
        table = torch.tensor(settings, dtype=torch.float64, device="cpu").to(device)  # one copy
        temperature = table[:, 0:1].float()
        top_p, min_p, uniform = table[:, 1:2], table[:, 2:3], table[:, 3:4]
        index, limit = table[:, 4].long(), table[:, 5:6]
        chosen = logits if len(members) == rows else logits.index_select(0, index)
        row_logprobs = torch.log_softmax(chosen / temperature, dim=-1)
        weights = row_logprobs.exp()
        order = None
        if filtered:  # ordered in float32 (exact: the values only move), summed in float64
            weights, order = _ordered(weights, max(top_k))
            weights = weights.double()
            ranks = torch.arange(weights.shape[1], device=device, dtype=torch.float64)
            weights = torch.where(ranks < limit, weights, 0.0)
            mass = torch.cumsum(weights, dim=-1)
            before = (mass - weights) / mass[:, -1:]  # the kept mass strictly above each
            weights = torch.where((before < top_p) | (top_p >= 1), weights, 0.0)
            peak = weights[:, :1]
        else:
            weights = weights.double()
            peak = weights.max(-1, keepdim=True).values
        weights = torch.where((weights >= min_p * peak) | (min_p <= 0), weights, 0.0)
        cdf = torch.cumsum(weights, dim=-1)
        total = cdf[:, -1:]
        # u < 1, but u * total may round up to total: stay below it
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        pick = torch.searchsorted(cdf, target, right=True)
        # a parallel scan may sum the zero tail past the last kept token an ulp higher: never
        # land there
        width = weights.shape[1]
        last = width - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(-1, keepdim=True)
        pick = torch.minimum(pick, last)
        token = pick if order is None else order.gather(1, pick)
        ids.index_copy_(0, index, token.view(-1))
        logprobs.index_copy_(0, index, row_logprobs.gather(1, token).view(-1))
    return ids, logprobs


def _ordered(weights: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``weights`` (every one when ``k`` is the row length),
    descending, ties by lower id, and their ids: ``(values [R, k], ids [R, k])``. ``topk``
    first when ``k`` is smaller (a sort of the vocabulary costs ~15x a top-50 on a CPU), its
    candidates then put in that order, so either way a row gets the same order."""
    if k < weights.shape[1]:
        values, ids = torch.topk(weights, k, dim=-1, sorted=False)
        # ``topk`` keeps any of the members of a tie at the k-th value: take them all (a tie
        # of positive weights; zero weights are never drawn, their order does not matter), so
        # that the lower ids come first below, whatever ``topk`` kept
        kth = values.min(dim=-1, keepdim=True).values
        tied = (weights == kth) & (kth > 0)
        left_out = tied.sum(dim=-1) - (values == kth).sum(dim=-1)
        more = int(left_out.max())
        if more > 0:
            values, ids = torch.topk(weights, min(k + more, weights.shape[1]), sorted=False)
        ids, by_id = torch.sort(ids, dim=-1)
        values = values.gather(1, by_id)
    else:
        values, ids = weights, None
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    if ids is None:
        return values, order
    return values[:, :k], ids.gather(1, order)[:, :k]


def match_stop_string(tokenizer: Any, output: Sequence[int], stop: Sequence[str]) -> str | None:
    """The stop string that ends ``output`` now (the one that starts first, as in the decoded
    text), or None. Checked after every sampled token, so an earlier match would already have
    stopped the request: a new match ends in the last token's text and is found in the text of
    the last ``4 * longest + 8`` tokens (a token is at least a quarter of a character, for a
    4-byte character split into byte tokens). Each check costs the stop strings' length, not
    the output's."""
    longest = max(map(len, stop))
    text = tokenizer.decode(output[-(4 * longest + 8) :], skip_special_tokens=False)
    found = [(at, i) for i, s in enumerate(stop) if (at := text.find(s)) >= 0]
    return stop[min(found)[1]] if found else None
