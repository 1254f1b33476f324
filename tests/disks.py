"""A small tmpfs for full-disk tests: mounted in a test's folder, unmounted after."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(parent: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"2m"``) under ``parent``; the test is skipped where one cannot
    be mounted (it needs root). Unmounted lazily after, so a file a failed writer still holds
    open does not keep it mounted."""
    mount = parent / f"disk-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
