"""Environment registry: versioned ids, a decorator, lazy module loading and entry points.

Modelled on Gymnasium's registry (``name-vN`` ids, ``module:name-vN`` imports ``module`` first,
an error hierarchy that suggests close matches), made for async textual environments.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ._env import Env
from ._errors import BadEnvSpec, DuplicateEnv, EnvError, NameNotFound, VersionNotFound

ENTRY_POINT_GROUP = "agentrl.envs"
_ID_RE = re.compile(r"^(?:(?P<module>[\w.]+):)?(?P<name>[A-Za-z][\w./-]*?)-v(?P<version>\d+)$")

T = TypeVar("T")


@dataclass(frozen=True)
class EnvSpec:
    """Everything the registry knows about one environment id."""

    id: str
    """``name-vN``."""
    name: str
    """The id without its version."""
    version: int
    """N of ``-vN``."""
    entry_point: Callable[..., Any]
    """A class or a factory; called with ``kwargs`` (merged with ``make`` kwargs) per trajectory."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Factory arguments fixed at registration (``make`` kwargs override them)."""
    description: str = ""
    """One line for ``agentrl envs list`` (default: the first paragraph of the docstring)."""
    max_turns: int = 8
    """Default turn budget for a trajectory (overridable per rollout)."""
    max_new_tokens: int = 256
    """Default per-turn token budget."""
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
            raise EnvError(f"{self.id}: constructor failed with {merged}: {exc}") from exc


_registry: dict[str, EnvSpec] = {}
_lock = threading.RLock()
_entry_points_loaded = False
_entry_point_errors: list[str] = []


def parse_env_id(env_id: str) -> tuple[str | None, str, int]:
    """Split ``[module:]name-vN`` into (module, name, version); BadEnvSpec if malformed."""
    if not isinstance(env_id, str):
        raise BadEnvSpec(f"environment id must be a string, got {type(env_id).__name__}")
    m = _ID_RE.match(env_id)
    if m is None:
        raise BadEnvSpec(
            f"malformed environment id {env_id!r}: expected 'name-vN' or 'module:name-vN' "
            "(e.g. 'calc-v0')"
        )
    return m["module"], m["name"], int(m["version"])


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

    Registering the same id again with the *same* entry point (a module re-imported) is a no-op;
    with a different one it raises ``DuplicateEnv``.
    """
    module, name, version = parse_env_id(env_id)
    if module is not None:
        raise BadEnvSpec(f"register {env_id!r}: the id must not carry a module prefix")
    if not callable(entry_point):
        raise BadEnvSpec(f"register {env_id!r}: entry point {entry_point!r} is not callable")
    if max_turns < 1 or max_new_tokens < 1:
        raise BadEnvSpec(f"register {env_id!r}: max_turns and max_new_tokens must be >= 1")
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
                f"{existing.module}.{getattr(existing.entry_point, '__qualname__', '?')}"
            )
        _registry[env_id] = spec
    return spec


def _same_entry(a: Any, b: Any) -> bool:
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


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
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise EnvError(f"{env_id!r}: cannot import module {module!r}: {exc}") from exc
    key = f"{name}-v{version}"
    with _lock:
        found = _registry.get(key)
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
