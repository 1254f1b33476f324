"""Plot a training run's learning curve from its ledger: held-out (eval split) reward and pass
rate at each evaluation, and the training reward (on-policy samples) per step with a running
mean. Writes a PNG with matplotlib when it is installed, else an SVG drawn by hand.

    .venv/bin/python bench/plot_learning_curve.py runs/calc-grpo --out docs/learning_curve.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _series(ledger: list[dict]) -> dict[str, list[tuple[float, float]]]:
    train = [(r["step"], r["reward_mean"]) for r in ledger if r.get("reward_mean") is not None]
    window, smooth = 5, []
    for i in range(len(train)):
        chunk = train[max(0, i - window + 1) : i + 1]
        smooth.append((train[i][0], sum(v for _, v in chunk) / len(chunk)))
    evals = [r for r in ledger if r.get("eval_reward_mean") is not None]
    return {
        "train reward (per step)": train,
        f"train reward (mean of {window})": smooth,
        "held-out reward": [(r["step"], r["eval_reward_mean"]) for r in evals],
        "held-out pass rate": [(r["step"], r["eval_pass_rate"]) for r in evals],
    }


def _png(series, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    styles = {
        "train reward (per step)": {"color": "#bbbbbb", "lw": 1},
        "held-out reward": {"color": "#d62728", "lw": 2, "marker": "o"},
        "held-out pass rate": {"color": "#1f77b4", "lw": 2, "marker": "s"},
    }
    for name, points in series.items():
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=name, **styles.get(name, {"color": "#555555", "lw": 1.5}))
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("reward / pass rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def _svg(series, out: Path, title: str) -> None:
    width, height, pad = 800, 450, 50
    steps = [x for points in series.values() for x, _ in points] or [0, 1]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    sx = lambda x: pad + (x - x0) / (x1 - x0) * (width - 2 * pad)  # noqa: E731
    sy = lambda y: height - pad - y * (height - 2 * pad)  # noqa: E731
    colors = ["#bbbbbb", "#555555", "#d62728", "#1f77b4"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{pad}" y="20" font-size="12">{title}</text>',
        f'<line x1="{pad}" y1="{sy(0)}" x2="{width - pad}" y2="{sy(0)}" stroke="black"/>',
        f'<line x1="{pad}" y1="{sy(0)}" x2="{pad}" y2="{sy(1)}" stroke="black"/>',
    ]
    for i, (name, points) in enumerate(series.items()):
        if points:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{colors[i]}" stroke-width="2"/>'
            )
            parts.append(
                f'<text x="{width - pad - 180}" y="{pad + 16 * i}" fill="{colors[i]}" '
                f'font-size="11">{name}</text>'
            )
    parts.append("</svg>")
    out.write_text("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run", help="run directory (holds ledger.jsonl)")
    p.add_argument("--out", required=True, help="image path (.png, or .svg without matplotlib)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    run = Path(args.run)
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines() if x.strip()]
    series = _series(ledger)
    title = args.title or f"{run.name}: {len(ledger)} ledger lines"
    out = Path(args.out)
    try:
        if out.suffix == ".svg":
            raise ImportError
        _png(series, out, title)
    except ImportError:
        out = out.with_suffix(".svg")
        _svg(series, out, title)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
