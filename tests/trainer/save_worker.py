"""Worker for ``test_checkpoint_ranks``: every rank calls ``save_checkpoint`` with a learner
that writes one file per rank; ``FAIL`` names the rank and the part of the save that fails
there (``write:R``: rank R's own files, a full disk; ``manifest``: rank 0's manifest).
Each rank writes what happened to ``OUT.rankR.json``. ``python save_worker.py OUT ROOT FAIL``
under torchrun (gloo)."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import torch


class Learner:
    def __init__(self, fail_here: bool) -> None:
        self.fail_here = fail_here

    def save(self, directory: str) -> None:
        rank = torch.distributed.get_rank()
        if self.fail_here:
            raise OSError(errno.ENOSPC, "No space left on device", directory)
        Path(directory, f"part-{rank}.bin").write_bytes(b"w" * 1000)


def main() -> None:
    out, root, fail = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    import agentrl.trainer._checkpoint as checkpoint
    from agentrl.trainer import LoopState, save_checkpoint

    if fail == "manifest" and rank == 0:

        def broken(folder):  # noqa: ANN001, ANN202
            raise OSError(errno.ENOSPC, "No space left on device", str(folder))

        checkpoint.write_manifest = broken
    learner = Learner(fail == f"write:{rank}")
    state = LoopState(1, 1, 2, "tok", "cfg", "")
    try:
        save_checkpoint(root, learner, state, keep=2)
        outcome = {"saved": True}
    except Exception as exc:  # what each rank raised
        outcome = {"saved": False, "type": type(exc).__name__, "message": str(exc)}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(outcome))
    torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
