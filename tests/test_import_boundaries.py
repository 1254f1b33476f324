"""Enforce DESIGN.md "Packages and who may import whom" by parsing every module's imports.

Every import counts: module level, inside functions, and inside ``if TYPE_CHECKING:`` blocks
(strict and simple: a type-only edge is still an edge a reader has to follow).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# top-level folders and the package each one is (pyproject's package-dir mapping)
FOLDERS = {
    "agentrl": "agentrl",
    "envs": "agentrl.envs",
    "sandboxes": "agentrl.sandboxes",
    "kernels": "agentrl.kernels",
    "trainer": "agentrl.trainer",
}
STDLIB = frozenset(sys.stdlib_module_names)
THIRD_PARTY_ALLOWED = {
    "sandboxes": frozenset({"msgspec", "aiohttp", "httpx", "docker", "anyio", "pydantic"}),
    "kernels": frozenset({"torch", "triton"}),
}


@dataclass(frozen=True)
class Edge:
    importer: str
    target: str
    lineno: int


def module_name(path: Path) -> tuple[str, bool]:
    """Dotted module name for a file under ROOT, and whether it is a package ``__init__``."""
    rel = path.relative_to(ROOT)
    package = FOLDERS[rel.parts[0]]
    parts = [*package.split("."), *rel.parts[1:]]
    is_package = parts[-1] == "__init__.py"
    if is_package:
        parts.pop()
    else:
        parts[-1] = parts[-1].removesuffix(".py")
    return ".".join(parts), is_package


def imports(module: str, source: str, *, is_package: bool = False) -> Iterator[Edge]:
    """Every module ``module`` imports, with relative imports resolved.

    ``from pkg import name`` yields ``pkg`` and, when ``pkg.name`` is one of our modules (or
    looks like one: ``agentrl...``), ``pkg.name`` too, so ``from agentrl import _types`` is seen
    as importing ``agentrl._types``.
    """
    tree = ast.parse(source, filename=module)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = node.module or ""
            yield Edge(module, base, node.lineno)
            if base == "agentrl" or base.startswith("agentrl."):
                for alias in node.names:
                    if alias.name != "*" and _looks_like_module(base, alias.name):
                        yield Edge(module, f"{base}.{alias.name}", node.lineno)


_SUBPACKAGES = frozenset(
    {"envs", "sandboxes", "kernels", "trainer", "engine", "loop", "cli", "docs"}
)


def _looks_like_module(base: str, name: str) -> bool:
    """``from base import name``: is ``name`` a submodule? Yes when it is private, names one of
    the table's packages, or a file or folder of that name exists."""
    return (
        name.startswith("_")
        or (base == "agentrl" and name in _SUBPACKAGES)
        or (base, name) in _KNOWN_SUBMODULES
    )


def _all_files() -> list[Path]:
    files = []
    for folder in FOLDERS:
        files.extend(sorted((ROOT / folder).rglob("*.py")))
    return [f for f in files if "__pycache__" not in f.parts]


_KNOWN_SUBMODULES = {
    tuple(module_name(f)[0].rsplit(".", 1)) for f in _all_files() if "." in module_name(f)[0]
}


def package_of(module: str) -> str:
    """Which row of the table a module of ours belongs to."""
    parts = module.split(".")
    if parts[0] != "agentrl":
        raise ValueError(module)
    sub = parts[1] if len(parts) > 1 else ""
    if sub in ("envs", "sandboxes", "kernels", "trainer", "engine"):
        return sub
    # plan reads the algorithm table and run ledgers; dashboard reads run folders
    if sub in ("loop", "cli", "docs", "plan", "dashboard"):
        return "root"
    return "core"


def _is_private(module: str, below: str) -> bool:
    """Does ``module`` reach into a private module (``_x``) below the package ``below``?"""
    rest = module.removeprefix(below).strip(".")
    return any(part.startswith("_") for part in rest.split(".") if part)


def check_edge(edge: Edge) -> str | None:
    """The rule ``edge`` breaks, or None."""
    importer, target = edge.importer, edge.target
    src = package_of(importer)
    top = target.split(".")[0]
    where = f"{importer}:{edge.lineno} imports {target}"
    if top != "agentrl":
        allowed = THIRD_PARTY_ALLOWED.get(src)
        if allowed is not None and top not in STDLIB and top not in allowed:
            return f"{where}: agentrl.{src} may import only the stdlib and {sorted(allowed)}"
        return None
    dst = package_of(target)
    if dst == src:
        return None  # a package may always import itself
    if dst == "root":
        return f"{where}: only the composition roots import agentrl.loop / agentrl.cli"
    match src:
        case "core" | "engine":
            if dst in ("envs", "sandboxes", "trainer"):
                return f"{where}: core must not import agentrl.{dst}"
            if dst == "kernels" and src != "engine":
                return f"{where}: only agentrl.engine may import agentrl.kernels"
        case "sandboxes":
            return f"{where}: agentrl.sandboxes imports nothing else of agentrl"
        case "kernels":
            return f"{where}: agentrl.kernels imports nothing else of agentrl"
        case "trainer":
            if dst in ("envs", "sandboxes", "engine"):
                return f"{where}: agentrl.trainer must not import agentrl.{dst}"
        case "envs":
            if dst in ("engine", "trainer", "kernels"):
                return f"{where}: agentrl.envs must not import agentrl.{dst}"
            if dst == "core" and _is_private(target, "agentrl"):
                return f"{where}: agentrl.envs may use only the public core API"
            if dst == "sandboxes" and _is_private(target, "agentrl.sandboxes"):
                return f"{where}: agentrl.envs may use only the public sandboxes API"
        case "root":
            return None
    return None


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    out = []
    for edge in imports(module, source, is_package=is_package):
        problem = check_edge(edge)
        if problem is not None:
            out.append(problem)
    return out


# -- the real code ---------------------------------------------------------------------------


def test_every_module_respects_the_table():
    files = _all_files()
    names = {module_name(f)[0] for f in files}
    # the scan is not vacuous: it sees core, the mapped folders and private modules
    assert {"agentrl", "agentrl._registry", "agentrl.envs", "agentrl.envs.calc"} <= names
    assert {"agentrl.sandboxes", "agentrl.kernels", "agentrl.trainer"} <= names
    problems = []
    for path in files:
        module, is_package = module_name(path)
        problems.extend(violations(module, path.read_text(), is_package=is_package))
    assert problems == [], "\n".join(problems)


def test_calc_edges_are_seen():
    path = ROOT / "envs" / "calc.py"
    targets = {e.target for e in imports("agentrl.envs.calc", path.read_text())}
    assert "agentrl" in targets and "fractions" in targets


# -- the checker itself ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "source", "is_package", "rule"),
    [
        ("agentrl._rollout", "import agentrl.envs.calc", False, "core must not import"),
        ("agentrl.formats._x", "from ..envs import calc", False, "core must not import"),
        ("agentrl.formats", "from ..sandboxes import Pool", True, "core must not import"),
        ("agentrl._x", "from .trainer import learner", False, "core must not import"),
        ("agentrl._x", "from . import cli", False, "composition roots"),
        ("agentrl._x", "from agentrl import loop", False, "composition roots"),
        ("agentrl._x", "from agentrl import envs", False, "core must not import"),
        ("agentrl._x", "import agentrl.loop", False, "composition roots"),
        ("agentrl._x", "from agentrl.kernels import fused", False, "only agentrl.engine"),
        (
            "agentrl._x",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import agentrl.envs\n",
            False,
            "core must not import",
        ),
        ("agentrl._x", "def f():\n    from agentrl.envs import calc\n", False, "core must"),
        ("agentrl.engine._x", "from ..envs import calc", False, "core must not import"),
        ("agentrl.sandboxes._pool", "import agentrl", False, "imports nothing else"),
        ("agentrl.sandboxes._pool", "from .. import _types", False, "imports nothing else"),
        ("agentrl.sandboxes._pool", "import numpy", False, "only the stdlib"),
        ("agentrl.sandboxes._pool", "from torch import nn", False, "only the stdlib"),
        ("agentrl.kernels._x", "import numpy as np", False, "only the stdlib"),
        ("agentrl.kernels._x", "from agentrl._types import Span", False, "imports nothing"),
        ("agentrl.trainer._x", "from agentrl.engine import EmbeddedEngine", False, "engine"),
        ("agentrl.trainer._x", "import agentrl.sandboxes", False, "must not import"),
        ("agentrl.trainer", "from ..envs import calc", True, "must not import"),
        ("agentrl.envs.calc", "from agentrl._types import Message", False, "public core API"),
        ("agentrl.envs.calc", "from agentrl import _registry", False, "public core API"),
        ("agentrl.envs.calc", "from agentrl.formats._hermes import x", False, "public core"),
        ("agentrl.envs.calc", "import agentrl.engine", False, "must not import"),
        ("agentrl.envs.calc", "from agentrl.trainer import x", False, "must not import"),
        ("agentrl.envs.calc", "from agentrl.sandboxes._pool import P", False, "public sand"),
        ("agentrl.envs.code", "from ..loop import train", False, "composition roots"),
    ],
)
def test_checker_catches(module, source, is_package, rule):
    found = violations(module, source, is_package=is_package)
    assert len(found) >= 1 and any(rule in f for f in found), found


@pytest.mark.parametrize(
    ("module", "source", "is_package"),
    [
        ("agentrl._rollout", "from .formats import Piece\nfrom ._types import Message", False),
        ("agentrl.formats", "from ._base import Piece\nfrom .. import _errors", True),
        ("agentrl.engine._x", "from agentrl.kernels import fused\nimport torch", False),
        ("agentrl._x", "import rich, httpx, torch, transformers", False),
        ("agentrl.sandboxes._pool", "import docker, aiohttp, json\nfrom . import _x", False),
        ("agentrl.sandboxes", "from ._pool import Pool as Pool\nimport msgspec", True),
        (
            "agentrl.kernels._x",
            "import torch\nimport triton.language as tl\nfrom . import _y",
            False,
        ),
        ("agentrl.trainer._x", "from agentrl._types import Trajectory\nimport deepspeed", False),
        ("agentrl.trainer._x", "from agentrl.kernels import fused", False),
        ("agentrl.envs.calc", "import agentrl\nfrom agentrl import Episode, Message", False),
        ("agentrl.envs.code", "from agentrl.formats import parse_hermes", False),
        ("agentrl.envs.code", "from agentrl.sandboxes import SandboxClient", False),
        ("agentrl.envs.code", "from ._util import helper\nfrom . import calc", False),
        ("agentrl.loop", "from agentrl.envs import calc\nfrom agentrl.engine import x", False),
        ("agentrl.cli", "from . import loop\nfrom .trainer import Learner", False),
    ],
)
def test_checker_allows(module, source, is_package):
    assert violations(module, source, is_package=is_package) == []


def test_relative_imports_resolve():
    edges = imports("agentrl.formats._boundary", "from .._types import Message\nfrom . import x")
    assert [e.target for e in edges][:2] == ["agentrl._types", "agentrl.formats"]
    edges = imports("agentrl.formats", "from . import _base", is_package=True)
    assert [e.target for e in edges] == ["agentrl.formats", "agentrl.formats._base"]
    with pytest.raises(ValueError, match="beyond the top"):
        list(imports("agentrl._x", "from ... import y"))
