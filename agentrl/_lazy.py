"""Packages that load their heavy names on first use (PEP 562).

A package lists its lazily loaded names in a table (name → submodule), imports them under
``if TYPE_CHECKING:`` for static tools, and binds::

    __dir__ = _lazy.lazy_dir(__name__, __all__)
    if not TYPE_CHECKING:  # hidden from type checkers, so a misspelt name is an error there
        __getattr__ = _lazy.lazy_getattr(__name__, _LAZY)

The first access imports the submodule and caches the value on the package, so later lookups
do not come back here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], object]:
    """The package's ``__getattr__``: ``table[name]`` is the submodule (``_runtime``) that
    defines ``name``; any other name is an ``AttributeError``."""

    def __getattr__(name: str) -> object:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{table[name]}", package), name)
        setattr(sys.modules[package], name, value)  # the next lookup does not come here
        return value

    return __getattr__


def lazy_dir(package: str, names: Sequence[str]) -> Callable[[], list[str]]:
    """The package's ``__dir__``: what it has bound so far and every name of ``names``
    (its ``__all__``), loaded or not."""

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __dir__
