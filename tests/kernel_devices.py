"""Where kernel tests run: on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py when there is no GPU; small shapes) and on a CUDA GPU (``gpu`` marker)."""

from __future__ import annotations

import pytest

from agentrl.kernels import interpreting, triton_installed

needs_triton = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not (triton_installed() and interpreting()),
            reason="CPU kernel tests need Triton's interpreter (TRITON_INTERPRET=1)",
        ),
        id="interpreter",
    ),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, needs_triton],
        id="cuda",
    ),
]
