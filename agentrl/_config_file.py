"""The one reader of the YAML and JSON files people write (run configs, sandbox pool files, engine
scripts, ``--set`` values): strict UTF-8, one document, no key twice in a mapping, and a bound on
the document's size once its aliases are expanded.

YAML aliases (``*name``) repeat what an anchor (``&name``) points to; a few lines of anchors
that each repeat the one before expand to billions of values, which every later step (checks,
error messages, the config snapshot, its hash) would walk. The document's node graph is measured
before anything is built: each node's expanded size is computed once (a node repeated by aliases
is not walked again), so measuring costs the file's length, never its expansion.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ._config import short_repr
from ._errors import ConfigError

MAX_VALUES = 100_000
"""Most values (scalars, lists and mappings, each alias counted as what it repeats) one
document may hold."""


class ConfigSyntaxError(ConfigError):
    """The text is not YAML (or JSON) at all: ``--set`` then takes it as a plain string."""


def read_config_file(path: str | Path, *, what: str = "config file") -> Any:
    """The value a YAML file (``.json``: a JSON file) holds, ``None`` for an empty one; a
    ``ConfigError`` naming the file (and the line) when it is missing, not UTF-8, not YAML/JSON,
    repeats a key in one mapping, or expands past ``MAX_VALUES`` values."""
    file = Path(path)
    if not file.is_file():
        if file.exists():  # a directory, a FIFO (opening it would block), a device
            raise ConfigError(f"{what} {file}: not a regular file")
        raise ConfigError(f"no such {what}: {file}")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror or exc}") from None
    text = decode_utf8(data, str(file))
    if file.suffix == ".json":
        return load_json(text, str(file))
    return load_yaml(text, str(file))


def read_json_value(path: Path, what: str) -> Any:
    """The JSON value of a file a run folder holds (``config.json``, ``trackers.json``), as
    agentrl wrote it or someone changed it; a one-line ``ConfigError`` naming ``what`` (who
    reads it: ``inspect``, ``--resume``) and the file when it cannot be read or is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(f"{what}: cannot read {path}: {message}") from None


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as text; a ``ConfigError`` naming the line and byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{where}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); save the file as UTF-8"
        ) from None


def load_json(text: str, where: str) -> Any:
    """The JSON value of ``text``; a ``ConfigError`` naming ``where`` when it is not JSON or an
    object repeats a key."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ConfigError(f"{where}: key {short_repr(key)} appears twice in one object")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        raise ConfigSyntaxError(
            f"{where} is not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise ConfigError(f"{where}: {_unreadable(exc)}") from None


def unreadable_json(exc: BaseException) -> str:
    """Why JSON that parses as text cannot become values: nested too deep (``RecursionError``)
    or a number too long to read (``ValueError``: its first clause)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return " ".join(str(exc).split(";")[0].split())


def _unreadable(exc: ValueError) -> str:
    if "integer string conversion" in str(exc):
        return f"an integer too long to read ({unreadable_json(exc)})"
    return f"a value that cannot be read ({exc})"


def load_yaml(text: str, where: str) -> Any:
    """The value of the YAML document ``text`` (``None`` when empty); a ``ConfigError`` naming
    ``where`` and the line for a syntax error (``ConfigSyntaxError``), a key repeated in one
    mapping, or more than ``MAX_VALUES`` values once aliases are expanded."""
    import yaml

    loader = _loader_class()(text, where)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            size = expanded_size(node, MAX_VALUES)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if size > MAX_VALUES:
            raise ConfigError(
                f"{where}: more than {MAX_VALUES} values once its aliases (*name) are expanded: "
                "refused"
            )
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise ConfigSyntaxError(f"{where}: cannot parse: {_describe_yaml_error(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigSyntaxError(f"{where}: cannot parse: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise ConfigError(f"{where}: {_unreadable(exc)}") from None
    finally:
        loader.dispose()


def expanded_size(root: Any, limit: int) -> int:
    """The values under the YAML node ``root`` with every alias expanded, counted up to just
    past ``limit`` (``limit + 1`` means "more"). Each distinct node is measured once, so the
    cost is the number of distinct nodes, whatever the expansion; ``ConfigError`` for an alias
    that contains itself."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            total = 1 + sum(sizes[id(child)] for child in children)
            sizes[key] = min(total, limit + 1)
            if total > limit:
                return limit + 1
            continue
        if key in sizes:
            continue
        if key in entered:  # reached again from inside itself
            line = node.start_mark.line + 1
            raise ConfigError(f"line {line}: an alias refers to a value that contains it")
        entered.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _describe_yaml_error(exc: Any) -> str:
    """One line: where and what (PyYAML's own message spans several)."""
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    what = " ".join(str(part) for part in (exc.context, exc.problem) if part)
    return where + (" ".join(what.split()) or "invalid YAML")


@functools.cache
def _loader_class() -> type:
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: ~4x faster

    class Loader(base):  # type: ignore[valid-type, misc]
        """PyYAML's safe loader refusing a key written twice in one mapping (merge keys,
        ``<<: *base``, may still be overridden: that is what they are for)."""

        def __init__(self, text: str, where: str) -> None:
            super().__init__(text)
            self.where = where

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # unhashable: the constructor says so below
                        continue
                    line = key_node.start_mark.line + 1
                    if first is not None:
                        raise ConfigError(
                            f"{self.where}: line {line}: key {short_repr(key)} appears twice "
                            f"in one mapping (first at line {first})"
                        )
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return Loader
