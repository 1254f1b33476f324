"""Environment registry: versioned ids, a decorator, lazy module loading and entry points.

Modelled on Gymnasium's registry (``name-vN`` ids, ``module:name-vN`` imports ``module`` first,
an error hierarchy that suggests close matches), made for async textual environments.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import re
import sys
import threading
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ._config import short_repr
from ._env import Env
from ._errors import BadEnvSpec, DuplicateEnv, EnvError, NameNotFound, VersionNotFound

ENTRY_POINT_GROUP = "agentrl.envs"
_ID_RE = re.compile(
    r"(?:(?P<module>[A-Za-z_]\w*(?:\.\w+)*):)?(?P<name>[A-Za-z][\w./-]*?)-v(?P<version>\w+)"
)
_VERSION_RE = re.compile(r"0|[1-9][0-9]*")

T = TypeVar("T")


@dataclass(frozen=True)
class EnvSpec:
    """Everything the registry knows about one environment id."""

    id: str
    """``name-vN``."""
    name: str
    """The id without its version."""
    version: int
    """N of ``-vN``: ``0`` or a decimal number without leading zeros, in ASCII digits."""
    entry_point: Callable[..., Any]
    """A class or a factory; called with ``kwargs`` (merged with ``make`` kwargs) per trajectory."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Factory arguments fixed at registration (``make`` kwargs override them)."""
    description: str = ""
    """One line for ``agentrl envs list`` (default: the first paragraph of the docstring)."""
    max_turns: int = 8
    """Default turn budget for a trajectory, >= 1 (overridable per rollout)."""
    max_new_tokens: int = 256
    """Default per-turn token budget, >= 1."""
    tags: tuple[str, ...] = ()
    """Free-form labels."""
    module: str = ""
    """The module that registered it."""

    def make(self, **kwargs: Any) -> Env:
        """A fresh instance: ``entry_point(**{**self.kwargs, **kwargs})``."""
        merged = {**self.kwargs, **kwargs}
        try:
            return cast(Env, self.entry_point(**merged))
        except TypeError as exc:
            raise EnvError(f"{self.id}: cannot construct with {sorted(merged)}: {exc}") from exc
        except EnvError:
            raise
        except Exception as exc:
            given = f" (kwargs {merged})" if merged else ""
            raise EnvError(
                f"{self.id}: the constructor{given} raised {type(exc).__name__}: {exc}"
            ) from exc


_registry: dict[str, EnvSpec] = {}
_lock = threading.RLock()
_entry_points_loaded = False
_entry_point_errors: list[str] = []


def parse_env_id(env_id: str) -> tuple[str | None, str, int]:
    """Split ``[module:]name-vN`` into (module, name, version); BadEnvSpec if malformed.

    N is canonical: ``0`` or a decimal number without leading zeros, in ASCII digits, so that
    one version has one spelling (``calc-v1``, never ``calc-v01``)."""
    if not isinstance(env_id, str):
        raise BadEnvSpec(f"environment id must be a string, got {type(env_id).__name__}")
    m = _ID_RE.fullmatch(env_id)
    if m is None:
        module, _, name = env_id.rpartition(":")
        hint = ""
        if module.endswith(".py") and _ID_RE.fullmatch(name):  # a file path, not a module
            dotted = module.removesuffix(".py").removeprefix("./").replace("/", ".")
            hint = f"; a module is named by its import path: '{dotted}:{name}'"
        raise BadEnvSpec(
            f"malformed environment id {short_repr(env_id)}: expected 'name-vN' or "
            f"'module:name-vN' (e.g. 'calc-v0'){hint}"
        )
    version = m["version"]
    if not _VERSION_RE.fullmatch(version):
        canonical = ""
        if version.isascii() and version.isdigit():
            canonical = f" (e.g. '{m['name']}-v{version.lstrip('0') or '0'}')"
        raise BadEnvSpec(
            f"malformed environment id {short_repr(env_id)}: the version {version!r} must be 0 "
            f"or a decimal number without leading zeros, in ASCII digits{canonical}"
        )
    try:
        number = int(version)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise BadEnvSpec(
            f"malformed environment id {short_repr(env_id)}: the version has {len(version)} digits"
        ) from None
    if any(part in ("", ".", "..") for part in m["name"].split("/")):
        raise BadEnvSpec(
            f"malformed environment id {short_repr(env_id)}: a name's '/'-separated parts are "
            "names, never empty, '.' or '..' (an id names run folders)"
        )
    return m["module"], m["name"], number


def register(
    env_id: str,
    entry_point: Callable[..., Any],
    *,
    kwargs: dict[str, Any] | None = None,
    description: str = "",
    max_turns: int = 8,
    max_new_tokens: int = 256,
    tags: tuple[str, ...] = (),
) -> EnvSpec:
    """Register ``entry_point`` under ``env_id``.

    Registering the same id again with the *same* entry point (the same object, or the same
    class or function defined again: a module re-imported) replaces its settings; with any
    other it raises ``DuplicateEnv`` naming both (a lambda, a local function, a
    ``functools.partial`` or an instance is the same entry only as the same object). A bad
    value raises ``BadEnvSpec`` naming the field: ``max_turns`` and ``max_new_tokens`` are
    integers >= 1, ``kwargs`` a dict with string keys, ``description`` a string, ``tags``
    strings.
    """
    module, name, version = parse_env_id(env_id)
    if module is not None:
        raise BadEnvSpec(f"register {env_id!r}: the id must not carry a module prefix")
    if not callable(entry_point):
        raise BadEnvSpec(
            f"register {env_id!r}: entry point {short_repr(entry_point)} is not callable"
        )
    for field_name, value in (("max_turns", max_turns), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadEnvSpec(
                f"register {env_id!r}: {field_name} must be an integer >= 1, "
                f"got {short_repr(value)}"
            )
    if kwargs is not None and (
        not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)
    ):
        raise BadEnvSpec(
            f"register {env_id!r}: kwargs must be a dict with string keys, got {short_repr(kwargs)}"
        )
    if not isinstance(description, str):
        raise BadEnvSpec(
            f"register {env_id!r}: description must be a string, got {short_repr(description)}"
        )
    if not isinstance(tags, tuple | list) or not all(isinstance(tag, str) for tag in tags):
        raise BadEnvSpec(
            f"register {env_id!r}: tags must be a tuple of strings, got {short_repr(tags)}"
        )
    spec = EnvSpec(
        id=env_id,
        name=name,
        version=version,
        entry_point=entry_point,
        kwargs=dict(kwargs or {}),
        description=description or (entry_point.__doc__ or "").strip().split("\n\n")[0],
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        tags=tuple(tags),
        module=getattr(entry_point, "__module__", ""),
    )
    with _lock:
        existing = _registry.get(env_id)
        if existing is not None:
            if _same_entry(existing.entry_point, entry_point):
                _registry[env_id] = spec
                return spec
            raise DuplicateEnv(
                f"environment {env_id!r} is already registered by "
                f"{_describe_entry(existing.entry_point)}; refusing to register "
                f"{_describe_entry(entry_point)} under the same id (deregister it first, or "
                "choose another id or version)"
            )
        _registry[env_id] = spec
    return spec


def _defined_in(found: EnvSpec, module: str | None) -> bool:
    """Whether ``found``'s entry point is defined in ``module`` or a module under it."""
    return module is None or found.module == module or found.module.startswith(module + ".")


def _same_entry(a: Any, b: Any) -> bool:
    """Whether ``b`` is the entry point ``a`` again: the same object, the same importable
    definition (a module imported again makes new objects at the same module and qualified
    name), or the same method of the same entry."""
    if a is b:
        return True
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):
        return _same_entry(a.__self__, b.__self__) and _same_entry(a.__func__, b.__func__)
    return (
        _importable_name(a) is not None
        and _importable_name(a) == _importable_name(b)
        and isinstance(a, type) == isinstance(b, type)
    )


def _importable_name(obj: Any) -> str | None:
    """``module.qualname`` of a class or function that can be found by that name again; None
    for anything else (a lambda, a local definition, a ``functools.partial``, an instance):
    such an entry is the same entry only as the same object."""
    if not isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
        return None
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    return f"{module}.{qualname}"


def _describe_entry(obj: Any) -> str:
    """An entry point for an error message: its name and, for a function, where it is
    defined (two lambdas have the same name)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        try:
            text = repr(obj)
        except Exception:
            text = f"<{type(obj).__name__} object>"
        return text if len(text) <= 200 else f"{text[:197]}..."
    code = getattr(obj, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    if isinstance(obj, types.MethodType):  # two instances' methods have one name
        where += f" of {_describe_entry(obj.__self__)}"
    return f"{module}.{qualname}{where}"


def env(
    env_id: str,
    *,
    kwargs: dict[str, Any] | None = None,
    description: str = "",
    max_turns: int = 8,
    max_new_tokens: int = 256,
    tags: tuple[str, ...] = (),
) -> Callable[[T], T]:
    """Class or factory decorator: ``@agentrl.env("calc-v0")``."""

    def decorate(obj: T) -> T:
        register(
            env_id,
            obj,  # type: ignore[arg-type]
            kwargs=kwargs,
            description=description,
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            tags=tags,
        )
        return obj

    return decorate


def deregister(env_id: str) -> None:
    """Remove an id (tests and notebooks)."""
    with _lock:
        _registry.pop(env_id, None)


def load_entry_points(*, force: bool = False) -> list[str]:
    """Import every ``agentrl.envs`` entry point; returns errors as strings (never raises)."""
    global _entry_points_loaded
    errors: list[str] = []
    with _lock:
        if _entry_points_loaded and not force:
            return errors
        _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # a broken plugin must not hide the others
            errors.append(f"entry point {ep.name} = {ep.value}: {type(exc).__name__}: {exc}")
    with _lock:
        _entry_point_errors[:] = errors  # named by lookup errors, which they may explain
    return errors


def spec(env_id: str) -> EnvSpec:
    """Look an id up, importing ``module`` first for ``module:name-vN``."""
    module, name, version = parse_env_id(env_id)
    key = f"{name}-v{version}"
    fresh = module is not None and module not in sys.modules
    with _lock:
        before = _registry.get(key)
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = ""
            if isinstance(exc, ModuleNotFoundError) and exc.name and module.startswith(exc.name):
                hint = (
                    " (the agentrl command imports from the working directory and the Python"
                    " path: run it from the folder that holds the module, or install its package)"
                )
            raise EnvError(f"{env_id!r}: cannot import module {module!r}: {exc}{hint}") from exc
        except Exception as exc:  # the module's own code failed (not a missing module)
            raise EnvError(
                f"{env_id!r}: importing module {module!r} raised {type(exc).__name__}: {exc}"
            ) from exc
    with _lock:
        found = _registry.get(key)
    if found is not None and fresh and found is before and not _defined_in(found, module):
        # the module was imported for this id and registered another one: a typo in its
        # decorator, never another module's environment under its name
        raise NameNotFound(
            f"{env_id!r}: module {module!r} does not register {key!r} (it was already "
            f"registered by {_describe_entry(found.entry_point)}); check the id in its "
            "@agentrl.env decorator"
        )
    if found is None:
        load_entry_points()
        with _lock:
            found = _registry.get(key)
    if found is not None:
        return found
    with _lock:
        versions = sorted(s.version for s in _registry.values() if s.name == name)
        names = sorted({s.name for s in _registry.values()})
        broken = "; ".join(_entry_point_errors)
    if broken:
        broken = f" Entry points that failed to load: {broken}."
    if versions:
        raise VersionNotFound(
            f"environment {name!r} has no version {version}; available: "
            + ", ".join(f"{name}-v{v}" for v in versions)
            + broken
        )
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    known = f" Registered: {', '.join(names)}." if names else " Nothing is registered."
    raise NameNotFound(f"no environment named {name!r}.{hint}{known}{broken}")


def make(env_id: str, **kwargs: Any) -> Env:
    """Construct a fresh environment instance for ``env_id``."""
    return spec(env_id).make(**kwargs)


def registered(*, load_plugins: bool = True) -> list[EnvSpec]:
    """All registered specs, sorted by id."""
    if load_plugins:
        load_entry_points()
    with _lock:
        return sorted(_registry.values(), key=lambda s: (s.name, s.version))
