"""``python -m agentrl.docs [--check] [--out DIR]``: write (or check) the reference pages."""

from __future__ import annotations

import argparse
import sys

from ._reference import REFRESH, stale_pages, write_reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentrl.docs",
        description="Render docs/reference/*.md from the code's fields and docstrings.",
    )
    parser.add_argument("--out", default="docs/reference", help="folder of the pages")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a page is stale"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages(args.out)
        for name, diff in stale.items():
            print(diff, end="")
            print(f"{args.out}/{name} is stale", file=sys.stderr)
        if stale:
            print(f"refresh with: {REFRESH}", file=sys.stderr)
            return 1
        print(f"{args.out}: current")
        return 0
    for path in write_reference(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
