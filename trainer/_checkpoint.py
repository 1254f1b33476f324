"""Loop checkpoints, written atomically, and export to an HF safetensors folder.

A checkpoint is a folder ``ROOT/step-00000012`` holding the DeepSpeed checkpoints of the trained
engines (``policy/``, ``critic/``: model, optimizer and LR-schedule state, ZeRO partitions per
rank), ``rng-rank{r}.pt`` (python, numpy, torch and CUDA generator states of each rank) and
``state.json`` (``LoopState``: step, policy version, data cursor, tokenizer fingerprint, config
hash, the in-flight rule and the run files' lengths).

Atomicity: everything is written into ``ROOT/.tmp-step-…`` (files fsynced), then the folder is
renamed to ``step-…`` in one ``rename``, and only then are older checkpoints pruned (``keep``).
A crash at any moment leaves either the previous checkpoints alone or the new one complete;
``latest_checkpoint`` ignores ``.tmp-*`` leftovers (the next save removes them).

The in-flight rule (``IN_FLIGHT_RULE``): the loop is synchronous, so no trajectory is in flight
at a checkpoint; whatever was sampled after it (trajectories, ledger lines) is cut off on resume
(the files are truncated to the lengths recorded here) and sampled again with the same seeds.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl._errors import AgentRLError

from ._dist import barrier, rank_world

IN_FLIGHT_RULE = "discard-after-checkpoint"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(AgentRLError):
    """A checkpoint is missing, incomplete, or does not belong to this run's configuration."""


@dataclass
class LoopState:
    """What a resumed loop needs besides the engines' state."""

    step: int
    """Completed learner steps."""
    policy_version: int
    """The version the engines were last given (the weights in this checkpoint)."""
    data_cursor: int
    """Training tasks consumed so far: the next step starts at this index of the task stream."""
    tokenizer_fingerprint: str
    config_hash: str
    model_path: str
    in_flight: str = IN_FLIGHT_RULE
    file_lengths: dict[str, int] = field(default_factory=dict)
    """Byte length of each append-only run file (``ledger.jsonl``, ...) at checkpoint time."""
    created: float = 0.0
    tasks: dict[str, Any] = field(default_factory=dict)
    """The loop's task accounting (``agentrl.loop``'s ``TaskLedger.state()``): which task slots
    were settled; empty in checkpoints that predate it (``data_cursor`` then says it all)."""


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(root: str | os.PathLike[str], learner: Any, state: LoopState, *, keep: int):
    """Write ``learner`` (anything with ``save(directory)``) and ``state`` as
    ``root/step-{state.step}`` atomically; keep the newest ``keep`` checkpoints. Every rank
    calls it (each saves its ZeRO partitions). Returns the checkpoint folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, state.step)
    tmp = root / f".tmp-{final.name}"
    if rank_world()[0] == 0:
        for stale in root.glob(".tmp-*"):  # an earlier crash's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier()
    learner.save(str(tmp))
    torch.save(rng_state(), tmp / f"rng-rank{rank_world()[0]}.pt")
    barrier()
    if rank_world()[0] == 0:
        state.created = time.time()
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (a resumed run): swap, never a partial state
            old = root / f".tmp-old-{final.name}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(root)
        for old_dir in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old_dir, ignore_errors=True)
    barrier()
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "state.json").is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_state(path: str | os.PathLike[str]) -> LoopState:
    file = Path(path) / "state.json"
    if not file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no state.json)")
    return LoopState(**json.loads(file.read_text()))


def load_checkpoint(
    path: str | os.PathLike[str],
    learner: Any,
    *,
    tokenizer_fingerprint: str,
    config_hash: str,
) -> LoopState:
    """Check that the checkpoint belongs to this run (same tokenizer, same configuration hash),
    then restore ``learner`` (``load(directory, version)``) and this rank's RNG states."""
    state = read_state(path)
    verify_state(state, path, tokenizer_fingerprint=tokenizer_fingerprint, config_hash=config_hash)
    learner.load(str(path), state.policy_version)
    rng_file = Path(path) / f"rng-rank{rank_world()[0]}.pt"
    if not rng_file.is_file():
        raise CheckpointError(f"{rng_file} is missing (was the run saved with fewer ranks?)")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def verify_state(
    state: LoopState, path: str | os.PathLike[str], *, tokenizer_fingerprint: str, config_hash: str
) -> None:
    """Refuse a checkpoint of another tokenizer or configuration (``CheckpointError``)."""
    if state.tokenizer_fingerprint != tokenizer_fingerprint:
        raise CheckpointError(
            f"tokenizer fingerprint mismatch: checkpoint {path} was trained with tokenizer "
            f"{state.tokenizer_fingerprint}, this run's tokenizer is {tokenizer_fingerprint}; "
            "token ids would not mean the same thing — resume with the original model/tokenizer"
        )
    if state.config_hash != config_hash:
        raise CheckpointError(
            f"configuration mismatch: checkpoint {path} has config hash {state.config_hash}, "
            f"this run's is {config_hash} (only max_steps, checkpointing, logging and eval "
            "settings may change on resume)"
        )


def consolidated_state_dict(path: str | os.PathLike[str], tag: str = "policy"):
    """The policy's full fp32 weights under HF names from a checkpoint folder, without
    starting DeepSpeed (``get_fp32_state_dict_from_zero_checkpoint``; ``lm.`` stripped)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if not (Path(path) / tag).is_dir():
        raise CheckpointError(f"{path} has no {tag!r} DeepSpeed checkpoint")
    state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    return {k.removeprefix("lm."): v for k, v in state.items()}


def _is_weights_file(name: str) -> bool:
    # weights and the model cache's manifest (its checksums describe the original weights)
    return name.endswith((".safetensors", ".bin", ".index.json")) or name == "agentrl_model.json"


def export_checkpoint(
    path: str | os.PathLike[str], out: str | os.PathLike[str], *, model_path: str | None = None
) -> Path:
    """Write the checkpoint's policy as an HF folder ``out`` (``model.safetensors`` in fp32,
    config and tokenizer copied from the run's model folder); loadable by
    ``AutoModelForCausalLM.from_pretrained`` and by the embedded engine."""
    from safetensors.torch import save_file

    state = read_state(path)
    source = Path(model_path or state.model_path)
    weights = consolidated_state_dict(path)
    config = json.loads((source / "config.json").read_text())
    if config.get("tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().contiguous().clone() for k, v in weights.items()},
        str(tmp / "model.safetensors"),
        metadata={"format": "pt", "policy_version": str(state.policy_version)},
    )
    for file in source.iterdir():
        if file.is_file() and not _is_weights_file(file.name):
            shutil.copy2(file, tmp / file.name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
