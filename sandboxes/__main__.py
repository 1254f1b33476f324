"""``python -m agentrl.sandboxes`` (also ``agentrl sandbox …``): build images, serve a pool.

image build [--tag TAG] [--force]      debootstrap minbase + python3, then docker import
serve --backend docker --port 8090     the HTTP service (aiohttp)
"""

from __future__ import annotations

import argparse
import sys

from ._config import DEFAULT_IMAGE
from ._errors import SandboxError


def main(argv: list[str] | None = None, *, prog: str = "python -m agentrl.sandboxes") -> int:
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="command", required=True)
    image = sub.add_parser("image", help="sandbox images").add_subparsers(
        dest="action", required=True
    )
    build = image.add_parser("build", help="debootstrap minbase + python3, then docker import")
    build.add_argument("--tag", default=DEFAULT_IMAGE, help=f"image tag (default {DEFAULT_IMAGE})")
    build.add_argument("--force", action="store_true", help="re-import even when the tag exists")
    build.add_argument("--mirror", default=None, help="Debian mirror URL for debootstrap")
    serve = sub.add_parser("serve", help="serve a sandbox pool over HTTP")
    from ._serve import build_parser, run_from_args  # aiohttp is only needed here

    build_parser(serve)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_from_args(args)
    from ._image import build_image

    try:
        build_image(
            args.tag, force=args.force, mirror=args.mirror, progress=lambda s: print(s, flush=True)
        )
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
