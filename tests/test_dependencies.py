"""Every third-party module the package imports is declared in pyproject.toml, as a dependency
or in an extra (the ``test`` extra does not count: it is not installed for users)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
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


def _run(code: str, cwd: Path, extra_path: list[str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(extra_path)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_the_kernels_folder_does_not_hide_the_kernels_distribution():
    """Run from a checkout's root (``python -c``/``-m`` put it first on ``sys.path``), the
    top-level ``kernels/`` folder would hide the ``kernels`` distribution that transformers
    imports (a hard dependency of recent releases): importing transformers' models must work
    and ``import kernels`` must give the distribution, while ``agentrl.kernels`` stays ours."""
    code = (
        "import sys, transformers\n"
        "from transformers import LlamaConfig\n"
        "import kernels, agentrl.kernels as ours\n"
        "print(kernels.__file__); print(ours.__file__); print(hasattr(ours, 'fused_policy_loss'))"
    )
    theirs, ours, has = _run(code, REPO).splitlines()
    assert Path(ours).resolve() == (REPO / "kernels" / "__init__.py").resolve()
    assert has == "True"
    try:
        metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        return  # nothing to hide: this transformers does not need it
    assert Path(theirs).resolve() != Path(ours).resolve(), theirs


def test_a_kernels_package_later_on_the_path_is_the_one_imported(tmp_path):
    """The hand-over finds any ``kernels`` past the checkout on ``sys.path`` (here a stand-in),
    and the checkout's own ``kernels`` is what ``agentrl.kernels`` names."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("NAME = 'stand-in'\nfrom . import sub\n")
    (fake / "sub.py").write_text("VALUE = 7\n")
    code = (
        f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(tmp_path / 'site')!r}]\n"
        "import kernels, kernels.sub\n"
        "print(kernels.NAME, kernels.sub.VALUE, sys.modules['kernels'] is kernels)"
    )
    assert _run(code, tmp_path) == "stand-in 7 True"
