"""Loop checkpoints, written atomically.

A checkpoint is a folder ``ROOT/step-00000012`` holding the DeepSpeed checkpoints of the trained
engines (``policy/``, ``critic/``: model, optimizer and LR-schedule state, ZeRO partitions per
rank), ``rng-rank{r}.pt`` (python, numpy, torch and CUDA generator states of each rank, read
with ``weights_only=True``: ``_rng``) and
``state.json`` (``LoopState``: step, policy version, data cursor, tokenizer fingerprint, config
hash, the in-flight rule and the run files' lengths).

Atomicity: everything is written into ``ROOT/.tmp-step-…`` (files fsynced), then the folder is
renamed to ``step-…`` in one ``rename``, and only then are older checkpoints pruned (``keep``).
A crash at any moment leaves either the previous checkpoints alone or the new one complete;
``latest_checkpoint`` ignores ``.tmp-*`` leftovers (the next save removes them).

Pruning keeps the checkpoint just written and the newest ``keep - 1`` others at or below its
step that look intact (``state.json`` and every file of the manifest at its size); a folder of a
later step (a broken checkpoint a resume skipped) is neither counted nor removed.

Writers of one root: rank 0 holds an exclusive ``flock`` on ``ROOT/.tmp-NAME.lock`` while it
fills ``ROOT/.tmp-NAME`` (a save; the conversion of ``_load_resharded``), so the cleanup of
leftovers removes only folders no live process is filling, and a second writer of the same step
is refused. ``agentrl train`` also locks its run folder (``agentrl.loop._runlock``): the root of
one run has one writer; these locks matter where roots are shared (``checkpoint.dir``).

Verification and lookup (``_lookup``): the save ends with ``manifest.json`` (``_manifest``);
``load_checkpoint`` and ``export_checkpoint`` (``_export``) verify a checkpoint before using it,
and a failure while loading is a ``CheckpointError`` naming the checkpoint, never a raw
traceback. The manifest detects damage, not tampering: whoever can write the checkpoint can
rewrite its manifest too. DeepSpeed loads its own files (``policy/``, ``critic/``) with
``torch.load(weights_only=False)``, which runs code a pickle names: a checkpoint is to be
trusted like any pickle.

Another world size: a checkpoint saved by N ranks loads at M ≠ N through DeepSpeed's universal
checkpoint, converted at load time (``_reshard``); rank ``r`` takes saved rank ``r mod N``'s RNG
states. A failed save (a full disk above all) is cleaned up and explained by ``_diskfull``.

The in-flight rule (``LoopState.in_flight``, set by the loop): whatever was sampled after the
checkpoint (trajectories, ledger lines) is cut off on resume (the files are cut back to the
lengths recorded here), and the task slots the checkpoint does not record as settled
(``LoopState.tasks``) are sampled again with the same seeds.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from agentrl._errors import AgentRLError

from ._diskfull import save_failed
from ._dist import barrier, gather, rank_world
from ._lookup import (
    CHECKPOINT_FORMAT,
    CheckpointWarning,
    LoopState,
    list_checkpoints,
    read_state,
    verify_checkpoint,
)
from ._manifest import CheckpointError, CheckpointUnreadable, fsync_dir, write_manifest
from ._reshard import saved_world_size, to_universal
from ._rng import load_rng_state, save_rng_state, set_rng_state


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_checkpoint(
    root: str | os.PathLike[str],
    learner: Any,
    state: LoopState,
    *,
    keep: int,
    rng: dict[str, Any] | None = None,
):
    """Write ``learner`` (anything with ``save(directory)``) and ``state`` as
    ``root/step-{state.step}`` atomically, with its manifest; keep it and the newest ``keep - 1``
    intact-looking checkpoints before it (``_prune``). Every rank calls it (each saves its ZeRO
    partitions). ``rng``: this rank's generator states as ``rng_state()`` gave them when the
    step ended (default: the states now). Returns the checkpoint folder. A failed save removes
    its partial folder and raises ``CheckpointError`` (for a full disk: the free space and the
    room ``keep`` needs)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, state.step)
    tmp = root / f".tmp-{final.name}"
    rank = rank_world()[0]
    claim = None
    try:

        def prepare() -> None:
            nonlocal claim
            if rank == 0:
                claim = _Claim.take(tmp)  # a second live writer of tmp: refused
                shutil.rmtree(tmp, ignore_errors=True)  # this step's own earlier attempt
                _remove_leftovers(root)
                tmp.mkdir()

        def write_own() -> None:
            learner.save(str(tmp))
            save_rng_state(tmp / f"rng-rank{rank}.pt", rng)

        def publish() -> None:
            if rank == 0:
                state.created = time.time()
                state.checkpoint_format = CHECKPOINT_FORMAT
                state.world_size = rank_world()[1]
                (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
                write_manifest(tmp)  # hashes and fsyncs every file, then the manifest
                _publish(root, tmp, final)

        # each part ends where every rank learns how every rank's part went: the same
        # collectives on every rank, and every rank raises when one failed
        for part in (prepare, write_own, publish):
            _agreed(part, root, tmp, final, keep)
    finally:
        if claim is not None:
            claim.release()
    if rank == 0:
        try:  # the checkpoint is published: nothing after this may fail the save
            _prune(root, final, keep)
        except (OSError, AgentRLError) as exc:
            warnings.warn(
                CheckpointWarning(f"{final} is saved; older checkpoints were not pruned: {exc}"),
                stacklevel=2,
            )
    barrier()
    return final


def _agreed(part: Any, root: Path, tmp: Path, final: Path, keep: int) -> None:
    """Run this rank's ``part`` of a save, then learn every rank's outcome (one gather; a
    barrier's worth alone). A rank whose part failed raises its own ``save_failed`` error
    (the partial folder removed once no rank writes into it any more); the others raise one
    naming the rank that failed."""
    error: Exception | None = None
    try:
        part()
    except Exception as exc:  # every failure is reported below, on every rank
        error = exc
    mine = None if error is None else f"{type(error).__name__}: {error}"
    failed = [(r, text) for r, text in enumerate(gather(mine)) if text is not None]
    if error is not None:
        done = list_checkpoints(root)
        raise save_failed(
            error, root, tmp, final, keep=keep, previous=done[-1] if done else None
        ) from error
    if failed:
        if rank_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        who = "; ".join(f"rank {r}: {text}" for r, text in failed)
        raise CheckpointError(
            f"writing checkpoint {final.name} in {root} failed on another rank ({who}); its "
            "partial folder was removed and the earlier checkpoints are untouched"
        )


def _prune(root: Path, final: Path, keep: int) -> None:
    """Remove the checkpoints before ``final`` beyond the newest ``keep - 1`` that look intact
    (sizes only, no hashing); ``final`` is never removed, nor any folder of a later step (it
    would be the newest, e.g. a broken checkpoint a resume skipped)."""
    step = step_number(final)
    kept = 1
    for path in reversed(list_checkpoints(root)):
        if path == final or step_number(path) > step:
            continue
        intact = _looks_intact(path)
        if intact is None:
            continue  # one this process cannot judge: neither counted nor removed
        if kept < keep and intact:
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)


def _looks_intact(path: Path) -> bool | None:
    """Whether a checkpoint looks intact (sizes); None when this process cannot tell (a file
    it may not read, a newer agentrl's format)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # a checkpoint without a manifest
        try:
            verify_checkpoint(path, contents=False)
        except CheckpointError:
            return False
        except (CheckpointUnreadable, OSError):
            return None
    return True


class _Claim:
    """An exclusive ``flock`` on ``FOLDER.lock`` beside a ``.tmp-*`` folder, held while one
    process fills the folder; the file is removed when the claim is released."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, folder: Path) -> _Claim | None:
        """Claim ``folder``; ``CheckpointError`` when a live process holds it. None where the
        filesystem has no ``flock`` (nothing is claimed)."""
        claim = cls.try_take(folder)
        if claim is False:
            raise CheckpointError(
                f"{folder} is being written by another live process (it holds "
                f"{_lock_path(folder)}): two runs are writing the same checkpoint root "
                f"{folder.parent}; give each its own checkpoint.dir"
            )
        return claim

    @classmethod
    def try_take(cls, folder: Path) -> _Claim | None | Literal[False]:
        """Claim ``folder`` if no live process holds it: the claim; False when one does; None
        where the filesystem has no ``flock``."""
        path = _lock_path(folder)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:  # released and removed meanwhile
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            return False
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return None
            raise
        return cls(path, fd)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)  # while held: nobody else claims a removed file
        os.close(self.fd)


def _lock_path(folder: Path) -> Path:
    return folder.with_name(folder.name + ".lock")


_LEFTOVER = re.compile(r"\.tmp-(?:old-|universal-)?step-\d+")
"""The names of the temporary folders checkpoints are written in (a save's, the swap of a
re-saved step's, a resharding conversion's); their claim files add ``.lock``."""


def _remove_leftovers(root: Path) -> None:
    """Remove the temporary folders (and claim files) of checkpoint writers that are gone: a
    crash's leftovers. A folder a live process is filling (its claim is held) is left alone,
    and so is anything else in the root, whatever its name (a ``checkpoint.dir`` may be a
    folder other files live in)."""
    for path in sorted(root.glob(".tmp-*")):
        folder = path.with_name(path.name.removesuffix(".lock"))
        if not _LEFTOVER.fullmatch(folder.name):
            continue  # not a checkpoint writer's
        if path != folder and folder.exists():
            continue  # the claim file of a folder: handled with the folder
        claim = _Claim.try_take(folder)
        if claim is False:
            continue  # a live writer
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            if claim is not None:
                claim.release()


def step_number(path: Path) -> int:
    """N of a ``step-N`` folder."""
    return int(path.name.removeprefix("step-"))


def _publish(root: Path, tmp: Path, final: Path) -> None:
    if final.exists():  # re-saving a step (a resumed run): swap, never a partial state
        old = root / f".tmp-old-{final.name}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_dir(root)


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
        set_rng_state(load_rng_state(rng_file))
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
    (``_reshard``), converted by rank 0 into a temporary folder beside it (claimed while it is
    in use, so no save's cleanup removes it)."""
    universal = path.parent / f".tmp-universal-{path.name}"
    claim = _Claim.take(universal) if rank_world()[0] == 0 else None
    try:
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
    finally:
        if claim is not None:
            claim.release()


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
    from ._deepspeed_import import import_deepspeed

    import_deepspeed()
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
