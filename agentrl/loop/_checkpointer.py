"""The checkpointer: saves the loop, not only the weights, and finds what to resume from.

A checkpoint (``agentrl.trainer.save_checkpoint``) holds the learner (weights, optimizer, LR
schedule, per-rank RNG), the policy version, the task accounting (``TaskLedger.state()``) and
the byte length of every run file. The rule for work that was not settled when it was written
(groups in flight or waiting in the buffer) is *re-queue*: a resumed run cuts the run files back
to their recorded lengths and samples those task slots again, first, with the same seeds. In
sync mode nothing is in flight at a checkpoint (it is written before the new weights are
published), so a resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pydantic

from agentrl._errors import ConfigError
from agentrl._outfiles import check_writable, write_file
from agentrl._runner import config_diff, is_training_config
from agentrl.trainer import LoopState, find_intact_checkpoint, latest_checkpoint, list_checkpoints

from ._config import TrainConfig, dump_config
from ._runfiles import record_lengths, restore_run_files
from ._trackers import IDS_FILE, read_tracker_ids

RUN_FILES = ("ledger.jsonl", "trajectories.jsonl", "eval_trajectories.jsonl", "runtime.jsonl")
CONFIG_FILES = ("config.yaml", "config.json")
IN_FLIGHT_RULE = "requeue"
"""What a checkpoint does with unsettled groups: their task slots are sampled again."""


def checkpoint_root(cfg: TrainConfig, out: Path) -> Path:
    """``checkpoint.dir``, a relative one taken from ``out`` (not from the working directory,
    which a ``--resume`` from elsewhere does not share); default ``out/checkpoints``."""
    return out / (cfg.checkpoint.dir or "checkpoints")


class Checkpointer:
    """Saves the loop every ``checkpoint.every_steps`` steps (and at the end)."""

    def __init__(self, cfg: TrainConfig, out: Path, fingerprint: str, model_path: str) -> None:
        self.cfg, self.out = cfg, out
        self.root = checkpoint_root(cfg, out)
        self.fingerprint, self.model_path = fingerprint, model_path
        self.last_s = 0.0
        """Seconds of the newest write (reported on the next step's record)."""
        self.newest: Path | None = None

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every_steps
        final = self.cfg.checkpoint.at_end and step == self.cfg.train.max_steps
        return bool(every and step % every == 0) or final

    def save(self, step: int, learner: Any, tasks: dict[str, Any], cursor: int) -> None:
        from agentrl.trainer import save_checkpoint

        t0 = time.perf_counter()
        state = LoopState(
            step=step,
            policy_version=learner.version,
            data_cursor=cursor,
            tokenizer_fingerprint=self.fingerprint,
            config_hash=self.cfg.hash(),
            model_path=self.model_path,
            in_flight=IN_FLIGHT_RULE,
            file_lengths=record_lengths(self.out, RUN_FILES),  # fsynced, whole lines
            tasks=tasks,
        )
        self.newest = save_checkpoint(self.root, learner, state, keep=self.cfg.checkpoint.keep)
        self.last_s = time.perf_counter() - t0

    def latest(self) -> Path | None:
        """The newest checkpoint this run wrote, else the newest one on disk (not re-hashed)."""
        return self.newest or latest_checkpoint(self.root, contents=False)


def restore_files(out: Path, lengths: dict[str, int], *, accept_lost: bool = False) -> None:
    """Cut the run files back to a checkpoint's lengths (``{}``: empty them), never padding; a
    file that lost records the checkpoint counted is refused unless ``accept_lost``."""
    short = "recover" if accept_lost else "refuse"
    for repair in restore_run_files(out, lengths, RUN_FILES, short=short):
        if repair.lost:
            print(
                f"--accept-lost-records: {out / repair.name} was cut to {repair.size_after} "
                f"bytes (the checkpoint recorded {repair.recorded}; the records after its "
                "last complete line are lost)",
                flush=True,
            )


def check_out(cfg: TrainConfig, out: Path, *, resume: bool) -> None:
    """Refuse ``out`` before anything is written: a symlink or folder under a run file's
    name (``OutputError``), and for a new run (``resume=False``) a folder or checkpoint root
    that holds a run's progress (a ledger record or a checkpoint: continue it with
    ``--resume``). A folder where a run stopped before its first record (a configuration
    error, a kill during the first step) is started again."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    present = [n for n in (*CONFIG_FILES, *RUN_FILES, IDS_FILE) if check_writable(out / n)]
    if resume:
        read_tracker_ids(out)  # refused here, before a model is loaded
        return
    if _has_records(out / "ledger.jsonl"):
        raise ConfigError(f"{out} already holds a run; resume it with --resume {out}")
    root = checkpoint_root(cfg, out)
    done = list_checkpoints(root)
    if done:
        raise ConfigError(
            f"{root} already holds checkpoints ({done[-1].name} is the newest); resume that run "
            "with --resume, or start this one with another --out or checkpoint.dir"
        )
    # files under the run's names are an earlier attempt's only when its config.json (written
    # first) says so: a rollout's folder, or a user's files, are never overwritten
    if present and not is_training_config(out):
        raise ConfigError(
            f"--out {out} holds {', '.join(present)}, which a training run would replace, and "
            "no training run wrote them (its config.json is not a training run's): choose "
            "another --out, or move them away"
        )


def _has_records(ledger: Path) -> bool:
    """Does the ledger hold a record (any non-blank line)?"""
    try:
        with open(ledger, "rb") as fh:
            return any(line.strip() for line in fh)
    except FileNotFoundError:
        return False


def prepare_out(cfg: TrainConfig, out: Path, model_path: str, *, fresh: bool) -> None:
    """Write the run's configuration files into ``out``; ``fresh`` (a new run): also empty
    the run files an earlier attempt that never recorded a step may have left."""
    out.mkdir(parents=True, exist_ok=True)
    info = {"env": cfg.env, "model": cfg.model, "model_path": model_path, "train": True}
    info["rollout"] = cfg.rollout.model_dump(mode="json")
    # config.json first: it marks the folder as a training run's (``check_out``)
    write_file(out / "config.json", json.dumps(info, indent=2))
    if fresh:
        restore_files(out, {})
    write_file(out / "config.yaml", dump_config(cfg))


def check_resume(cfg: TrainConfig, out: Path, fingerprint: str) -> Path | None:
    """The checkpoint to resume from, refused early (before any model is built) when it
    belongs to another tokenizer or configuration; None when the run never reached one (it
    then starts over: its files are emptied)."""
    from agentrl.trainer import verify_state

    if not (out / "config.yaml").is_file():
        raise ConfigError(f"--resume: {out} is not a training run (no config.yaml)")
    found = find_intact_checkpoint(checkpoint_root(cfg, out))
    for broken, reason in found.skipped:
        print(f"--resume: skipping broken checkpoint {broken}: {reason}", flush=True)
    if found.path is None:
        return None
    path, state = found.path, found.state
    # the tokenizer first (ids would not mean the same thing), then the configuration
    verify_state(state, path, tokenizer_fingerprint=fingerprint, config_hash=state.config_hash)
    if state.config_hash == cfg.hash():
        return path
    changed = _changed_fields(out, state.config_hash, cfg)
    raise ConfigError(
        f"--resume: configuration mismatch with checkpoint {path} (config hash "
        f"{state.config_hash}, this run's is {cfg.hash()}): "
        + ("; ".join(changed) if changed else "the checkpoint's configuration is unknown")
        + " (only max_steps, num_threads, max_steps_without_update, checkpointing, logging, eval,"
        " engine, server, sandbox and rollout concurrency may change on resume)"
    )


def _changed_fields(out: Path, old_hash: str, cfg: TrainConfig) -> list[str]:
    """The hashed fields where ``cfg`` differs from the run's ``config.yaml`` (``old → new``),
    when that file is the configuration the checkpoint was written with."""
    from ._config import load_train_config

    try:
        old = load_train_config(out / "config.yaml", recorded=True)
    except ConfigError:
        return []
    if old.hash() != old_hash:
        return []
    before, after = old.model_dump(mode="json"), cfg.model_dump(mode="json")
    changed = []
    for line in config_diff(before, after):
        name = line.split(":", 1)[0]
        probe = _with_leaf(before, name.split("."), after)
        try:  # does this field alone change the hash?
            alone = TrainConfig.model_validate(probe).hash() != old_hash
        except pydantic.ValidationError:
            alone = True
        if alone:
            changed.append(line)
    return changed


def _with_leaf(base: dict[str, Any], path: list[str], source: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with the value at ``path`` taken from ``source`` (or removed)."""
    out = copy.deepcopy(base)
    node, src = out, source
    for key in path[:-1]:
        node, src = node.setdefault(key, {}), (src or {}).get(key, {})
    if path[-1] in (src or {}):
        node[path[-1]] = copy.deepcopy(src[path[-1]])
    else:
        node.pop(path[-1], None)
    return out
