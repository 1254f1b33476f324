"""Every third-party module the package imports is declared in pyproject.toml, as a dependency
or in an extra (the ``test`` extra does not count: it is not installed for users)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INDIRECT = {"torch.utils.tensorboard": "tensorboard"}
"""Imports that need a distribution other than their top-level module's."""


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = {k: v for k, v in project["optional-dependencies"].items() if k != "test"}
    lines = [*project["dependencies"], *(line for group in extras.values() for line in group)]
    return {_normalize(re.match(r"[A-Za-z0-9._-]+", line)[0]) for line in lines}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _package_dirs() -> list[Path]:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return sorted({REPO / path for path in setuptools["package-dir"].values()})


def _imports() -> dict[str, set[str]]:
    """``{imported module: files}`` over every module of the package (absolute imports)."""
    found: dict[str, set[str]] = {}
    for root in _package_dirs():
        for file in root.rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    found.setdefault(name, set()).add(str(file.relative_to(REPO)))
    return found


def _distributions(module: str) -> set[str]:
    if module in INDIRECT:
        return {INDIRECT[module]}
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in ("agentrl", "__future__"):
        return set()
    dists = metadata.packages_distributions().get(top)
    return {_normalize(d) for d in dists} if dists else {_normalize(top)}


def test_every_imported_distribution_is_declared():
    declared = _declared()
    missing = {}
    for module, files in sorted(_imports().items()):
        for dist in _distributions(module) - declared:
            missing.setdefault(dist, set()).update(files)
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(
        f"{dist} (in {', '.join(sorted(files)[:3])})" for dist, files in sorted(missing.items())
    )


def test_the_check_sees_the_package():
    """Guards the test above against checking nothing: it parses the mapped packages and
    finds their third-party imports."""
    imports = _imports()
    assert {"torch", "yaml", "aiohttp", "deepspeed", "docker"} <= set(imports)
    assert any(f.startswith("sandboxes/") for f in imports["aiohttp"])
    assert _distributions("yaml") == {"pyyaml"}
    assert _distributions("torch.utils.tensorboard") == {"tensorboard"}
