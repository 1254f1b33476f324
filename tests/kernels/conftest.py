"""Fixtures of the kernel tests (the device parameters live in tests/kernel_devices.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen(rng):
    """A torch generator seeded from the test's (reported) seed: fresh inputs every run."""
    g = torch.Generator()
    g.manual_seed(rng.randrange(2**63))
    return g
