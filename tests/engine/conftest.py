"""Shared fixtures: the tiny-random model folder and a reference model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from numerics import LogprobError
from transformers import AutoModelForCausalLM, PreTrainedModel

from agentrl._models import resolve_model


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return resolve_model("tiny-random")


@pytest.fixture(scope="session")
def reference_model(tiny_dir: Path) -> PreTrainedModel:
    """tiny-random loaded separately, for plain full-sequence forwards."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def logprob_error(reference_model: PreTrainedModel) -> LogprobError:
    return LogprobError(reference_model)


Recompute = Callable[[list[int], list[int], float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="session")
def recompute(reference_model: PreTrainedModel, logprob_error: LogprobError) -> Recompute:
    """``recompute(prompt, output, temperature)``: a plain forward over ``prompt + output``.

    Returns (the float64 logprobs of ``output`` ``[n]``; greedy ids at those positions from an
    fp32 forward, int64 ``[n]``; the bound on an fp32 evaluation's distance from those
    logprobs), logprobs being ``log_softmax(logits / temperature)`` (temperature 0 counts as 1).
    """

    def run(
        prompt: list[int], output: list[int], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = reference_model(ids).logits[0, len(prompt) - 1 : -1].float()
        want, own_error = logprob_error.exact(prompt, output, temperature)
        return want, logits.argmax(dim=-1), logprob_error(prompt, output, temperature) + own_error

    return run
