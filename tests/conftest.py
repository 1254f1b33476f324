"""Shared fixtures: the real SmolLM2 tokenizer (via the tiny-random model folder)."""

from __future__ import annotations

import os
import random
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/fakes.py

# Triton decides at decoration time whether a kernel is compiled or interpreted, so the switch
# must be set before anything imports agentrl.kernels: without a GPU, kernels run in Triton's
# interpreter (numpy on CPU) when a test asks for the Triton backend explicitly.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _tiny_path():
    from agentrl._models import resolve_model

    return resolve_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_model_path():
    return _tiny_path()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


@pytest.fixture(scope="session")
def chatml(tokenizer):
    from agentrl.formats import get_format

    return get_format("chatml-hermes", tokenizer)


@pytest.fixture
def rng(request):
    """A seeded RNG whose seed appears in the failure report."""
    seed = int(os.environ.get("AGENTRL_TEST_SEED", random.randrange(2**32)))
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed} (rerun with AGENTRL_TEST_SEED={seed})")
    return random.Random(seed)


@pytest.fixture
def chromium():
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        pytest.skip("Debian chromium is not installed (scripts/test installs it)")
    return path


@pytest.fixture
def agentrl_cli():
    return [sys.executable, "-m", "agentrl.cli"]
