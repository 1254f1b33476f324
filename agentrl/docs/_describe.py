"""What the reference says about one class: its fields (name, type, default, constraints,
docstring) for pydantic models, msgspec structs and dataclasses, and readable type names.

Field docstrings are the string literals written under each field (``x: int = 1`` then
``\"\"\"...\"\"\"``), read from the source with ``ast`` along the class's bases, so the same
rule covers every kind of class.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pydantic
import pydantic_core

from agentrl._errors import AgentRLError


@dataclass(frozen=True)
class Field:
    """One documented field."""

    name: str
    annotation: Any
    default: str
    """The default as the reference prints it ("required" when there is none)."""
    constraints: str
    doc: str
    nested: type | None
    """A model the field holds (documented in its own section), if any."""


class MissingDocstring(AgentRLError):
    """A field without a docstring: the reference refuses to print an undocumented field."""


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the source of ``cls`` and its bases (nearest class wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, pydantic.BaseModel, msgspec.Struct) or klass.__module__ == "builtins":
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        items = body.body
        for item, after in zip(items, items[1:], strict=False):
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[item.target.id] = inspect.cleandoc(after.value.value)
    return docs


def class_doc(cls: Any) -> str:
    """The class's own docstring, cleaned (never a base class's)."""
    doc = cls.__dict__.get("__doc__") if isinstance(cls, type) else getattr(cls, "__doc__", "")
    return inspect.cleandoc(doc) if doc else ""


def fields_of(cls: type, *, require_docs: bool = True) -> list[Field]:
    """The fields of a pydantic model, msgspec struct or dataclass, in declaration order."""
    docs = attribute_docs(cls)
    out: list[Field] = []
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        for name, info in cls.model_fields.items():
            out.append(
                Field(
                    name=name,
                    annotation=info.annotation,
                    default=_pydantic_default(info),
                    constraints=_constraints(info.metadata),
                    doc=docs.get(name) or info.description or "",
                    nested=nested_model(info.annotation),
                )
            )
    elif isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        for info in msgspec.structs.fields(cls):
            if info.default is not msgspec.NODEFAULT:
                default = value_text(info.default)
            elif info.default_factory is not msgspec.NODEFAULT:
                default = value_text(info.default_factory())
            else:
                default = "required"
            out.append(Field(info.name, info.type, default, "", docs.get(info.name, ""), None))
    elif dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        for info in dataclasses.fields(cls):
            if info.default is not dataclasses.MISSING:
                default = value_text(info.default)
            elif info.default_factory is not dataclasses.MISSING:
                default = value_text(info.default_factory())
            else:
                default = "required"
            out.append(
                Field(info.name, hints[info.name], default, "", docs.get(info.name, ""), None)
            )
    else:
        raise TypeError(f"{cls!r} is not a pydantic model, msgspec struct or dataclass")
    if require_docs:
        missing = [f.name for f in out if not f.doc]
        if missing:
            raise MissingDocstring(
                f"{cls.__module__}.{cls.__qualname__}: fields without a docstring: "
                + ", ".join(missing)
            )
    return out


def nested_model(annotation: Any) -> type | None:
    """The pydantic model a field holds: directly, as ``Model | None`` or as ``list[Model]``
    (else None)."""
    candidates = [a for a in _members(annotation) if a is not type(None)]
    if len(candidates) == 1 and typing.get_origin(candidates[0]) in (list, tuple):
        candidates = [a for a in typing.get_args(candidates[0]) if a is not Ellipsis]
    if len(candidates) == 1 and _is_model(candidates[0]):
        return candidates[0]
    return None


def union_models(annotation: Any) -> list[type]:
    """The models of a (discriminated) union field, in order."""
    return [a for a in _members(annotation) if _is_model(a)]


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, pydantic.BaseModel)


def _members(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def type_text(annotation: Any, link: Callable[[type], str | None] | None = None) -> str:
    """A readable type: ``int | None``, ``"a" | "b"``, ``list[str]``, models linked by ``link``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None) or annotation is None:
        return "null"
    if annotation is Any:
        return "any"
    if origin is typing.Annotated:
        return type_text(args[0], link)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a, link) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{type_text(args[0], link)}, ...]"
        return f"{name}[{', '.join(type_text(a, link) for a in args)}]"
    if isinstance(annotation, type):
        if link is not None and _is_model(annotation):
            target = link(annotation)
            if target:
                return target
        return annotation.__name__
    if isinstance(annotation, str):
        return annotation
    return str(annotation).replace("typing.", "")


def value_text(value: Any) -> str:
    """A default as it would be written in YAML/JSON."""
    if isinstance(value, pydantic.BaseModel):
        return "(section)"
    if isinstance(value, msgspec.Struct):
        return "(struct)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return repr(value)


def _pydantic_default(info: pydantic.fields.FieldInfo) -> str:
    if info.default_factory is not None:
        return value_text(info.default_factory())  # type: ignore[call-arg]
    if info.default is pydantic_core.PydanticUndefined:
        return "required"
    return value_text(info.default)


def _constraints(metadata: list[Any]) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for item in metadata:
        for attr, symbol in words.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{symbol} {value}")
        if getattr(item, "min_length", None) is not None:
            out.append(f"at least {item.min_length} item(s)")
    return ", ".join(out)
