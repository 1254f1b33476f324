"""``agentrl plan capacity`` (the model is in ``_capacity``)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from .._errors import ConfigError
from .._report_term import terminal_safe
from ._capacity import CapacityResult, CapacitySettings, plan_capacity, simulate

MAX_ACTORS = 256
"""The most actors a plan tries."""
TARGET_IDLE = 0.05
"""The learner's idle fraction a recommended actor count stays within."""
_RATES = {
    "actor_tokens_per_s": "generated tokens/s of one actor's engine",
    "learner_tokens_per_s": "trained tokens/s of the learner",
    "gen_tokens": "generated tokens per sample",
    "learner_tokens": "tokens the learner trains per sample (prompt + response)",
}


def capacity_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("capacity", help="actors that keep a learner busy within a version lag")
    c.add_argument("--from-run", default=None, help="calibrate every rate from a run folder")
    for name, text in _RATES.items():
        c.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=text)
    c.add_argument("--group-size", type=int, default=None, help="samples per task (G)")
    c.add_argument("--tasks-per-step", type=int, default=None, help="tasks per step (M)")
    c.add_argument(
        "--max-version-lag",
        type=int,
        default=None,
        help="versions a sample may lag (train.max_version_lag; default: the run's, else 1)",
    )
    c.add_argument(
        "--publish-s",
        type=float,
        default=None,
        help="seconds per published version (default: the run's, else 0)",
    )
    c.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="samples per engine at once (default: the run's, else 64)",
    )
    c.add_argument("--actors", type=int, default=None, help="evaluate this many (default: plan)")
    c.add_argument(
        "--steps", type=int, default=40, help="steps simulated per actor count (default 40)"
    )
    c.add_argument("--json", action="store_true")


def _settings(args: argparse.Namespace):  # noqa: ANN202
    given = {
        k: getattr(args, k)
        for k in (*_RATES, "group_size", "tasks_per_step", "max_version_lag", "publish_s",
                  "concurrency")
        if getattr(args, k) is not None
    }  # fmt: skip
    measures = None
    if args.from_run is not None:
        from ._capacity_run import from_run

        base, measures = from_run(args.from_run)
        return dataclasses.replace(base, steps=args.steps, **given), measures
    missing = [k for k in (*_RATES, "group_size", "tasks_per_step") if k not in given]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        raise ConfigError(f"agentrl plan capacity needs {flags} (or --from-run RUN)")
    given.setdefault("max_version_lag", 1)
    return CapacitySettings(steps=args.steps, **given), measures


def _row(r: CapacityResult) -> dict:
    return {
        "actors": r.actors,
        "step_s": r.step_s,
        "samples_per_s": r.samples_per_s,
        "learner_idle_fraction": r.learner_idle_fraction,
        "actor_idle_fraction": r.actor_idle_fraction,
        "backlog_mean": r.backlog_mean,
        "backlog_max": r.backlog_max,
        "lag_mean": r.lag_mean,
        "lag_hist": r.lag_hist,
        "bottleneck": r.bottleneck,
    }


def _line(r: dict) -> str:
    hist = " ".join(f"{k}:{v:.0%}" for k, v in r["lag_hist"].items())
    return (
        f"{r['actors']:>6} {r['step_s']:>9.2f} {r['samples_per_s']:>9.2f} "
        f"{r['learner_idle_fraction']:>8.0%} {r['actor_idle_fraction']:>8.0%} "
        f"{r['backlog_mean']:>8.1f} {r['backlog_max']:>6} {r['lag_mean']:>6.2f}  "
        f"{hist:<16} {r['bottleneck']}"
    )


def cmd_capacity(args: argparse.Namespace) -> int:
    settings, measures = _settings(args)
    best, tried = plan_capacity(settings, max_actors=MAX_ACTORS, target_idle=TARGET_IDLE)
    out: dict = {"settings": dataclasses.asdict(settings), "recommended_actors": best}
    out["tried"] = [_row(r) for r in tried]
    out["target_met"] = next(
        r.learner_idle_fraction <= TARGET_IDLE for r in tried if r.actors == best
    )
    out["rough_actors"] = (
        settings.learner_tokens_per_s * settings.gen_tokens
        / (settings.actor_tokens_per_s * settings.learner_tokens)
    )  # fmt: skip
    if args.actors is not None or measures is not None:
        n = args.actors if args.actors is not None else measures.actors  # type: ignore[union-attr]
        out["evaluated"] = _row(simulate(settings, n))
    if measures is not None:
        out["measured"] = {**dataclasses.asdict(measures), "lag_mean": measures.lag_mean}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(terminal_safe(_render(out)))
    return 0


def _render(out: dict) -> str:
    s = out["settings"]
    lines = [
        f"actor {s['actor_tokens_per_s']:.1f} tok/s per engine, learner "
        f"{s['learner_tokens_per_s']:.1f} tok/s, {s['gen_tokens']:.0f} generated / "
        f"{s['learner_tokens']:.0f} trained tokens per sample, {s['tasks_per_step']} x "
        f"{s['group_size']} samples per step, max_version_lag {s['max_version_lag']}, "
        f"publish {s['publish_s']:.2f} s",
        f"{'actors':>6} {'step_s':>9} {'samples/s':>9} {'learner':>8} {'actors':>8} "
        f"{'backlog':>8} {'max':>6} {'lag':>6}  {'lag hist':<16} bottleneck",
        f"{'':>6} {'':>9} {'':>9} {'idle':>8} {'idle':>8} {'mean':>8}",
    ]
    lines += [_line(r) for r in out["tried"]]
    best = out["recommended_actors"]
    if out["target_met"]:
        lines.append(f"recommended: {best} actor(s) keep the learner busy")
    else:
        idle = next(r for r in out["tried"] if r["actors"] == best)["learner_idle_fraction"]
        lines.append(
            f"no count up to {best} actors keeps the learner idle at most {TARGET_IDLE:.0%} of "
            f"the time (with {best}: {idle:.0%}); the rates call for about "
            f"{out['rough_actors']:.3g} actors (learner tokens/s × generated tokens ÷ actor "
            "tokens/s ÷ trained tokens)"
        )
    if "evaluated" in out:
        lines += ["evaluated:", _line(out["evaluated"])]
    if "measured" in out:
        m = out["measured"]
        hist = " ".join(f"{k}:{v:.0%}" for k, v in m["lag_hist"].items())
        lines.append(
            f"measured ({m['steps']} steps): step {m['step_s']:.2f} s, learner idle "
            f"{m['learner_idle_fraction']:.0%}, actors idle {m['actor_idle_fraction']:.0%}, "
            f"backlog {m['backlog_mean']:.1f}, lag {m['lag_mean']:.2f} ({hist})"
        )
    return "\n".join(lines)
