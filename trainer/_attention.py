"""Variable-length attention for packed micro-batches, on any device (``"agentrl_varlen"``).

A packed row holds several sequences. A dense block-causal mask (``block_causal_mask``) keeps
them apart but costs ``T² `` per layer in time and, on CPU, in memory (SDPA's math path keeps
``heads × T × T`` probabilities per layer for the backward: 600 MB per layer at T = 4096 for
SmolLM2). This attention runs each sequence on its own with ``is_causal`` SDPA instead (the
memory-efficient kernel, no mask, ``Σ L_i²`` work), like flash-attention's varlen API: the
sequence boundaries arrive as ``cu_seq_lens_q`` (HF's ``FlashAttentionKwargs`` name, passed
through the decoder's ``**kwargs`` to every attention call).

The shared-prefix layout (``_prefix``) adds ``segment_parents``: a suffix segment attends to
its group's prefix segment in full, then causally to itself (a small ``[q, prefix + q]`` mask).

Without ``cu_seq_lens_q`` it is plain causal attention over each row: exact for right-padded
rows on real positions (a position never attends to the padding after it); padding positions
carry no loss.

``use_varlen_attention(model)`` registers the implementation with transformers
(``AttentionInterface`` and a mask function that builds no mask) and switches the model to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "agentrl_varlen"


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    segment_parents: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface signature: ``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]``
    → ``([B, T, H, D], None)``. ``cu_seq_lens_q [S + 1]`` (B must be 1): segment starts in
    the packed row; ``segment_parents [S]`` (shared-prefix layout): the segment whose keys a
    segment sees before its own (-1: none)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    p = dropout if module.training else 0.0
    if cu_seq_lens_q is None:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, dropout_p=p, scale=scaling
        )
    else:
        if query.shape[0] != 1:
            raise ValueError(f"varlen attention needs one packed row, got {query.shape[0]}")
        bounds = cu_seq_lens_q.tolist()
        parents = segment_parents.tolist() if segment_parents is not None else None
        parts = []
        for j, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if e <= s:
                continue
            parent = parents[j] if parents is not None else -1
            if parent < 0:
                parts.append(
                    F.scaled_dot_product_attention(
                        query[:, :, s:e],
                        key[:, :, s:e],
                        value[:, :, s:e],
                        is_causal=True,
                        dropout_p=p,
                        scale=scaling,
                    )  # fmt: skip
                )
                continue
            ps, pe = bounds[parent], bounds[parent + 1]
            k = torch.cat([key[:, :, ps:pe], key[:, :, s:e]], dim=2)
            v = torch.cat([value[:, :, ps:pe], value[:, :, s:e]], dim=2)
            parts.append(
                F.scaled_dot_product_attention(
                    query[:, :, s:e],
                    k,
                    v,
                    attn_mask=_after_prefix(e - s, pe - ps, query.device),
                    dropout_p=p,
                    scale=scaling,
                )  # fmt: skip
            )
        out = torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _after_prefix(q_len: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    """``[q, prefix + q]`` bool: every query sees the whole prefix, then itself causally."""
    cols = torch.arange(prefix_len + q_len, device=device)
    rows = torch.arange(q_len, device=device)[:, None]
    return (cols < prefix_len) | (cols - prefix_len <= rows)


def _no_mask(*args, **kwargs) -> None:
    return None


def use_varlen_attention(model: torch.nn.Module) -> None:
    """Register ``agentrl_varlen`` with transformers (idempotent) and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    model.set_attn_implementation(NAME)  # type: ignore[operator]


def varlen_kwargs(
    cu_seqlens: torch.Tensor, parents: torch.Tensor | None = None
) -> dict[str, torch.Tensor | int]:
    """The decoder keyword arguments that carry a packed row's segments to the attention
    (``PackedBatch.attention_segments``)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    out: dict[str, torch.Tensor | int] = {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": longest,
        "max_length_k": longest,
    }
    if parents is not None:
        out["segment_parents"] = parents
    return out
