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

Verification: the save ends with ``manifest.json`` (every file's size and content hash,
``_manifest``). A checkpoint is trusted only after ``verify_checkpoint`` found every file
present with its size and hash, and ``state.json`` complete. ``find_intact_checkpoint`` walks the
checkpoints newest first and returns the newest intact one with the reasons it skipped each newer
one; with none intact it raises ``CheckpointError`` naming each broken file. A checkpoint saved
without a manifest (by an older agentrl: ``state.json`` has no ``checkpoint_format``) is accepted
after a structural check only, with a warning. A failure while loading is a
``CheckpointError`` naming the checkpoint, never a raw traceback.

Another world size: a checkpoint saved by N ranks loads at M ≠ N through DeepSpeed's universal
checkpoint, converted at load time (``_reshard``); rank ``r`` takes saved rank ``r mod N``'s RNG
states.

A full disk: a save that fails for lack of space (ENOSPC) removes its ``.tmp-step-…`` folder
and raises ``CheckpointError`` with the free space and the room ``keep`` needs (one checkpoint's
size × (keep + 1): the kept ones plus the one being written before the oldest is pruned).

The in-flight rule (``IN_FLIGHT_RULE``): the loop is synchronous, so no trajectory is in flight
at a checkpoint; whatever was sampled after it (trajectories, ledger lines) is cut off on resume
(the files are truncated to the lengths recorded here) and sampled again with the same seeds.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
import traceback
import typing
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ._dist import barrier, rank_world
from ._manifest import MANIFEST, CheckpointError, check_manifest, write_manifest
from ._reshard import saved_world_size, to_universal

IN_FLIGHT_RULE = "discard-after-checkpoint"
CHECKPOINT_FORMAT = 2
"""1: no manifest (older agentrl); 2: ``manifest.json`` lists every file's size and hash."""
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped as broken, or trusted without a manifest."""


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
    checkpoint_format: int = 1
    world_size: int = 0
    """Ranks that saved the checkpoint (set by ``save_checkpoint``; 0 in checkpoints of older
    agentrl: counted from their ``rng-rank*.pt`` files)."""
    """Set by ``save_checkpoint`` (``CHECKPOINT_FORMAT``); 1 in checkpoints of older agentrl."""


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


def save_checkpoint(root: str | os.PathLike[str], learner: Any, state: LoopState, *, keep: int):
    """Write ``learner`` (anything with ``save(directory)``) and ``state`` as
    ``root/step-{state.step}`` atomically, with its manifest; keep the newest ``keep``
    checkpoints. Every rank calls it (each saves its ZeRO partitions). Returns the checkpoint
    folder. A failed save removes its partial folder and raises ``CheckpointError`` (for a full
    disk: the free space and the room ``keep`` needs)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, state.step)
    tmp = root / f".tmp-{final.name}"
    rank = rank_world()[0]
    try:
        if rank == 0:
            for stale in root.glob(".tmp-*"):  # an earlier crash's leftovers
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier()
        learner.save(str(tmp))
        torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
        barrier()
        if rank == 0:
            state.created = time.time()
            state.checkpoint_format = CHECKPOINT_FORMAT
            state.world_size = rank_world()[1]
            (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
            write_manifest(tmp)  # hashes and fsyncs every file, then the manifest
            _publish(root, tmp, final)
    except Exception as exc:
        raise _save_failed(exc, root, tmp, final, keep) from exc
    if rank == 0:
        for old_dir in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old_dir, ignore_errors=True)
    barrier()
    return final


def _publish(root: Path, tmp: Path, final: Path) -> None:
    if final.exists():  # re-saving a step (a resumed run): swap, never a partial state
        old = root / f".tmp-old-{final.name}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)


def _tree_size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_FLOOR = 64 << 20


def _disk_full(exc: BaseException, free: int, one_checkpoint: int) -> bool:
    """ENOSPC/EDQUOT anywhere in the exception's chain, or (torch's writer reports a full disk
    as a bare ``RuntimeError`` with no errno) less room left than one checkpoint needs."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return free < max(_FULL_FLOOR, one_checkpoint)


def _release_frames(exc: BaseException) -> None:
    """Drop the local variables of the frames of ``exc`` and the exceptions it chains to
    (torch's writer fails a second time while closing: its file is held by that chained
    exception's frames)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        traceback.clear_frames(link.__traceback__)
        link = link.__cause__ or link.__context__


def _save_failed(exc: Exception, root: Path, tmp: Path, final: Path, keep: int) -> Exception:
    if isinstance(exc, CheckpointError):
        return exc
    # the failed writers' frames may hold open files: close them, or the removed files would
    # keep their blocks (a full disk would stay full for as long as the error lives)
    _release_frames(exc)
    written = _tree_size(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    previous = list_checkpoints(root)
    one = _tree_size(previous[-1]) if previous else 0
    free = shutil.disk_usage(root).free
    cause = f"{type(exc).__name__}: {exc}"
    if not _disk_full(exc, free, one):
        return CheckpointError(
            f"writing checkpoint {final.name} in {root} failed ({cause}); its partial folder "
            "was removed and the earlier checkpoints are untouched"
        )
    if one:
        size = f"{_human(one)} ({previous[-1].name})"
    else:
        size = f"at least {_human(written)} (what this save wrote before the disk filled)"
    need = _human(max(one, written) * (keep + 1))
    return CheckpointError(
        f"no space left on device (ENOSPC) writing checkpoint {final.name} in {root} "
        f"({cause}): {_human(free)} free there. One checkpoint takes {size}; "
        f"checkpoint.keep={keep} needs about {need} ({keep} kept + the one being written, "
        f"before the oldest is pruned). The partial {tmp.name} was removed and the earlier "
        "checkpoints are untouched: free space, lower checkpoint.keep, or set checkpoint.dir "
        "to a larger disk"
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(root: Path) -> list[Path]:
    """Every ``step-NNNNNNNN`` folder under ``root`` (complete or not), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if p.is_dir()]


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Checkpoints under ``root`` that hold a ``state.json``, oldest first (not verified:
    ``find_intact_checkpoint`` verifies)."""
    return [p for p in _step_dirs(Path(root)) if (p / "state.json").is_file()]


class CheckpointLookup(NamedTuple):
    """What ``find_intact_checkpoint`` found."""

    path: Path | None
    """The newest intact checkpoint; None when ``root`` holds no checkpoint at all."""
    state: LoopState | None
    """Its loop state."""
    skipped: list[tuple[Path, str]]
    """Each newer checkpoint that was broken, newest first, with the reason (naming the file)."""


def find_intact_checkpoint(root: str | os.PathLike[str], *, contents: bool = True):
    """The newest checkpoint under ``root`` that ``verify_checkpoint`` accepts (``contents``:
    hash every file too, not only sizes), and the broken newer ones it skipped. When checkpoints
    exist but none is intact, ``CheckpointError`` names each broken file."""
    root = Path(root)
    skipped: list[tuple[Path, str]] = []
    for path in reversed(_step_dirs(root)):
        try:
            state = verify_checkpoint(path, contents=contents)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        return CheckpointLookup(path, state, skipped)
    if skipped:
        broken = "\n".join(f"  {path.name}: {reason}" for path, reason in skipped)
        raise CheckpointError(
            f"no intact checkpoint under {root}:\n{broken}\nTo start the run over from step 1, "
            f"move them away (mv {root} {root}.broken) and resume again: a run without "
            "checkpoints restarts from the beginning"
        )
    return CheckpointLookup(None, None, [])


def latest_checkpoint(root: str | os.PathLike[str], *, contents: bool = True) -> Path | None:
    """The newest intact checkpoint under ``root`` (None when there is none); each newer broken
    one is skipped with a ``CheckpointWarning`` naming its broken file
    (``find_intact_checkpoint``)."""
    found = find_intact_checkpoint(root, contents=contents)
    for path, reason in found.skipped:
        warnings.warn(
            CheckpointWarning(f"skipped broken checkpoint {path}: {reason}; using {found.path}"),
            stacklevel=2,
        )
    return found.path


def _checked_value(name: str, hint: Any, value: Any) -> str | None:
    origin = typing.get_origin(hint) or hint
    if origin is float:
        origin = (int, float)
    if not isinstance(origin, type | tuple):
        return None
    if isinstance(value, bool) or not isinstance(value, origin):
        return f"{name} is {value!r}"
    if origin is dict and not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in value.items()
    ):
        return f"{name} is {value!r} (names to non-negative byte lengths)"
    return None


def read_state(path: str | os.PathLike[str]) -> LoopState:
    """The checkpoint's ``state.json`` as a ``LoopState``; a missing, unreadable or incomplete
    file raises ``CheckpointError`` naming it and what is wrong."""
    file = Path(path) / "state.json"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint")
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    hints = typing.get_type_hints(LoopState)
    required = [f.name for f in fields(LoopState) if f.default is f.default_factory is MISSING]
    problems = [f"{name} is missing" for name in required if name not in data]
    problems += [f"{key!r} is not a loop-state key" for key in data if key not in hints]
    problems += [
        p for key, v in data.items() if key in hints and (p := _checked_value(key, hints[key], v))
    ]
    if problems:
        raise CheckpointError(f"{file} is damaged: {'; '.join(problems)}")
    return LoopState(**data)


def verify_checkpoint(path: str | os.PathLike[str], *, contents: bool = True) -> LoopState:
    """Check a checkpoint folder before trusting it: every file its manifest lists present with
    the size (and, with ``contents``, the hash) it was saved with, and ``state.json`` complete.
    ``CheckpointError`` names the broken file. A checkpoint saved by an older agentrl without a
    manifest is accepted when its ``state.json`` and ``policy/`` folder are there, with a
    ``CheckpointWarning`` (its files cannot be verified)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder")
    verified = check_manifest(path, contents=contents)
    state = read_state(path)
    if verified:
        return state
    if state.checkpoint_format >= 2:
        raise CheckpointError(f"{path / MANIFEST} is missing (this checkpoint was saved with one)")
    if not (path / "policy").is_dir():
        raise CheckpointError(f"{path / 'policy'} is missing (the policy's DeepSpeed state)")
    warnings.warn(
        CheckpointWarning(
            f"{path} was saved without a manifest (an older agentrl): its files' sizes and "
            "contents cannot be verified"
        ),
        stacklevel=2,
    )
    return state


def load_checkpoint(
    path: str | os.PathLike[str],
    learner: Any,
    *,
    tokenizer_fingerprint: str,
    config_hash: str,
    verify: bool = True,
) -> LoopState:
    """Verify the checkpoint (``verify_checkpoint``; ``verify=False`` when the caller just did),
    check that it belongs to this run (same tokenizer, same configuration hash), then restore
    ``learner`` (``load(directory, version)``) and this rank's RNG states. Any failure is a
    ``CheckpointError`` naming the checkpoint."""
    path = Path(path)
    state = verify_checkpoint(path) if verify else read_state(path)
    verify_state(state, path, tokenizer_fingerprint=tokenizer_fingerprint, config_hash=config_hash)
    rank, world = rank_world()
    saved = saved_world_size(path, state.world_size)
    rng_file = path / f"rng-rank{rank % saved}.pt"  # another world size: a saved rank's states
    if not rng_file.is_file():
        raise CheckpointError(f"{rng_file} is missing (the checkpoint was saved by {saved} ranks)")
    try:
        if saved == world:
            learner.load(str(path), state.policy_version)
        else:
            _load_resharded(path, learner, state.policy_version)
        set_rng_state(torch.load(rng_file, weights_only=False))
    except CheckpointError:
        raise
    except Exception as exc:  # DeepSpeed, torch and pickle errors of a damaged file
        raise CheckpointError(
            f"loading checkpoint {path} failed ({type(exc).__name__}: {exc}); it is damaged or "
            "was written by an incompatible version: resume from an earlier checkpoint or "
            "start over"
        ) from exc
    return state


def _load_resharded(path: Path, learner: Any, version: int) -> None:
    """Load a checkpoint saved at another world size through a universal checkpoint
    (``_reshard``), converted by rank 0 into a temporary folder beside it."""
    universal = path.parent / f".tmp-universal-{path.name}"
    if rank_world()[0] == 0:
        shutil.rmtree(universal, ignore_errors=True)
        to_universal(path, universal)
    barrier()
    try:
        learner.load(str(universal), version, universal=True)
    finally:
        barrier()
        if rank_world()[0] == 0:
            shutil.rmtree(universal, ignore_errors=True)


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
    try:
        state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    except Exception as exc:  # DeepSpeed, torch and pickle errors of a damaged file
        raise CheckpointError(
            f"reading the {tag!r} weights of checkpoint {path} failed ({type(exc).__name__}: {exc})"
        ) from exc
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

    state = verify_checkpoint(path)
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
