"""Per-token log-probabilities and entropies from hidden states, never with the full logits.

Full logits are ``N × V``: 8k tokens × 49k vocabulary is 1.6 GB in fp32 per copy, and autograd
would keep several copies. ``agentrl.kernels.fused_logprob_entropy`` computes them without: on a
GPU the fused Triton kernel (logits only tile by tile in registers), elsewhere the chunked torch
path (at most ``chunk_size × V`` logits at a time, forward and backward). ``kernels`` chooses:
``auto`` (Triton on CUDA, torch on CPU), ``triton`` or ``torch``.

Math, with ``z = h Wᵀ / τ`` and ``p = softmax(z)``::

    logprob = z[y] - logsumexp(z)                 d/dz = onehot(y) - p
    entropy = -Σ_j p_j log p_j                    d/dz = -p ⊙ (log p + entropy)

The logprob is ``log_softmax(logits / temperature)`` over the full vocabulary, exactly what the
engines record (DESIGN.md, "Logprobs and sampling").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentrl.kernels import fused_logprob_entropy

from ._batch import PackedBatch, model_inputs


class TokenLogprobs(NamedTuple):
    """Per-token results, both ``[N]`` (or ``[B, T]`` from ``causal_lm_token_logprobs``) in the
    compute dtype (float32, or float64 for float64 inputs); 0 where masked."""

    logprobs: torch.Tensor
    """log π(target | context) at temperature τ; always ≤ 0."""
    entropy: torch.Tensor
    """Entropy of the temperature-τ next-token distribution, in nats."""


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: torch.Tensor | None = None,
    kernels: str = "auto",
) -> TokenLogprobs:
    """Log-prob of ``targets`` and entropy at every position, never holding more than
    ``chunk_size × V`` logits (forward and backward).

    ``hidden [N, H]`` (the final, normed hidden states), ``lm_head_weight [V, H]``,
    ``targets [N]`` int64, ``mask [N]`` bool (optional): masked positions are not computed,
    return 0 and get no gradient. Differentiable in ``hidden`` and ``lm_head_weight``; the
    arithmetic runs in float32 (float64 for float64 inputs) whatever the working dtype.
    ``kernels``: ``auto`` | ``triton`` | ``torch`` (see the module docs).
    """
    lp, ent = fused_logprob_entropy(
        hidden,
        lm_head_weight,
        targets,
        temperature,
        mask,
        backend=kernels,
        chunk_size=chunk_size,
    )
    return TokenLogprobs(lp, ent)


def causal_lm_token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    only_loss_tokens: bool = True,
    kernels: str = "auto",
) -> TokenLogprobs:
    """Run an HF causal LM's decoder on ``batch`` and score ``batch.targets`` chunked: results
    are ``[B, T]`` aligned with the batch (0 where not computed). With ``only_loss_tokens``
    only positions in ``batch.loss_mask`` are scored (all of them otherwise).

    Under DeepSpeed ZeRO-3 the LM head's weight is partitioned outside its module's forward:
    gather it (or register it as an external parameter) before calling this.
    """
    decoder = model.get_decoder()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    dtype = next(model.parameters()).dtype
    hidden = decoder(**model_inputs(batch, dtype=dtype)).last_hidden_state
    b, t, h = hidden.shape
    out = token_logprobs_and_entropy(
        hidden.reshape(b * t, h),
        head.weight,
        batch.targets.reshape(-1),
        temperature=temperature,
        chunk_size=chunk_size,
        mask=batch.loss_mask.reshape(-1) if only_loss_tokens else None,
        kernels=kernels,
    )
    return TokenLogprobs(out.logprobs.view(b, t), out.entropy.view(b, t))
