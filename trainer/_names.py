"""The names the config chooses among: loss families, aggregations, KL estimators (torch-free,
so that a config is checked before torch loads; ``_losses`` and ``_kl`` implement them)."""

from __future__ import annotations

from typing import Literal

Surrogate = Literal["clip", "gspo", "cispo"]
"""The loss families ``policy_loss`` computes (see its docstring)."""
Aggregation = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
"""How a loss is reduced over tokens and sequences (see ``aggregate``)."""
KLEstimator = Literal["k1", "k2", "k3"]
"""Schulman's single-sample KL estimators (see ``_kl``)."""
