"""Loading a ZeRO-3 checkpoint at another world size.

DeepSpeed's ZeRO checkpoints hold each rank's partition of the flat fp32 weights and Adam
moments, so they load only at the world size that wrote them. DeepSpeed's universal checkpoint
is the world-size-independent form: ``ds_to_universal`` gathers every parameter's fp32 weights
and optimizer moments under its name (``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``), and a
ZeRO-3 engine with ``load_universal_checkpoint`` set re-partitions them for its own ranks at load
time. Checkpoints are saved in the ordinary (fast, per-rank) form; the conversion runs only when
a checkpoint is loaded at another world size, into a temporary folder beside it that is removed
after the load.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ._manifest import CheckpointError

_RNG_FILE = re.compile(r"^rng-rank(\d+)\.pt$")
TAGS = ("policy", "critic")


def saved_world_size(path: Path, recorded: int) -> int:
    """The world size that wrote the checkpoint: ``recorded`` (``LoopState.world_size``) or,
    for checkpoints that did not record it, the number of per-rank RNG files."""
    if recorded > 0:
        return recorded
    ranks = [int(m.group(1)) for p in path.iterdir() if (m := _RNG_FILE.match(p.name))]
    if not ranks:
        raise CheckpointError(f"{path} has no rng-rank*.pt file (an incomplete checkpoint)")
    return max(ranks) + 1


def to_universal(path: Path, out: Path) -> None:
    """Convert each engine's ZeRO checkpoint under ``path`` (``policy/``, ``critic/``) into a
    universal checkpoint under ``out`` (same tag names)."""
    for tag in TAGS:
        if not (path / tag).is_dir():
            continue
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                   "--input_folder", str(path / tag), "--output_folder", str(out / tag),
                   "--num_extract_workers", "1", "--num_merge_workers", "1"]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CheckpointError(
                f"converting {path / tag} to a universal checkpoint (to load it at another "
                f"world size) failed with exit code {proc.returncode}: "
                f"{proc.stderr.strip()[-2000:]}"
            )
