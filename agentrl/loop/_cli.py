"""The ``train``, ``eval`` and ``export`` commands, registered into ``agentrl``'s parser by
``add_train_commands(subparsers)`` (which returns the handlers by command name)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Handler = Callable[[argparse.Namespace], int]
SAME_STOP_S = 2.0
"""Under torchrun: a second signal this soon after the first is the same stop (a scheduler
signals every process of the job, and torchrun forwards the signal it got to each rank)."""


_MODEL_HELP = (
    "the model the run trained from (folder or registered name), where the folder its "
    "checkpoint recorded is not there (a run copied from another machine)"
)


def add_train_commands(subparsers) -> dict[str, Handler]:
    """Add ``train``, ``eval`` and ``export`` to an argparse subparsers object."""
    t = subparsers.add_parser("train", help="train a policy with RL (DeepSpeed ZeRO-3)")
    t.add_argument("--config", default=None, help="YAML run config (see examples/)")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set algorithm.kl_coef=0.01 (repeatable)",
    )
    t.add_argument("--model", default=None, help="shortcut for --set model=NAME")
    t.add_argument("--max-steps", type=int, default=None, help="shortcut for train.max_steps")
    t.add_argument("--out", default=None, help="run directory (default runs/train-<env>-<time>)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run")
    t.add_argument(
        "--accept-lost-records",
        action="store_true",
        help="--resume: a run file shorter than its checkpoint recorded is cut to its last "
        "complete line instead of refused (the lost records stay missing)",
    )
    t.add_argument("--backend", default="trio", choices=["trio", "asyncio"])

    e = subparsers.add_parser("eval", help="evaluate a checkpoint on the held-out split")
    e.add_argument("--config", default=None, help="YAML run config (env, eval section)")
    e.add_argument("--checkpoint", required=True, help="checkpoint, run dir, model or folder")
    e.add_argument("--model", default=None, help=_MODEL_HELP)
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--num-tasks", type=int, default=None, help="shortcut for eval.num_tasks")
    e.add_argument("--out", default=None, help="write eval_summary.json and trajectories here")
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an evaluation --out already holds (once this one finishes)",
    )

    x = subparsers.add_parser("export", help="write a checkpoint as an HF safetensors folder")
    x.add_argument("run_dir", help="run directory")
    x.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    x.add_argument("--out", required=True, help="output folder")
    x.add_argument("--model", default=None, help=_MODEL_HELP)
    return {"train": _cmd_train, "eval": _cmd_eval, "export": _cmd_export}


def _train_config(args: argparse.Namespace) -> tuple[Any, Path]:
    """The run's configuration and folder: a new run's (``--config``, ``--out``) or the one
    ``--resume RUN_DIR`` continues."""
    from agentrl._errors import ConfigError

    from ._config import load_train_config

    if args.resume:
        run = Path(args.resume)
        if args.config:
            raise ConfigError("--resume reads RUN_DIR/config.yaml; drop --config")
        if args.out and Path(args.out).resolve() != run.resolve():
            raise ConfigError("--resume continues in RUN_DIR; drop --out")
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"--resume {run}: no config.yaml (not a training run)")
        cfg = load_train_config(
            run / "config.yaml",
            args.set,
            recorded=True,
            model=args.model,
            max_steps=args.max_steps,
        )
        return cfg, run
    cfg = load_train_config(args.config, args.set, model=args.model, max_steps=args.max_steps)
    env = cfg.env.split(":")[-1]
    if not args.out and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("under torchrun give --out: every rank must name the same run")
    return cfg, Path(args.out or f"runs/train-{env}-{time.strftime('%Y%m%d-%H%M%S')}")


def _cmd_train(args: argparse.Namespace) -> int:
    import anyio

    from agentrl._interrupt import run_until_interrupted, signal_name

    cfg, out = _train_config(args)  # before torch loads: a bad config is refused at once
    from ._checkpointer import check_out
    from ._config import training_notes

    check_out(cfg, out, resume=bool(args.resume))  # and an --out a run must not write into

    from ._runtime import atrain

    lead = os.environ.get("RANK", "0") == "0"  # one rank speaks
    if lead:
        print(
            f"train {cfg.env} on {cfg.model}: {cfg.algorithm.name}, {cfg.train.max_steps} steps "
            f"× {cfg.train.tasks_per_step} tasks × {cfg.rollout.group_size} samples → {out}"
            + (f" ({os.environ['WORLD_SIZE']} ranks)" if os.environ.get("WORLD_SIZE", "1") != "1"
               else ""),
            flush=True,
        )  # fmt: skip
        for note in training_notes(cfg):
            print(f"note: {note}", flush=True)

    alone = os.environ.get("WORLD_SIZE", "1") == "1"

    def stopping(signum: int) -> None:
        if not lead:  # rank 0 speaks for the ranks
            return
        where = "the step in progress is dropped" if alone else (
            "every rank drops the step in progress at its next collection (an update already "
            "running finishes first)"
        )  # fmt: skip
        print(
            f"\nstopping ({signal_name(signum)}): {where}, nothing half-written is kept "
            "(Ctrl-C or SIGTERM again to abort now)",
            flush=True,
        )

    result, signum = anyio.run(
        lambda: run_until_interrupted(
            lambda stop: atrain(
                cfg,
                out,
                resume=bool(args.resume),
                stop=stop,
                accept_lost_records=args.accept_lost_records,
            ),
            on_interrupt=stopping,
            same_stop_s=0.0 if alone else SAME_STOP_S,
        ),
        backend=args.backend,
    )
    if result.interrupted:
        if lead:
            print(_interrupted_message(result), flush=True)
        return 128 + (signum or signal.SIGINT)  # 130 after Ctrl-C, 143 after SIGTERM
    if lead:
        print(f"done: {result.steps} steps, policy version {result.policy_version}; ledger: "
              f"{out / 'ledger.jsonl'}", flush=True)  # fmt: skip
    return 0


def _interrupted_message(result) -> str:
    """Where an interrupted run stands and how to continue it."""
    from ._checkpointer import how_to_continue

    return "interrupted: " + how_to_continue(result.out, result.steps, result.checkpoint)


def _cmd_eval(args: argparse.Namespace) -> int:
    import json

    import anyio

    from ._config import load_train_config

    sets = list(args.set)
    if args.num_tasks is not None:
        sets.append(f"eval.num_tasks={args.num_tasks}")
    cfg = load_train_config(args.config, sets)  # before torch loads

    from ._eval import aevaluate

    metrics = anyio.run(
        lambda: aevaluate(
            cfg, args.checkpoint, out=args.out, overwrite=args.overwrite, model=args.model
        )
    )
    print(json.dumps(metrics, indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ._eval import export_run

    path, step = export_run(args.run_dir, args.step, args.out, args.model)
    print(f"exported {args.run_dir} step {step} → {path}")
    return 0
