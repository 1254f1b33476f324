"""The ``agentrl`` command (a composition root: it may import everything)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._errors import AgentRLError

ROLLOUT_MODEL = "smollm2-135m"
"""The model ``agentrl rollout`` runs when neither ``--model`` nor ``--config`` names one."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentrl", description="Agentic multi-turn RL: rollouts, masks, environments."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("rollout", help="run real rollouts and write trajectories")
    r.add_argument(
        "--env",
        default=None,
        help="environment id, e.g. calc-v0 or mod:name-v0 (default: --config's env)",
    )
    r.add_argument(
        "--model",
        default=None,
        help="registered model name or HF folder (default: --config's model, else "
        f"{ROLLOUT_MODEL}; agentrl models list)",
    )
    r.add_argument(
        "-n", "--num-tasks", type=int, default=8, help="tasks to roll out (default %(default)s)"
    )
    r.add_argument("--group", type=int, default=None, help="samples per task (GRPO G; default 1)")
    r.add_argument("--max-turns", type=int, default=None, help="default: the env's")
    r.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default: the env's)")
    r.add_argument("--temperature", type=float, default=None, help="default 1.0")
    r.add_argument("--top-p", type=float, default=None, help="default 1.0")
    r.add_argument("--top-k", type=int, default=None, help="default -1 (off)")
    r.add_argument(
        "--seed", type=int, default=None, help="every sample's seed derives from it (default 0)"
    )
    r.add_argument(
        "--concurrency", type=int, default=None, help="trajectories running at once (default 16)"
    )
    r.add_argument(
        "--split", default="train", choices=["train", "eval"], help="default %(default)s"
    )
    r.add_argument(
        "--task-offset", type=int, default=0, help="skip this many tasks of the split (default 0)"
    )
    r.add_argument(
        "--env-kwargs",
        default=None,
        help="JSON object of the env's constructor arguments, e.g. '{\"levels\": [0]}'",
    )
    r.add_argument(
        "--config",
        default=None,
        help="YAML/JSON file with a 'rollout' (and optional 'engine' and 'sandbox') section",
    )
    r.add_argument("--out", default=None, help="run directory (default runs/<env>-<time>)")
    exists = r.add_mutually_exclusive_group()
    exists.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the rollout already in --out (its trajectories, config and summary)",
    )
    exists.add_argument(
        "--append",
        action="store_true",
        help="add trajectories to the rollout already in --out (same env, model and sampling "
        "settings; sample indices continue, so ids stay unique)",
    )
    r.add_argument("--dry-run", action="store_true", help="render masks, write report.html")
    r.add_argument("--check", action="store_true", help="boundary-check every trajectory")
    r.add_argument(
        "--show", type=int, default=2, help="trajectories to render with --dry-run (default 2)"
    )
    r.add_argument(
        "--backend", default="trio", choices=["trio", "asyncio"], help="event loop (default trio)"
    )
    r.add_argument(
        "--engine",
        default="embedded",
        metavar="ENGINE",
        help="embedded (the model, in this process; default) or scripted:FILE (replay a YAML or "
        "JSONL file of assistant turns with the model's tokenizer, to exercise an env's tools "
        "without a model that calls them; logprobs are synthetic 0.0)",
    )
    r.add_argument(
        "--sandbox",
        default=None,
        help="sandbox for code-running envs: local | docker | gvisor | "
        "http(s)://HOST:PORT[,HOST:PORT...] | a PoolConfig file (wins over the config's "
        "'sandbox:' key; an env that runs code needs one of the two)",
    )

    i = sub.add_parser("inspect", help="re-render saved trajectories")
    i.add_argument("path", help="a run directory or its trajectories.jsonl")
    i.add_argument("--html", default=None, help="write the HTML mask report here")
    i.add_argument("--model", default=None, help="tokenizer source (default: from config.json)")
    i.add_argument("--show", type=int, default=2, help="trajectories to render (default 2)")
    i.add_argument("--check", action="store_true", help="boundary-check every trajectory")

    e = sub.add_parser("envs", help="list, show or check registered environments")
    esub = e.add_subparsers(dest="envs_command", required=True)
    esub.add_parser("list")
    es = esub.add_parser("show")
    es.add_argument("env_id")
    ec = esub.add_parser("check", help="run the environment checker (check_env)")
    ec.add_argument("env_ids", nargs="*", metavar="ENV_ID", help="environment ids to check")
    ec.add_argument("--all", action="store_true", help="check every registered environment")
    ec.add_argument("--env-kwargs", default=None, help="JSON object passed to each factory")
    ec.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="deadline of each call into the environment: the constructor, tasks() and each "
        "hook (default %(default)g)",
    )

    m = sub.add_parser("models", help="list or pull models")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list")
    mp = msub.add_parser("pull")
    mp.add_argument("name")

    sub.add_parser("doctor", help="what this host can do")
    sub.add_parser("plan", help="size a run: 'plan memory --model 7B ...', 'plan capacity ...'")
    sub.add_parser(
        "dashboard", help="write a run's interactive page: 'dashboard RUN [--compare RUN2]'"
    )
    sub.add_parser(
        "serve", help="serve a model over SGLang's HTTP API subset (agentrl serve --help)"
    )
    sub.add_parser(  # its options live with the sandboxes package (main() hands it argv)
        "sandbox",
        help="sandbox images and service: 'image build', 'serve --backend docker --port 8090'",
    )
    from .loop import add_train_commands  # train, eval, export

    p.set_defaults(train_handlers=add_train_commands(sub))
    return p


def _safe(text: str) -> str:
    """``text`` fit for the terminal (``terminal_safe``): what it quotes from a run folder or
    a trajectory (ids, error types, paths) cannot move the cursor, set the title or link."""
    from ._report_term import terminal_safe

    return terminal_safe(text)


def _console():
    from rich.console import Console

    return Console(highlight=False, emoji=False)  # ":x:" in a task id stays text


def _load_config_file(path: str) -> dict[str, Any]:
    from ._config_file import read_config_file
    from ._errors import ConfigError

    data = read_config_file(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _section(loaded: dict[str, Any], name: str, args: argparse.Namespace) -> dict[str, Any]:
    """A copy of the mapping ``loaded[name]`` (empty when absent); ConfigError otherwise."""
    from ._config import short_repr
    from ._errors import ConfigError

    section = loaded.get(name)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{args.config}: {name}: expected a mapping, got {short_repr(section)}")
    return dict(section)


def _refuse_unknown_sections(loaded: dict[str, Any], path: str) -> None:
    """A rollout reads a training config's ``rollout``, ``engine`` and ``sandbox``; a key that
    no training config has either (``rolout:``) is a typo the rollout would otherwise run past
    with the defaults."""
    import difflib

    from ._errors import ConfigError
    from .loop._config import TrainConfig

    known = sorted(TrainConfig.model_fields)
    for key in loaded:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{path}: {str(key)[:80]!r} is not a section of a run config{hint}; the "
                f"sections are {', '.join(known)}"
            )


def _as_trained(
    loaded: dict[str, Any], rollout: dict[str, Any], args: argparse.Namespace, console: Any
) -> dict[str, Any]:
    """What a run config's ``model`` and ``env`` say (unless ``--model``/``--env`` do: a flag that
    differs is said), and, for a training config (one with a ``train`` or ``algorithm``
    section), ``rollout`` with the defaults training derives (``group_size`` for algorithms
    that compare groups, ``max_context_tokens`` from ``train.micro_batch_tokens``): a dry run
    shows the masks training would see."""
    from ._config import short_repr
    from ._errors import ConfigError
    from .loop._config import TrainConfig, _default_context, _default_group_size

    training = "train" in loaded or "algorithm" in loaded
    for name in ("env", "model"):
        value = loaded.get(name)
        if value is None and training:
            value = TrainConfig.model_fields[name].default
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConfigError(f"{args.config}: {name}: expected a string, got {short_repr(value)}")
        flag = getattr(args, name)
        if flag is None:
            setattr(args, name, value)
        elif flag != value:
            console.print(
                _safe(f"  --{name} {flag} overrides {args.config}'s {name}: {value}"), markup=False
            )
    if not training:
        return rollout
    rollout = _default_group_size(rollout, loaded.get("algorithm"))
    return _default_context(rollout, loaded.get("train"))


def _refuse_moved_settings(loaded: dict[str, Any], path: str) -> None:
    """A setting written at its old place is refused naming its home, as ``train`` does (the
    rollout would otherwise ignore it)."""
    from ._errors import ConfigError
    from .loop._config import MOVED_SETTINGS

    for old, home in MOVED_SETTINGS.items():
        node: Any = loaded
        for part in old:
            node = node.get(part, None) if isinstance(node, dict) else None
        if node is not None:
            where = ".".join(old)
            raise ConfigError(
                f"{path}: {where}: moved to {home} (every setting has one home): write it there"
            )


def _cmd_rollout(args: argparse.Namespace) -> int:
    import time

    import anyio

    from ._config import RolloutConfig, validate_config
    from ._config_file import load_json
    from ._errors import ConfigError
    from ._interrupt import run_until_interrupted, signal_name
    from ._runner import check_run_dir
    from ._types import read_trajectories

    console = _console()
    data: dict[str, Any] = {}
    engine_data: dict[str, Any] = {}
    args.sandbox_where = "--sandbox"
    if args.config:
        loaded = _load_config_file(args.config)
        _refuse_moved_settings(loaded, args.config)
        _refuse_unknown_sections(loaded, args.config)
        data, engine_data = _section(loaded, "rollout", args), _section(loaded, "engine", args)
        if args.sandbox is None and loaded.get("sandbox") is not None:
            args.sandbox, args.sandbox_where = loaded["sandbox"], f"{args.config}: sandbox"
        data = _as_trained(loaded, data, args, console)
    if args.env is None:
        raise ConfigError("--env is required (or a --config that names an env)")
    args.model = args.model or ROLLOUT_MODEL
    out = Path(args.out or f"runs/{args.env.split(':')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}")
    if_exists = "append" if args.append else "overwrite" if args.overwrite else "error"
    check_run_dir(out, if_exists)  # refused before anything heavy is imported or loaded
    overrides = {
        "group_size": args.group,
        "max_turns": args.max_turns,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "concurrency": args.concurrency,
    }
    data.update({k: v for k, v in overrides.items() if v is not None})
    if args.env_kwargs:
        data["env_kwargs"] = load_json(args.env_kwargs, "--env-kwargs")
    # a file's mistakes are named as the file spells them (rollout.tempreature)
    cfg = validate_config(RolloutConfig, data, where="rollout" if args.config else "")
    if args.num_tasks < 1:
        raise ConfigError(f"-n must be >= 1, got {args.num_tasks}")
    if args.show < 0:
        raise ConfigError(f"--show must be >= 0, got {args.show}")
    # the settings, the environment and the model are checked before torch is imported (an
    # error here takes a fraction of a second, not the engine's import)
    from ._models import check_model
    from ._registry import spec
    from .envs import check_env_sandbox

    env_spec = spec(args.env)
    check_env_sandbox(args.sandbox, args.env, env_spec.entry_point, where=args.sandbox_where)
    check_model(args.model)

    from .engine import engine_options

    args.engine_options = engine_options(engine_data)
    console.print(
        _safe(
            f"rollout {args.env} on {args.model}: {args.num_tasks} tasks × "
            f"{cfg.group_size} samples → {out}" + (" (appending)" if args.append else "")
        ),
        markup=False,
    )
    done, total = [0], [args.num_tasks * cfg.group_size]

    def tasks_found(count: int) -> None:
        total[0] = count * cfg.group_size
        if count < args.num_tasks:
            console.print(
                _safe(
                    f"  {args.env}'s {args.split!r} split has {count} tasks from offset "
                    f"{args.task_offset} (-n {args.num_tasks} asked for more): running {count}"
                ),
                markup=False,
            )

    from ._report_term import one_line

    def progress(traj) -> None:
        done[0] += 1
        error = traj.error
        console.print(
            one_line(
                f"  [{done[0]}/{total[0]}] {traj.id}: {traj.status}/{traj.termination_reason} "
                f"reward={traj.reward} turns={traj.num_turns} tokens={len(traj.token_ids)}"
                + (f" error={error.type}: {error.message[:80]}" if error else "")
            ),
            markup=False,
        )

    def stopping(signum: int) -> None:
        console.print(
            f"\nstopping ({signal_name(signum)}): cancelling the trajectories in flight "
            "(Ctrl-C or SIGTERM again to abort now)"
        )

    result, signum = anyio.run(
        lambda: run_until_interrupted(
            lambda stop: _rollout_with_resources(
                args, cfg, out, (progress, tasks_found), if_exists, stop
            ),
            on_interrupt=stopping,
        ),
        backend=args.backend,
    )
    trajectories = result.trajectories
    elapsed_s: float | None = result.elapsed_s
    if result.appended_to:  # the summary covers the whole run directory
        trajectories = read_trajectories(str(out / "trajectories.jsonl"))
        elapsed_s = _previous_elapsed(out, result.elapsed_s)
    code = _present(
        trajectories,
        result.model_path,
        out,
        console,
        elapsed_s=elapsed_s,
        dry_run=args.dry_run and not result.interrupted,
        check=args.check and not result.interrupted,
        show=args.show,
    )
    if result.interrupted:
        console.print(
            _safe(
                f"interrupted: {len(result.trajectories)}/{result.planned} trajectories saved "
                f"({out / 'trajectories.jsonl'}; summary: {out / 'summary.json'})"
            ),
            markup=False,
        )
        return 128 + (signum or signal.SIGINT)  # 130 after Ctrl-C, 143 after SIGTERM
    failed = [t for t in result.trajectories if t.status == "error"]
    if result.trajectories and len(failed) == len(result.trajectories):
        first = failed[0].error
        where = f"{first.where} {first.type}: {first.message}" if first else "unknown"
        console.print(
            one_line(f"every trajectory failed ({len(failed)}); first: {failed[0].id}: {where}"),
            style="red",
            markup=False,
        )
        if first is not None and first.traceback:
            console.print(_safe(first.traceback), markup=False, highlight=False)
        return 1
    return code


def _previous_elapsed(out: Path, elapsed_s: float) -> float | None:
    """This call's time plus the time the earlier calls' summary recorded (None if unknown:
    the summary's rate then falls back to the trajectories' own generate times)."""
    from ._outfiles import json_record, read_run_file

    try:  # a run file: bounded in size, any JSON (too deep, not an object) is "unknown"
        record = json_record(read_run_file(out / "summary.json"))
    except (OSError, AgentRLError):
        return None
    before = record.get("elapsed_s") if record is not None else None
    if isinstance(before, bool) or not isinstance(before, int | float):
        return None
    try:
        total = float(before) + elapsed_s
    except OverflowError:  # an integer past a float's range
        return None
    return total if math.isfinite(total) else None


async def _rollout_with_resources(
    args: argparse.Namespace, cfg, out: Path, callbacks, if_exists: str, stop
):
    """Open what the env needs for this rollout (the run's sandbox), then run."""
    from ._registry import spec
    from ._runner import arollout
    from .envs import open_env_sandbox

    env_spec = spec(args.env)
    sandbox = open_env_sandbox(
        args.sandbox, args.env, env_spec.entry_point, where=args.sandbox_where
    )
    async with sandbox as resources:
        return await arollout(
            args.env,
            engine=_rollout_engine(args),
            model=args.model,
            n=args.num_tasks,
            split=args.split,
            task_offset=args.task_offset,
            config=cfg,
            out=out,
            engine_options=args.engine_options,
            on_trajectory=callbacks[0],
            env_resources=resources,
            if_exists=if_exists,
            stop=stop,
            on_tasks=callbacks[1],
        )


def _rollout_engine(args: argparse.Namespace):
    """``--engine``: None for the embedded engine (``arollout`` opens it), or a scripted one."""
    from ._errors import ConfigError

    kind, _, path = args.engine.partition(":")
    if kind == "embedded" and not path:
        return None
    if kind == "scripted" and path:
        from .engine import ScriptedEngine

        return ScriptedEngine.from_file(path, args.model)
    raise ConfigError(f"--engine {args.engine!r}: expected 'embedded' or 'scripted:FILE'")


def _present(
    trajectories,
    model_path: str,
    out: Path | None,
    console,
    *,
    elapsed_s: float | None,
    dry_run: bool,
    check: bool,
    show: int,
    html: str | None = None,
) -> int:
    from ._models import load_tokenizer
    from ._report import render_summary, render_terminal, summarize, write_html_report

    tokenizer = load_tokenizer(model_path)
    if dry_run:
        render_terminal(trajectories, tokenizer, console, max_trajectories=show)
    summary = summarize(trajectories, elapsed_s=elapsed_s)
    render_summary(summary, console)
    if out is not None:
        import msgspec

        from ._outfiles import write_file

        write_file(out / "summary.json", msgspec.json.encode(summary))
    html_path = html or (str(out / "report.html") if (dry_run and out is not None) else None)
    if html_path:
        write_html_report(trajectories, tokenizer, html_path)
        console.print(_safe(f"HTML mask report: {html_path}"), markup=False)
    if out is not None:
        console.print(_safe(f"trajectories: {out / 'trajectories.jsonl'}"), markup=False)
    if check:
        return _check(trajectories, tokenizer, console)
    return 0


def _check(trajectories, tokenizer, console) -> int:
    """``--check``: every trajectory's invariants and its boundary re-render; a trajectory
    without messages (an error trajectory whose ``reset()`` raised) has nothing to re-render
    and is counted as not checked. Exit 1 when any fails."""
    from rich.text import Text

    from ._report_term import one_line
    from .formats import check_boundary, get_format

    def failed(label: str, message: str) -> None:
        console.print(Text.assemble((label, "red"), " ", _safe(message)))

    fmt = get_format("chatml-hermes", tokenizer)
    bad = unchecked = 0
    for traj in trajectories:
        try:
            traj.validate()
        except ValueError as exc:
            bad += 1
            failed("invalid", str(exc))
            continue
        if not traj.messages:
            unchecked += 1
            continue
        try:
            report = check_boundary(fmt, traj)
        except AgentRLError as exc:  # the template refuses this conversation
            bad += 1
            failed("boundary", f"trajectory {one_line(traj.id)}: cannot re-render: {exc}")
            continue
        if not report.ok:
            bad += 1
            failed("boundary", f"trajectory {one_line(traj.id)}: {report.message}")
    checked = len(trajectories) - unchecked
    if unchecked:
        plural = "trajectory" if unchecked == 1 else "trajectories"
        console.print(f"not checked: {unchecked} {plural} without messages", markup=False)
    if bad:
        console.print(Text(f"{bad} of {checked} trajectories failed the check", "red"))
        return 1
    console.print(f"boundary check: all {checked} trajectories match the re-render", markup=False)
    return 0


def _trajectories_file(path: Path) -> Path:
    """``path`` itself, or a run directory's ``trajectories.jsonl``; ConfigError (one line)
    for anything that is not a trajectories file."""
    from ._errors import ConfigError

    if path.is_dir():
        found = path / "trajectories.jsonl"
        if not found.is_file():
            raise ConfigError(f"{path} is a directory without trajectories.jsonl (not a run)")
        return found
    if not path.exists():
        raise ConfigError(f"no such file or directory: {path}")
    if not path.is_file():
        raise ConfigError(f"{path} is not a file")
    return path


def _read_for_inspect(path: Path) -> list:
    """The trajectories in ``path``, or a one-line ConfigError saying what the file is."""
    from ._errors import ConfigError
    from ._outfiles import run_file_lines
    from ._types import read_trajectories

    first = next((line for _, line in run_file_lines(path) if line.strip()), None)
    if first is None:
        raise ConfigError(f"{path} holds no trajectories (empty)")
    try:
        head = json.loads(first)
    except (ValueError, RecursionError):
        raise ConfigError(f"{path} is not JSON lines (its first line is not JSON)") from None
    if isinstance(head, dict) and "step" in head and "token_ids" not in head:
        raise ConfigError(
            f"{path} is a training ledger (one record per step), not trajectories: inspect "
            f"{path.parent} or {path.parent / 'trajectories.jsonl'}"
        )
    try:
        return read_trajectories(str(path))
    except (ValueError, UnicodeDecodeError) as exc:
        message = " ".join(str(exc).split())  # one line
        raise ConfigError(f"cannot inspect {message}") from None


def _run_config_json(path: Path) -> dict[str, Any]:
    """A run folder's ``config.json`` as an object, read without blocking (``/proc/kmsg``
    under its name is refused); a one-line ConfigError naming it otherwise."""
    from ._errors import ConfigError
    from ._outfiles import read_run_config

    try:
        config = read_run_config(path)
    except FileNotFoundError:
        raise ConfigError(f"inspect: {path}: no such file") from None
    except ConfigError as exc:
        raise ConfigError(f"inspect: cannot read {path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"inspect: cannot read {path}: JSON nested too deep") from None
    if not isinstance(config, dict):
        raise ConfigError(f"inspect: {path} is not a JSON object (got {type(config).__name__})")
    return config


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ._errors import ConfigError
    from ._models import resolve_model

    if args.show < 0:
        raise ConfigError(f"--show must be >= 0, got {args.show}")
    path = _trajectories_file(Path(args.path))
    trajectories = _read_for_inspect(path)
    model = args.model
    config = path.parent / "config.json"
    if model is None and config.is_file():
        model = _run_config_json(config).get("model_path")
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"inspect: {config}: model_path must be a string, got {model!r}")
    if model is None:
        model = trajectories[0].model if trajectories else "smollm2-135m"
    model_path = str(resolve_model(model))
    return _present(
        trajectories,
        model_path,
        None,
        _console(),
        elapsed_s=None,
        dry_run=True,
        check=args.check,
        show=args.show,
        html=args.html,
    )


def _cmd_envs(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from ._env_values import split_tasks
    from ._errors import EnvError
    from ._registry import load_entry_points, registered, spec

    console = _console()
    # an env's text (ids, descriptions, errors) is plain text: never rich markup, never an
    # escape sequence for the terminal
    if args.envs_command == "list":
        for err in load_entry_points():
            console.print(Text.assemble(("warning", "yellow"), " ", _safe(err)))
        table = Table("id", "description", "max turns", "max new tokens", "module")
        for s in registered():
            table.add_row(*(Text(_safe(str(v))) for v in (s.id, s.description, s.max_turns,
                                                          s.max_new_tokens, s.module)))  # fmt: skip
        console.print(table)
        return 0
    if args.envs_command == "check":
        return _check_envs(args, console)
    from ._tools import collect_tools

    s = spec(args.env_id)
    env = s.make()
    where = f"{s.module}.{getattr(s.entry_point, '__qualname__', '')}"
    console.print(Text.assemble((_safe(s.id), "bold"), f"  ({_safe(where)})"))
    if s.description:  # the description, else the class's docstring
        console.print(Text(_safe(s.description)))
    console.print(Text(_safe(f"max_turns={s.max_turns} max_new_tokens={s.max_new_tokens} "
                             f"tags={s.tags}")))  # fmt: skip
    for name, bound in collect_tools(env).items():
        parameters = json.dumps(bound.spec.parameters)
        console.print(Text.assemble("tool ", (_safe(name), "cyan"), ": ", _safe(parameters)))
    for split in ("train", "eval"):
        try:
            tasks = split_tasks(env, s.id, split, 0)
        except EnvError as exc:
            console.print(Text(_safe(f"{split}: {exc}"), style="red"))
            continue
        example = f", e.g. {tasks[0]}" if tasks else ""
        console.print(Text(_safe(f"{split}: {len(tasks)} tasks{example}")))
    return 0


def _check_envs(args: argparse.Namespace, console) -> int:
    """``agentrl envs check``: the contract checker on each id, one line per id; exit 1 if any
    fails (the others are still checked)."""
    from rich.text import Text

    from ._checker import check_env
    from ._config import short_repr
    from ._config_file import load_json
    from ._errors import ConfigError
    from ._registry import load_entry_points, registered

    kwargs: dict[str, Any] = {}
    if args.env_kwargs:
        kwargs = load_json(args.env_kwargs, "--env-kwargs")
        if not isinstance(kwargs, dict):
            raise ConfigError(
                f"--env-kwargs must be a JSON object, got {short_repr(args.env_kwargs)}"
            )
    if not args.timeout_s > 0 or args.timeout_s == float("inf"):
        raise ConfigError(f"--timeout-s must be a number of seconds > 0, got {args.timeout_s!r}")
    ids = list(args.env_ids)
    failed = passed = 0
    if args.all:
        for err in load_entry_points():  # an env that cannot even load fails the check
            failed += 1
            console.print(Text.assemble(("FAIL", "red"), " ", _safe(err)))
        ids += [s.id for s in registered() if s.id not in ids]
    if not ids and not failed:
        raise ConfigError("agentrl envs check: give environment ids, or --all")
    for env_id in ids:
        try:
            check_env(env_id, env_kwargs=kwargs, timeout_s=args.timeout_s)
        except Exception as exc:
            failed += 1
            message = str(exc) if isinstance(exc, AgentRLError) else f"{type(exc).__name__}: {exc}"
            console.print(Text.assemble(("FAIL", "red"), " ", _safe(f"{env_id}: {message}")))
        else:
            passed += 1
            console.print(Text.assemble(("ok", "green"), "   ", _safe(env_id)))
    if failed:
        console.print(f"[red]{failed} failed[/], {passed} passed")
        return 1
    console.print(f"all {passed} environment(s) pass the contract checks")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from ._models import list_models, pull_model

    console = _console()
    if args.models_command == "pull":
        path = pull_model(args.name)
        console.print(f"{args.name}: {path}")
        return 0
    for info in list_models():
        state = f"cached ({info.size_bytes / 1e6:.0f} MB) at {info.path}" if info.cached else "-"
        console.print(f"{info.name:16} {state}  {info.description}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ._doctor import run_doctor

    console = _console()
    run_doctor(console)
    try:
        from .sandboxes._report import gaps, host_report

        rows = host_report()
    except Exception as exc:  # doctor never crashes: say why
        console.print(f"[yellow]sandboxes: cannot probe: {type(exc).__name__}: {exc}[/]")
        return 0
    for name, ok, detail, guarantees in rows:
        table = Table(
            "guarantee",
            "given",
            "how / why not",
            title=f"sandbox backend {name}: "
            + ("[green]available[/]" if ok else "[yellow]unavailable[/]")
            + f" — {detail}",
        )
        for g in guarantees:
            table.add_row(g.name, "[green]yes[/]" if g.available else "[yellow]no[/]", g.detail)
        console.print(table)
    missing = Table("backend", "not guaranteed", "why", title="sandbox gaps on this host")
    for backend, what, why in gaps(rows):
        missing.add_row(backend, f"[yellow]{what}[/]", why)
    console.print(missing)
    return 0


def _serve(argv: list[str]) -> int:
    from .engine._server import serve_main

    return serve_main(argv)


def _sandbox(argv: list[str]) -> int:
    from .sandboxes.__main__ import main as sandbox_main

    return sandbox_main(argv, prog="agentrl sandbox")


def _plan(argv: list[str]) -> int:
    from .plan._cli import main as plan_main

    return plan_main(argv)


def _dashboard(argv: list[str]) -> int:
    from .dashboard._cli import main as dashboard_main

    return dashboard_main(argv)


DELEGATED = {"serve": _serve, "sandbox": _sandbox, "plan": _plan, "dashboard": _dashboard}
"""Commands whose options live with their package (the server's import loads torch and aiohttp;
the sandboxes package runs on its own): they get the rest of argv as it is."""


def _dispatch(argv: list[str]) -> int:
    if argv[:1] and argv[0] in DELEGATED:
        return DELEGATED[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    # let `--env mymodule:name-v0` import modules from the working directory, searched last:
    # a file there named like a library (transformers.py in a downloaded run folder) must not
    # shadow it and run when agentrl imports that library
    if "" not in sys.path and "." not in sys.path:
        sys.path.append("")
    handlers = {
        "rollout": _cmd_rollout,
        "inspect": _cmd_inspect,
        "envs": _cmd_envs,
        "models": _cmd_models,
        "doctor": _cmd_doctor,
        **args.train_handlers,
    }
    return handlers[args.command](args)


def _single(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups; else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def main(argv: Sequence[str] | None = None) -> int:
    from ._extras import missing_dependency_message
    from ._interrupt import is_interrupt

    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        return _dispatch(argv)
    except BaseException as caught:
        if is_interrupt(caught):
            print("agentrl: interrupted", file=sys.stderr)
            return 130
        exc = _single(caught)
        if isinstance(exc, BrokenPipeError):  # the reader went away (`agentrl … | head`)
            _stdout_to_devnull()
            return 128 + signal.SIGPIPE  # what a command killed by SIGPIPE reports
        if isinstance(
            exc, AgentRLError
        ):  # every error agentrl raises on purpose (sandbox ones too)
            print(f"agentrl: error: {_safe(str(exc))}", file=sys.stderr)
            return int(getattr(exc, "exit_code", 2))
        if isinstance(exc, ModuleNotFoundError):
            hint = missing_dependency_message(exc, command)
            if hint is not None:
                print(f"agentrl: error: {_safe(hint)}", file=sys.stderr)
                return 2
        raise


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises nothing more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (a test's capture)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
