"""Run the ``agentrl`` command as a user does: a fresh interpreter, offline, a wide terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = REPO, columns: int = 200) -> subprocess.CompletedProcess:
    """``python -m agentrl.cli ARGS`` in ``cwd`` (the checkout by default), output captured."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
