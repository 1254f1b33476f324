"""The dashboard's panels: which run fields each one plots, as plotly.js figures (plain
traces and layouts; the page draws them). A panel whose fields this run never wrote carries
the reason instead of an empty plot."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ._read import RunData

Trace = dict[str, Any]
DASHES = ("solid", "dash", "dot", "dashdot")
QUANTILES = (0.1, 0.5, 0.9)


@dataclass
class Panel:
    id: str
    title: str
    traces: list[Trace]
    layout: dict[str, Any]
    missing: str | None = None
    """Why there is no plot: the fields looked for that no run wrote."""
    note: str = ""


@dataclass
class _Spec:
    id: str
    title: str
    traces: Callable[[RunData], list[Trace]]
    looked_for: str
    """What the panel reads, for the message when no run has it."""
    layout: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def _number(value: Any) -> float | None:
    """``value`` as a finite float; None for anything else (a bool, text, NaN, an integer too
    large for a float: the plot has a gap there)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def plotly_text(text: str) -> str:
    """``text`` shown as itself by plotly.js, which reads trace names, legends, hover labels,
    titles and annotations as its own HTML subset (``<a href>``, ``<span style>``, ``<br>``
    and entities): ``&``, ``<`` and ``>`` become entities, which plotly draws as the
    characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _lag_key(key: Any) -> int | None:
    """A version-lag histogram key: the digits of a lag (``"3"``), nothing looser."""
    return int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None


def series(rows: Iterable[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of the rows where both fields are finite numbers."""
    xs, ys = [], []
    for row in rows:
        px, py = _number(row.get(x)), _number(row.get(y))
        if px is not None and py is not None:
            xs.append(px)
            ys.append(py)
    return xs, ys


def _trace(name: str, xs: list[float], ys: list[float], **kw: Any) -> Trace:
    """A plotly line of points (``kw`` adds to or replaces its settings: ``mode``, ...)."""
    return {"type": "scatter", "mode": "lines+markers", "name": name, "x": xs, "y": ys, **kw}


def _line(rows: list[dict[str, Any]], x: str, y: str, name: str | None = None, **kw: Any):
    xs, ys = series(rows, x, y)
    if not xs:
        return []
    return [_trace(name or y, xs, ys, **kw)]


def _lines(rows: list[dict[str, Any]], x: str, names: dict[str, str], **kw: Any) -> list[Trace]:
    return [t for key, name in names.items() for t in _line(rows, x, key, name, **kw)]


def _ledger(*keys: str, names: dict[str, str] | None = None, y2: Iterable[str] = ()):
    """Ledger fields against the step; ``y2``: those drawn on the right-hand axis."""
    right = set(y2)

    def traces(run: RunData) -> list[Trace]:
        out = []
        for key in keys:
            extra = {"yaxis": "y2"} if key in right else {}
            out += _line(run.ledger, "step", key, (names or {}).get(key, key), **extra)
        return out

    return traces


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty list."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def reward_quantiles(run: RunData) -> dict[float, tuple[list[int], list[float]]]:
    """Per quantile, the steps and that quantile of each step's trajectory rewards."""
    steps = sorted(s for s, r in run.steps.items() if r.rewards)
    return {q: (steps, [quantile(run.steps[s].rewards, q) for s in steps]) for q in QUANTILES}


def _reward(run: RunData) -> list[Trace]:
    out: list[Trace] = []
    quantiles = reward_quantiles(run)
    steps, low = quantiles[QUANTILES[0]]
    if steps:
        _, high = quantiles[QUANTILES[-1]]
        _, median = quantiles[0.5]
        band = {"type": "scatter", "mode": "lines", "x": steps, "line": {"width": 0}}
        out.append({**band, "name": "p10", "y": low, "showlegend": False})
        out.append({**band, "name": "p10–p90", "y": high, "fill": "tonexty"})
        out.append({"type": "scatter", "mode": "lines", "name": "median", "x": steps, "y": median})
    out += _line(run.ledger, "step", "reward_mean", "mean")
    out += _line(run.ledger, "step", "pass_rate", "pass rate")
    return out


MAX_KEYED_TRACES = 40
"""The most lines a panel draws for keys a run names itself (reward breakdown keys, termination
reasons): the ones with the most points (a key per task would make thousands)."""


def _keyed(rows: list[dict[str, Any]], prefix: str) -> dict[str, tuple[list[float], list[float]]]:
    """Per field starting with ``prefix``, its (step, value) points, in one pass over the rows
    (not one per key: a ledger whose keys differ by step has as many keys as rows); at most
    ``MAX_KEYED_TRACES`` keys, those with the most points."""
    points: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        step = _number(row.get("step"))
        if step is None:
            continue
        for key, value in row.items():
            if key.startswith(prefix):
                y = _number(value)
                if y is not None:
                    xs, ys = points.setdefault(key, ([], []))
                    xs.append(step)
                    ys.append(y)
    kept = sorted(points, key=lambda k: (-len(points[k][0]), k))[:MAX_KEYED_TRACES]
    return {k: points[k] for k in sorted(kept)}


def _traces(points: dict[str, tuple[list[float], list[float]]], strip: str) -> list[Trace]:
    return [_trace(k.removeprefix(strip), xs, ys) for k, (xs, ys) in points.items()]


def _breakdown(run: RunData) -> list[Trace]:
    return _traces(_keyed(run.ledger, "reward/"), "reward/")


def _eval(run: RunData) -> list[Trace]:
    out = [t for k in ("eval_reward_mean", "eval_pass_rate")
           for t in _line(run.ledger, "step", k, k.removeprefix("eval_"))]  # fmt: skip
    return out + _traces(_keyed(run.ledger, "eval_reward/"), "eval_")


def _runtime(*keys: str, names: dict[str, str] | None = None):
    def traces(run: RunData) -> list[Trace]:
        return _lines(run.runtime, "time_s", {k: (names or {}).get(k, k) for k in keys})

    return traces


def _backlog(run: RunData) -> list[Trace]:
    keys = {"buffer_backlog": "backlog (groups)", "in_flight_groups": "in flight (groups)"}
    # a run without interval records falls back to the per-step values: a step axis of its own
    return _lines(run.runtime, "time_s", keys) or _lines(run.ledger, "step", keys, xaxis="x2")


def _time_or_step_axis(traces: list[Trace], layout: dict[str, Any]) -> dict[str, Any]:
    """The layout for traces on seconds (``x``) and per-step ones (``x2``): one axis titled
    for what it shows, or both (steps on top) when runs of each kind are overlaid."""
    on_steps = [t for t in traces if t.get("xaxis") == "x2"]
    if not on_steps:
        return layout
    if len(on_steps) == len(traces):
        for trace in on_steps:
            del trace["xaxis"]
        return {**layout, "xaxis": {"title": {"text": "step"}}}
    step_axis = {"title": {"text": "step (runs without runtime.jsonl records)"}}
    return {**layout, "xaxis2": {**step_axis, "overlaying": "x", "side": "top"}}


def lag_histogram(run: RunData) -> dict[int, float]:
    """Groups consumed at each version lag over the run (the steps' windows summed; the
    interval records' when the ledger has none)."""
    for rows in (run.ledger, run.runtime):
        total: dict[int, float] = {}
        for row in rows:
            hist = row.get("version_lag_hist")
            if not isinstance(hist, dict):
                continue
            for key, count in hist.items():
                try:
                    lag = _lag_key(key)
                except ValueError:  # more digits than int() takes
                    continue
                if lag is not None:
                    total[lag] = total.get(lag, 0.0) + (_number(count) or 0.0)
        if total:
            return dict(sorted(total.items()))
    return {}


def _lag(run: RunData) -> list[Trace]:
    hist = lag_histogram(run)
    if not hist:
        return []
    return [{"type": "bar", "name": "groups", "x": list(hist), "y": list(hist.values())}]


LAG_TICKS_EVERY_VERSION = 50
"""A lag axis spanning at most this many versions has a tick per version; a wider one
(a run's hostile or broken histogram: 1e15) gets plotly's own ticks, not millions of them."""


def _lag_layout(runs: list[RunData]) -> dict[str, Any]:
    lags = [lag for run in runs for lag in lag_histogram(run)]
    axis: dict[str, Any] = {"title": {"text": "versions behind"}}
    if lags and max(lags) - min(lags) <= LAG_TICKS_EVERY_VERSION:
        axis["dtick"] = 1
    return {"xaxis": axis}


STEP_TIME = {
    "rollout_s": "rollout (waiting for groups)",
    "reference_s": "reference",
    "logprob_s": "logprob",
    "update_s": "update",
    "publish_s": "publish",
    "checkpoint_s": "checkpoint",
    "dashboard_s": "dashboard",
    "eval_s": "evaluation",
}


def _step_time(run: RunData) -> list[Trace]:
    out: list[Trace] = []
    rows = [r for r in run.ledger if "step_s" in r]  # training steps (not the step-0 eval)
    for key, name in STEP_TIME.items():
        out += _line(rows, "step", key, name, mode="lines", stackgroup="{run}")
    out += _line(rows, "step", "step_s", "step (total)", line={"color": "black", "dash": "dot"})
    return out


def _termination(run: RunData) -> list[Trace]:
    """Stacked counts per reason; a reason a step did not report counts 0 there (each trace
    has every step: a stack needs them), for at most ``MAX_KEYED_TRACES`` reasons."""
    rows = [r for r in run.ledger if isinstance(r.get("termination"), dict)]
    flat = [{"step": r.get("step"), **{f"n/{k}": v for k, v in r["termination"].items()}}
            for r in rows]  # fmt: skip
    out: list[Trace] = []
    for key in _keyed(flat, "n/"):
        xs, ys = [], []
        for row in flat:  # a row per step record, as written (a resumed run may repeat steps)
            x = _number(row.get("step"))
            if x is not None:
                xs.append(x)
                ys.append(_number(row.get(key)) or 0.0)
        out.append(_trace(key.removeprefix("n/"), xs, ys, mode="lines", stackgroup="{run}"))
    return out


def _tools(run: RunData) -> list[Trace]:
    out = _ledger(
        "tool_calls_per_trajectory",
        "tool_errors_per_trajectory",
        names={
            "tool_calls_per_trajectory": "calls / trajectory",
            "tool_errors_per_trajectory": "errors / trajectory",
        },
    )(run)
    valid = []
    for row in run.ledger:
        calls = _number(row.get("tool_calls_per_trajectory"))
        errors = _number(row.get("tool_errors_per_trajectory"))
        if calls and errors is not None:
            valid.append({"step": row.get("step"), "v": max(0.0, 1.0 - errors / calls)})
    return out + _line(valid, "step", "v", "valid fraction of calls", yaxis="y2")


def _y2(title: str, **kw: Any) -> dict[str, Any]:
    axis = {"title": {"text": title}, "overlaying": "y", "side": "right", "showgrid": False}
    return {"yaxis2": {**axis, "tickmode": "auto", **kw}}  # its own ticks, not the left's


def _specs() -> list[_Spec]:
    step = {"xaxis": {"title": {"text": "step"}}}
    time = {"xaxis": {"title": {"text": "seconds since start"}}}
    sandbox_failures = ("timeouts", "sandbox_errors", "create_failures", "recycles", "busy_waits")
    return [
        _Spec(
            "reward",
            "Reward (training trajectories)",
            _reward,
            "reward_mean in ledger.jsonl, rewards in trajectories.jsonl",
            step,
            "Band: 10th–90th percentile of each step's trajectory rewards.",
        ),
        _Spec("reward_breakdown", "Reward breakdown", _breakdown, "reward/<key> fields", step),
        _Spec("eval", "Held-out evaluation", _eval, "eval_* fields (eval.every_steps)", step),
        _Spec(
            "kl_entropy",
            "KL and entropy",
            _ledger("kl", "approx_kl", "kl_loss", "entropy", y2=("entropy",)),
            "kl, approx_kl, entropy",
            {**step, **_y2("entropy (nats)")},
        ),
        _Spec(
            "clip",
            "Clip fractions",
            _ledger(
                "clip_fraction",
                "clip_fraction_low",
                "clip_fraction_high",
                "clip_fraction_dual",
                "tis_clip_fraction",
            ),
            "clip_fraction*",
            step,
        ),
        _Spec(
            "mismatch",
            "Rollout ↔ trainer logprob mismatch",
            _ledger("mismatch_abs_mean", "mismatch_abs_max", "mismatch_kl"),
            "mismatch_* fields",
            {**step, "yaxis": {"type": "log", "exponentformat": "e"}},
            "Sampled logprobs against the learner's recomputation of the same tokens (log scale).",
        ),
        _Spec(
            "tokens_interval",
            "Tokens per interval",
            _runtime(
                "generated_tokens",
                "trained_tokens",
                names={"generated_tokens": "generated", "trained_tokens": "trained"},
            ),
            "interval records in runtime.jsonl (one every logging.interval_s seconds and one "
            "at the end of each run: none when that is 0, or the run was killed before either)",
            time,
        ),
        _Spec(
            "tokens_step",
            "Tokens per step",
            _ledger(
                "gen_tokens",
                "learner_tokens",
                "gen_tokens_per_s",
                "learner_tokens_per_s",
                y2=("gen_tokens_per_s", "learner_tokens_per_s"),
            ),
            "gen_tokens, learner_tokens",
            {**step, **_y2("tokens/s")},
        ),
        _Spec("backlog", "Buffer backlog", _backlog, "buffer_backlog, in_flight_groups", time),
        _Spec(
            "version_lag",
            "Version lag of consumed groups",
            _lag,
            "version_lag_hist",
            {"barmode": "group"},
        ),
        _Spec(
            "discarded",
            "Discarded and failed samples",
            _ledger(
                "groups_stale",
                "groups_dropped",
                "groups_timed_out",
                "groups_surplus",
                "groups_filtered",
                "errors",
                names={"errors": "failed trajectories"},
            ),
            "groups_stale, groups_dropped, groups_timed_out, errors",
            step,
        ),
        _Spec(
            "step_time",
            "Step time split (seconds)",
            _step_time,
            "step_s, rollout_s, update_s, publish_s",
            step,
        ),
        _Spec(
            "publish",
            "Weight publication",
            _ledger("publish_s", "gather_s", "publish_bytes", y2=("publish_bytes",)),
            "publish_s, publish_bytes",
            {**step, **_y2("bytes")},
        ),
        _Spec(
            "sandbox_latency",
            "Sandbox execution latency (seconds)",
            _ledger(
                "sandbox/exec_s_p50",
                "sandbox/exec_s_p99",
                "sandbox/request_s_p50",
                "sandbox/request_s_p99",
            ),
            "sandbox/* fields (environments that run code)",
            step,
        ),
        _Spec(
            "sandbox_failures",
            "Sandbox executions and failures",
            _ledger(
                "sandbox/execs", *(f"sandbox/{k}" for k in sandbox_failures), y2=("sandbox/execs",)
            ),
            "sandbox/* fields (environments that run code)",
            {**step, **_y2("executions")},
        ),
        _Spec(
            "tools",
            "Tool calls",
            _tools,
            "tool_calls_per_trajectory",
            {**step, **_y2("valid fraction", range=[0, 1.05])},
        ),
        _Spec(
            "termination",
            "Termination reasons (trajectories)",
            _termination,
            "termination",
            step,
        ),
        _Spec(
            "idle",
            "Idle fractions",
            _ledger("actor_idle_fraction", "learner_idle_fraction"),
            "actor_idle_fraction, learner_idle_fraction",
            {**step, "yaxis": {"range": [0, 1.05]}},
        ),
    ]


def build_panels(runs: list[RunData]) -> list[Panel]:
    """Every panel for ``runs`` (several: overlaid, each run's traces named after it and drawn
    with its own dash)."""
    panels = []
    for spec in _specs():
        traces: list[Trace] = []
        for index, run in enumerate(runs):
            for trace in spec.traces(run):
                if trace.get("stackgroup") == "{run}":
                    trace["stackgroup"] = f"run{index}"
                if len(runs) > 1:
                    trace["name"] = f"{trace['name']} · {run.name}"
                    trace["legendgroup"] = f"run{index}"
                    if trace["type"] == "scatter":
                        trace["line"] = {**trace.get("line", {}), "dash": DASHES[index % 4]}
                trace["name"] = plotly_text(str(trace["name"]))  # names come from run data
                traces.append(trace)
        layout = {
            "margin": {"l": 55, "r": 55, "t": 10, "b": 45},
            "legend": {"orientation": "h", "y": -0.25},
            "hovermode": "x unified",
            **spec.layout,
            **(_lag_layout(runs) if spec.id == "version_lag" else {}),
        }
        if spec.id == "backlog":
            layout = _time_or_step_axis(traces, layout)
        missing = None
        if not traces:
            missing = f"No data in this run: it wrote no {spec.looked_for}."
        panels.append(Panel(spec.id, spec.title, traces, layout, missing, spec.note))
    return panels
