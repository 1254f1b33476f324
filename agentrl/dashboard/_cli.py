"""``agentrl dashboard RUN [--compare RUN2 ...] [--out FILE]``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from agentrl._report_term import terminal_safe

from ._page import write_dashboard


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="agentrl dashboard",
        description="Write a run's interactive dashboard (one self-contained HTML page).",
    )
    parser.add_argument("run", help="a training run's output folder (agentrl train --out)")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="RUN2",
        help="overlay another run's curves (repeatable)",
    )
    parser.add_argument("--out", default=None, help="the page's path (default RUN/dashboard.html)")
    args = parser.parse_args(list(argv))
    path = write_dashboard(args.run, compare=args.compare, out=args.out)
    print(terminal_safe(f"wrote {path}"))  # a folder name is run data too
    return 0
