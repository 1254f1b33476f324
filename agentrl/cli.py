"""The ``agentrl`` command (a composition root: it may import everything)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._errors import AgentRLError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentrl", description="Agentic multi-turn RL: rollouts, masks, environments."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("rollout", help="run real rollouts and write trajectories")
    r.add_argument("--env", required=True, help="environment id, e.g. calc-v0 or mod:name-v0")
    r.add_argument("--model", default="smollm2-135m", help="registered model name or HF folder")
    r.add_argument("-n", "--num-tasks", type=int, default=8, help="tasks to roll out")
    r.add_argument("--group", type=int, default=None, help="samples per task (GRPO G)")
    r.add_argument("--max-turns", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=None, help="per turn")
    r.add_argument("--temperature", type=float, default=None)
    r.add_argument("--top-p", type=float, default=None)
    r.add_argument("--top-k", type=int, default=None)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--concurrency", type=int, default=None)
    r.add_argument("--split", default="train", choices=["train", "eval"])
    r.add_argument("--task-offset", type=int, default=0)
    r.add_argument("--env-kwargs", default=None, help="JSON object, e.g. '{\"levels\": [0]}'")
    r.add_argument(
        "--config",
        default=None,
        help="YAML/JSON file with a 'rollout' (and optional 'engine') section",
    )
    r.add_argument("--out", default=None, help="run directory (default runs/<env>-<time>)")
    r.add_argument("--dry-run", action="store_true", help="render masks, write report.html")
    r.add_argument("--check", action="store_true", help="boundary-check every trajectory")
    r.add_argument("--show", type=int, default=2, help="trajectories to render with --dry-run")
    r.add_argument("--backend", default="trio", choices=["trio", "asyncio"])
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
        help="sandbox for code-running envs: local | docker | gvisor | http(s)://HOST:PORT "
        "(default: local when the env takes a sandbox)",
    )

    i = sub.add_parser("inspect", help="re-render saved trajectories")
    i.add_argument("path", help="trajectories.jsonl")
    i.add_argument("--html", default=None, help="write the HTML mask report here")
    i.add_argument("--model", default=None, help="tokenizer source (default: from config.json)")
    i.add_argument("--show", type=int, default=2)
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

    m = sub.add_parser("models", help="list or pull models")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list")
    mp = msub.add_parser("pull")
    mp.add_argument("name")

    sub.add_parser("doctor", help="what this host can do")
    sub.add_parser(
        "serve", help="serve a model over SGLang's HTTP API subset (agentrl serve --help)"
    )
    sb = sub.add_parser(
        "sandbox",
        help="sandbox images and service: 'image build', 'serve --backend docker --port 8090'",
        add_help=False,
    )
    sb.add_argument("sandbox_args", nargs=argparse.REMAINDER)
    from .loop import add_train_commands  # train, eval, export

    p.set_defaults(train_handlers=add_train_commands(sub))
    return p


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _load_config_file(path: str) -> dict[str, Any]:
    from ._errors import ConfigError

    text = Path(path).read_text()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


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
    from ._errors import ConfigError
    from .engine import engine_options

    console = _console()
    data: dict[str, Any] = {}
    engine_data: dict[str, Any] = {}
    if args.config:
        loaded = _load_config_file(args.config)
        _refuse_moved_settings(loaded, args.config)
        data = dict(loaded.get("rollout", {}))
        engine_data = dict(loaded.get("engine", {}))
    args.engine_options = engine_options(engine_data)
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
        try:
            data["env_kwargs"] = json.loads(args.env_kwargs)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--env-kwargs is not valid JSON: {exc}") from None
    cfg = validate_config(RolloutConfig, data)
    if args.num_tasks < 1:
        raise ConfigError(f"-n must be >= 1, got {args.num_tasks}")
    out = Path(args.out or f"runs/{args.env.split(':')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}")
    console.print(
        f"[bold]rollout[/] {args.env} on {args.model}: {args.num_tasks} tasks × "
        f"{cfg.group_size} samples → {out}"
    )
    done = [0]
    total = args.num_tasks * cfg.group_size

    def progress(traj) -> None:
        done[0] += 1
        console.print(
            f"  [{done[0]}/{total}] {traj.id}: {traj.status}/{traj.termination_reason} "
            f"reward={traj.reward} turns={traj.num_turns} tokens={len(traj.token_ids)}"
            + (f" error={traj.error.type}: {traj.error.message[:80]}" if traj.error else "")
        )

    result = anyio.run(
        lambda: _rollout_with_resources(args, cfg, out, progress), backend=args.backend
    )
    return _present(
        result.trajectories,
        result.model_path,
        out,
        console,
        elapsed_s=result.elapsed_s,
        dry_run=args.dry_run,
        check=args.check,
        show=args.show,
    )


async def _rollout_with_resources(args: argparse.Namespace, cfg, out: Path, progress):
    """Open what the env needs for this rollout (a shared sandbox pool or client), then run."""
    from contextlib import AsyncExitStack

    from ._registry import spec
    from ._runner import arollout

    env_spec = spec(args.env)
    async with AsyncExitStack() as stack:
        resources: dict[str, Any] = {}
        from .envs._sandbox import open_sandbox_runner, wants_sandbox

        if args.sandbox or wants_sandbox(env_spec.entry_point):
            try:
                resources["sandbox"] = await stack.enter_async_context(
                    open_sandbox_runner(args.sandbox or "local")
                )
            except ValueError as exc:
                from ._errors import ConfigError

                raise ConfigError(f"--sandbox {args.sandbox!r}: {exc}") from None
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
            on_trajectory=progress,
            env_resources=resources,
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
    from transformers import AutoTokenizer

    from ._report import render_summary, render_terminal, summarize, write_html_report

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if dry_run:
        render_terminal(trajectories, tokenizer, console, max_trajectories=show)
    summary = summarize(trajectories, elapsed_s=elapsed_s)
    render_summary(summary, console)
    if out is not None:
        import msgspec

        (out / "summary.json").write_bytes(msgspec.json.encode(summary))
    html_path = html or (str(out / "report.html") if (dry_run and out is not None) else None)
    if html_path:
        write_html_report(trajectories, tokenizer, html_path)
        console.print(f"HTML mask report: {html_path}")
    if out is not None:
        console.print(f"trajectories: {out / 'trajectories.jsonl'}")
    if check:
        from .formats import check_boundary, get_format

        fmt = get_format("chatml-hermes", tokenizer)
        bad = 0
        for traj in trajectories:
            try:
                traj.validate()
            except ValueError as exc:
                bad += 1
                console.print(f"[red]invalid[/] {exc}")
                continue
            report = check_boundary(fmt, traj)
            if not report.ok:
                bad += 1
                console.print(f"[red]boundary[/] {report.message}")
        if bad:
            console.print(f"[red]{bad} of {len(trajectories)} trajectories failed the check[/]")
            return 1
        console.print(f"boundary check: all {len(trajectories)} trajectories match the re-render")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ._errors import ConfigError
    from ._models import resolve_model
    from ._types import read_trajectories

    path = Path(args.path)
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    trajectories = read_trajectories(str(path))
    model = args.model
    config = path.parent / "config.json"
    if model is None and config.is_file():
        model = json.loads(config.read_text()).get("model_path")
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

    from ._registry import load_entry_points, registered, spec

    console = _console()
    if args.envs_command == "list":
        for err in load_entry_points():
            console.print(f"[yellow]warning[/] {err}")
        table = Table("id", "description", "max turns", "max new tokens", "module")
        for s in registered():
            table.add_row(s.id, s.description, str(s.max_turns), str(s.max_new_tokens), s.module)
        console.print(table)
        return 0
    if args.envs_command == "check":
        return _check_envs(args, console)
    from ._tools import collect_tools

    s = spec(args.env_id)
    env = s.make()
    console.print(f"[bold]{s.id}[/]  ({s.module}.{getattr(s.entry_point, '__qualname__', '')})")
    console.print(s.description)
    console.print(f"max_turns={s.max_turns} max_new_tokens={s.max_new_tokens} tags={s.tags}")
    for name, bound in collect_tools(env).items():
        console.print(f"tool [cyan]{name}[/]: {json.dumps(bound.spec.parameters)}")
    for split in ("train", "eval"):
        tasks = env.tasks(split, seed=0)
        console.print(f"{split}: {len(tasks)} tasks, e.g. {tasks[0]}")
    return 0


def _check_envs(args: argparse.Namespace, console) -> int:
    """``agentrl envs check``: the contract checker on each id, one line per id; exit 1 if any
    fails (the others are still checked)."""
    from ._checker import check_env
    from ._errors import ConfigError
    from ._registry import load_entry_points, registered

    kwargs: dict[str, Any] = {}
    if args.env_kwargs:
        try:
            kwargs = json.loads(args.env_kwargs)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--env-kwargs is not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise ConfigError(f"--env-kwargs must be a JSON object, got {args.env_kwargs}")
    ids = list(args.env_ids)
    failed = passed = 0
    if args.all:
        for err in load_entry_points():  # an env that cannot even load fails the check
            failed += 1
            console.print(f"[red]FAIL[/] {err}")
        ids += [s.id for s in registered() if s.id not in ids]
    if not ids and not failed:
        raise ConfigError("agentrl envs check: give environment ids, or --all")
    for env_id in ids:
        try:
            check_env(env_id, env_kwargs=kwargs)
        except Exception as exc:
            failed += 1
            message = str(exc) if isinstance(exc, AgentRLError) else f"{type(exc).__name__}: {exc}"
            console.print(f"[red]FAIL[/] {env_id}: {message}")
        else:
            passed += 1
            console.print(f"[green]ok[/]   {env_id}")
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


def _cmd_sandbox(args: argparse.Namespace) -> int:
    from .sandboxes.__main__ import main as sandbox_main

    return sandbox_main(args.sandbox_args, prog="agentrl sandbox")


def _cmd_doctor(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ._doctor import run_doctor

    console = _console()
    run_doctor(console)
    try:
        from .sandboxes._report import host_report

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
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # its options live with the server (importing it loads torch)
        from .engine._server import serve_main

        return serve_main(argv[1:])
    args = _parser().parse_args(argv)
    # like `python -m`, let `--env mymodule:name-v0` import modules from the working directory
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    handlers = {
        "rollout": _cmd_rollout,
        "inspect": _cmd_inspect,
        "envs": _cmd_envs,
        "models": _cmd_models,
        "doctor": _cmd_doctor,
        "sandbox": _cmd_sandbox,
        **args.train_handlers,
    }
    try:
        return handlers[args.command](args)
    except AgentRLError as exc:  # every error agentrl raises on purpose (sandbox ones too)
        print(f"agentrl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
