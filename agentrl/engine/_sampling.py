"""Per-request sampling with unfiltered logprobs.

The logprob recorded for a sampled token is ``log_softmax(logits / temperature)`` over the full
vocabulary, taken *before* top-k / top-p / min-p filtering (what SGLang returns and what the
trainer recomputes). ``temperature == 0`` means greedy (argmax, lowest id on ties); its logprob is
then ``log_softmax(logits)``, i.e. temperature 1 for the logprob only.

Each request samples with its own ``torch.Generator`` and only ever looks at its own logits row,
so a seed gives the same tokens whatever other requests share the batch (up to the last-bit fp32
differences batching can cause in the logits themselves).
"""

from __future__ import annotations

import math
import os

import torch

from agentrl._errors import EngineError
from agentrl._types import SamplingParams


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


def sample_token(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Sample one token from ``logits`` (shape ``[vocab]``, float32).

    Returns ``(token_id, logprob)`` with the unfiltered logprob described in the module docstring.
    Raises ``EngineError`` when the logits are not finite.
    """
    if sampling.temperature == 0:
        token = int(torch.argmax(logits))
        logprob = float(torch.log_softmax(logits, dim=-1)[token])
    else:
        logprobs = torch.log_softmax(logits / sampling.temperature, dim=-1)
        token = _sample_filtered(logprobs.exp(), sampling, generator)
        logprob = float(logprobs[token])
    check_logprob(token, logprob)
    return token, logprob


def check_logprob(token: int, logprob: float) -> None:
    """``EngineError`` when a sampled token's logprob is not finite (the logits were not)."""
    if not math.isfinite(logprob):
        raise EngineError(f"non-finite logprob {logprob} for token {token}")


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Greedy picks for every row of ``logits`` (``[R, vocab]`` float32, on any device) at
    once: the same ids and logprobs as ``sample_token`` at temperature 0 row by row (argmax,
    lowest id on ties; ``log_softmax`` of the row at the id), computed where the logits are, and
    read back in one device-to-host copy of ``2 * R`` numbers (float64 holds both the int ids
    and the float32 logprobs exactly). Finiteness is not checked (``check_logprob``)."""
    if not len(logits):
        return [], []
    ids = torch.argmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids.view(-1, 1)).view(-1)
    packed = torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)]).cpu()
    host_ids, host_logprobs = packed.tolist()
    return [int(i) for i in host_ids], host_logprobs


def _sample_filtered(
    probs: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> int:
    """Draw from ``probs`` (``[vocab]``) after top-k, then top-p (renormalized), then min-p."""
    top_k, top_p, min_p = sampling.top_k, sampling.top_p, sampling.min_p
    vocab = probs.shape[-1]
    if top_k == -1 and top_p >= 1:
        if min_p > 0:
            probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        return int(torch.multinomial(probs, 1, generator=generator))
    if 0 < top_k < vocab:
        values, indices = torch.topk(probs, top_k)  # sorted, descending
    else:
        values, indices = torch.sort(probs, descending=True)
    if top_p < 1:
        values = values / values.sum()
        before = torch.cumsum(values, dim=0) - values  # mass strictly above each token
        values = torch.where(before < top_p, values, 0.0)
    if min_p > 0:
        values = torch.where(values >= min_p * values[0], values, 0.0)
    return int(indices[torch.multinomial(values, 1, generator=generator)])
