"""Shared fixtures: the tiny-random model folder and a reference model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
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


Recompute = Callable[[list[int], list[int], float], tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="session")
def recompute(reference_model: PreTrainedModel) -> Recompute:
    """``recompute(prompt, output, temperature)``: a plain forward over ``prompt + output``.

    Returns (logprobs of ``output``, float32 ``[n]``; greedy ids at those positions, int64
    ``[n]``), logprobs being ``log_softmax(logits / temperature)`` (temperature 0 counts as 1).
    """

    def run(
        prompt: list[int], output: list[int], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = reference_model(ids).logits[0, len(prompt) - 1 : -1].float()
        logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        picked = logprobs.gather(1, torch.tensor(output).view(-1, 1)).view(-1)
        return picked, logits.argmax(dim=-1)

    return run
