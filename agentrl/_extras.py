"""Which extra to install when a command needs an optional dependency that is missing.

The answer comes from the installed distribution's own metadata (``Requires-Dist`` with
``extra == "…"`` markers, i.e. pyproject's ``optional-dependencies``), so it cannot drift from
what ``pip install 'agentrl[extra]'`` actually installs.
"""

from __future__ import annotations

import re
from importlib import metadata

DISTRIBUTION = "agentrl"
IMPORT_NAMES = {"yaml": "pyyaml", "mlflow": "mlflow-skinny"}
"""Import names whose distribution is named differently (the rest are the same)."""
COMMAND_EXTRAS = {
    "serve": "serve",
    "sandbox": "sandbox",
    "train": "train",
    "eval": "train",
    "export": "train",
    "dashboard": "dashboard",
}
"""The extra a command is documented with, preferred when several extras hold the module."""
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements() -> dict[str, set[str]]:
    """``{distribution: extras that declare it}`` (the empty string: a core dependency)."""
    out: dict[str, set[str]] = {}
    for line in metadata.requires(DISTRIBUTION) or []:
        name = _NAME.match(line)
        if name is None:
            continue
        extra = _EXTRA.search(line)
        out.setdefault(_normalize(name[1]), set()).add(extra[1] if extra else "")
    return out


def missing_dependency_message(exc: ModuleNotFoundError, command: str | None) -> str | None:
    """What to tell a user whose ``command`` stopped on ``exc``; None when the missing module
    is not one of agentrl's declared dependencies (then it is a bug, not a missing extra)."""
    module = (exc.name or "").split(".")[0]
    if not module or module == DISTRIBUTION:
        return None
    dist = _normalize(IMPORT_NAMES.get(module, module))
    try:
        extras = declared_requirements().get(dist)
    except metadata.PackageNotFoundError:
        return None
    if not extras:
        return None
    what = f"agentrl {command}" if command else "this command"
    if "" in extras:
        return (
            f"{what} needs {module!r} (a dependency of agentrl), which is not installed: "
            "reinstall agentrl (pip install agentrl)"
        )
    preferred = COMMAND_EXTRAS.get(command or "")
    usable = sorted(e for e in extras if e != "test")
    extra = preferred if preferred in extras else (usable or sorted(extras))[0]
    return f"{what} needs {module!r}, which is not installed: pip install 'agentrl[{extra}]'"
