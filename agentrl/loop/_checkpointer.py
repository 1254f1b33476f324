"""The checkpointer: saves the loop, not only the weights, and finds what to resume from.

A checkpoint (``agentrl.trainer.save_checkpoint``) holds the learner (weights, optimizer, LR
schedule, per-rank RNG), the policy version, the task accounting (``TaskLedger.state()``) and
the byte length of every run file. The rule for work that was not settled when it was written
(groups in flight or waiting in the buffer) is *re-queue*: a resumed run cuts the run files back
to their recorded lengths and samples those task slots again, first, with the same seeds. A
step's checkpoint is written last (after its update, the publish of its weights and its
records); in sync mode the next step's groups are started only after that, so nothing is in
flight at a checkpoint and a resumed run repeats the uninterrupted one exactly.

Resume never starts a run over by accident: with no checkpoint under the checkpoint root it
starts from step 1 only when the ledger holds no step; otherwise it refuses (a mistyped
``checkpoint.dir``, a moved checkpoint folder). Broken checkpoints newer than the one it resumes
from are renamed ``broken-step-N`` (ignored by every lookup), so they neither shadow the
checkpoints the resumed run writes nor count towards ``checkpoint.keep``.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, NamedTuple

import pydantic

from agentrl._errors import ConfigError
from agentrl._outfiles import check_writable, write_file, writing
from agentrl._runner import config_diff, is_training_config
from agentrl.trainer import LoopState, find_intact_checkpoint, latest_checkpoint, list_checkpoints

from ._config import TrainConfig, dump_config
from ._runfiles import check_run_files, record_lengths, restore_run_files
from ._runlock import LOCK_FILE
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
        self.run_id = run_id(out)
        """The run's id (written into ``config.json`` before the checkpointer is made)."""

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every_steps
        final = self.cfg.checkpoint.at_end and step == self.cfg.train.max_steps
        return bool(every and step % every == 0) or final

    def save(
        self,
        step: int,
        learner: Any,
        tasks: dict[str, Any],
        cursor: int,
        *,
        idle_steps: int = 0,
        rng: dict[str, Any] | None = None,
    ) -> None:
        """``idle_steps``: the consecutive steps without an update so far (restored on resume,
        so a stalled run is not granted a new ``train.max_steps_without_update``). ``rng``: the
        generator states when ``step`` ended (default: the states now)."""
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
            file_lengths=self._lengths(),  # fsynced, whole lines
            tasks=tasks,
            steps_without_update=idle_steps,
            run_id=self.run_id,
        )
        self.newest = save_checkpoint(
            self.root, learner, state, keep=self.cfg.checkpoint.keep, rng=rng
        )
        self.last_s = time.perf_counter() - t0

    def _lengths(self) -> dict[str, int]:
        """The run files' lengths (``record_lengths``); a failed fsync is a ``WriteError``."""
        with writing(self.out):
            return record_lengths(self.out, RUN_FILES)

    def latest(self) -> Path | None:
        """The newest checkpoint this run wrote, else the newest one on disk (not re-hashed)."""
        return self.newest or latest_checkpoint(self.root, contents=False)


def how_to_continue(out: Path, steps: int, checkpoint: Path | None) -> str:
    """Where a run that stopped after ``steps`` complete steps stands (``checkpoint``: its
    newest) and the command that continues it."""
    text = f"{steps} complete steps in {out / 'ledger.jsonl'}; "
    if checkpoint is None and not steps:
        return text + f"no checkpoint yet: agentrl train --resume {out} starts over"
    if checkpoint is None:  # a resume refuses to empty the steps the ledger holds
        return text + (
            "no checkpoint yet (checkpoint.every_steps), so the run cannot be resumed; train "
            f"it again with agentrl train --config {out / 'config.yaml'} --out NEW_RUN"
        )
    from agentrl.trainer import read_state

    step = read_state(checkpoint).step
    return text + (
        f"newest checkpoint: step {step} ({checkpoint}); agentrl train --resume {out} "
        "continues from it" + (" (later steps are redone)" if step < steps else "")
    )


def last_idle_steps(out: Path, state: LoopState) -> int:
    """``steps_without_update`` of the checkpoint's own step in the ledger as the checkpoint
    recorded it (for checkpoints that predate ``LoopState.steps_without_update``); 0 when the
    record is not there."""
    size = state.file_lengths.get("ledger.jsonl", 0)
    try:
        with open(out / "ledger.jsonl", "rb") as fh:
            lines = fh.read(size).splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step") == state.step:
            idle = record.get("steps_without_update")
            return idle if isinstance(idle, int) and not isinstance(idle, bool) else 0
    return 0


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
    root = checkpoint_root(cfg, out)
    if root.is_symlink() and not root.exists():
        raise ConfigError(f"checkpoint root {root} is a broken link (to {os.readlink(root)})")
    if root.exists() and not root.is_dir():
        raise ConfigError(
            f"checkpoint root {root} exists and is not a directory: set checkpoint.dir to a folder"
        )
    if resume:
        read_tracker_ids(out)  # refused here, before a model is loaded
        return
    if _has_records(out / "ledger.jsonl"):
        raise ConfigError(f"{out} already holds a run; resume it with --resume {out}")
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


def _step_count(ledger: Path) -> int:
    """Step records in the ledger (``step`` ≥ 1: an evaluation at start is no step); a torn
    line is not counted."""
    count = 0
    try:
        with open(ledger, "rb") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                step = record.get("step") if isinstance(record, dict) else None
                count += isinstance(step, int) and not isinstance(step, bool) and step >= 1
    except FileNotFoundError:
        pass
    return count


def _has_records(ledger: Path) -> bool:
    """Does the ledger hold a record (any non-blank line)?"""
    try:
        with open(ledger, "rb") as fh:
            return any(line.strip() for line in fh)
    except FileNotFoundError:
        return False


def run_id(out: Path) -> str:
    """The run id ``out/config.json`` records ("" when it has none: a run that predates it,
    or none yet)."""
    try:
        value = json.loads((out / "config.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def prepare_out(cfg: TrainConfig, out: Path, model_path: str, *, fresh: bool) -> None:
    """Write the run's configuration files into ``out``; ``fresh`` (a new run): also empty
    the run files an earlier attempt that never recorded a step may have left. The run id is
    made once, by the run's first start, and kept by its resumes."""
    ours = "" if fresh else run_id(out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"env": cfg.env, "model": cfg.model, "model_path": model_path, "train": True}
    info["run_id"] = ours or secrets.token_hex(8)
    info["rollout"] = cfg.rollout.model_dump(mode="json")
    # config.json first: it marks the folder as a training run's (``check_out``)
    with writing(out / "config.json"):
        write_file(out / "config.json", json.dumps(info, indent=2))
    if fresh:
        restore_files(out, {})
    with writing(out / "config.yaml"):
        write_file(out / "config.yaml", dump_config(cfg))


class Resume(NamedTuple):
    """Where ``check_resume`` found the run."""

    path: Path | None
    """The checkpoint to resume from; None: the run never recorded a step (it starts over)."""
    broken: list[tuple[Path, str]]
    """The broken checkpoints newer than ``path``, with the reason each was skipped."""


def check_resume(
    cfg: TrainConfig,
    out: Path,
    fingerprint: str,
    *,
    lead: bool = True,
    accept_lost: bool = False,
    files: bool = True,
) -> Resume:
    """The checkpoint to resume from, refused early (before any model is built and anything
    is written) when it belongs to another tokenizer or configuration, or when a run file lost
    records it counted (unless ``accept_lost``). None when the run never recorded a step (it
    then starts over: its files are emptied); a ledger that holds steps with no checkpoint under
    the checkpoint root is refused, naming what the root holds. ``lead`` prints what was
    skipped (the process that writes the run files); ``files``: read the run files too."""
    from agentrl.trainer import verify_state

    if not (out / "config.yaml").is_file():
        raise ConfigError(f"--resume: {out} is not a training run (no config.yaml)")
    root = checkpoint_root(cfg, out)
    found = find_intact_checkpoint(root)
    for broken, reason in found.skipped if lead else ():
        print(f"--resume: skipping broken checkpoint {broken}: {reason}", flush=True)
    if found.path is None:
        steps = _step_count(out / "ledger.jsonl")
        if steps:
            raise ConfigError(
                f"--resume: {out / 'ledger.jsonl'} holds {steps} step{'s' * (steps != 1)} but "
                f"{root} has no checkpoint ({_root_contents(root)}); is checkpoint.dir "
                f"({cfg.checkpoint.dir or 'checkpoints'}) the run's? Resume with the folder "
                "that holds its checkpoints, or start a new run in another --out"
            )
        return Resume(None, [])
    path, state = found.path, found.state
    ours = run_id(out)
    if state.run_id and ours and state.run_id != ours:
        raise ConfigError(
            f"--resume: checkpoint {path} belongs to another run (run {state.run_id}; {out} is "
            f"run {ours}): checkpoint.dir ({cfg.checkpoint.dir or 'checkpoints'}) names another "
            "run's checkpoints; resume with the folder that holds this run's"
        )
    # the tokenizer first (ids would not mean the same thing), then the configuration
    verify_state(state, path, tokenizer_fingerprint=fingerprint, config_hash=state.config_hash)
    if state.config_hash == cfg.hash():
        # what cutting the run files back would refuse, refused before config.yaml is rewritten
        if files:
            short = "recover" if accept_lost else "refuse"
            check_run_files(out, state.file_lengths, RUN_FILES, short=short)
        return Resume(path, found.skipped)
    changed = _changed_fields(out, state.config_hash, cfg)
    raise ConfigError(
        f"--resume: configuration mismatch with checkpoint {path} (config hash "
        f"{state.config_hash}, this run's is {cfg.hash()}): "
        + ("; ".join(changed) if changed else "the checkpoint's configuration is unknown")
        + " (only max_steps, num_threads, max_steps_without_update, checkpointing, logging, eval,"
        " engine, server, sandbox and rollout concurrency may change on resume)"
    )


def _root_contents(root: Path) -> str:
    """What a checkpoint root without a checkpoint holds, in words."""
    if not root.exists():
        return "it does not exist"
    names = sorted(p.name for p in root.iterdir() if p.name != LOCK_FILE)
    if not names:
        return "it is empty"
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"it holds {shown}, none of them a checkpoint step-N"


def set_aside(broken: list[tuple[Path, str]]) -> None:
    """Rename each broken checkpoint a resume skipped to ``broken-step-N`` beside it (a name
    no lookup lists), so the resumed run's own checkpoints of those steps neither collide with
    it nor are pruned in its favour; say so."""
    for path, _ in broken:
        target = path.with_name(f"broken-{path.name}")
        n = 1
        while target.exists():
            target, n = path.with_name(f"broken-{path.name}.{n}"), n + 1
        path.rename(target)
        print(f"--resume: moved broken checkpoint {path} to {target}", flush=True)


def schedule_note(cfg: TrainConfig, learner: Any) -> str | None:
    """One line when a resumed run's ``train.max_steps`` is not the length its LR schedule was
    made for (a decaying schedule keeps its length: ``LRSchedule.total_updates``)."""
    schedule = getattr(getattr(learner, "policy", None), "lr_schedule", None)
    opt = cfg.optimizer
    if schedule is None or opt.schedule == "constant":
        return None
    alg = learner.settings.algorithm
    per_step = alg.epochs * alg.mini_batches
    steps, recorded = cfg.train.max_steps, schedule.total_updates // per_step
    if schedule.total_updates == steps * per_step:
        return None
    end = opt.min_lr_ratio * opt.lr
    after = (
        f"from step {recorded + 1} on the LR stays at {end:g} (optimizer.min_lr_ratio × lr)"
        if steps > recorded
        else f"the run ends at step {steps}, before the schedule does"
    )
    return (
        f"--resume: train.max_steps is {steps}, the run was started with {recorded}: its "
        f"{opt.schedule} LR schedule keeps its length ({recorded} step{'s' * (recorded != 1)}); "
        + after
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
