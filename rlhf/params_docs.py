"""The params reference of the documentation site, generated from the Configs: every key of
every params.yaml section with its type, default and description (the pydantic fields'
own `description`), so the reference cannot drift from what the params check accepts.
docs/hooks.py puts it at reference/params.md when the site builds.

Why our own: mkdocstrings documents Python objects (classes, functions), not a YAML file's
keys; the Configs are the single source of the keys, their defaults and their help.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


def type_name(annotation: Any) -> str:
    """A short, readable name of a field's type (`int`, `str | null`, `list[str]`...)."""
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]" if args else name
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The Config a field holds (directly, or optionally), whose keys are listed under it."""
    candidates = typing.get_args(annotation) if typing.get_origin(annotation) else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def default_text(field) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory is None:
            return "(required)"
        try:
            value = field.default_factory()
        except TypeError:
            return ""
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    try:
        return f"`{json.dumps(value, default=str)}`"
    except (TypeError, ValueError):
        return f"`{value}`"


def field_rows(model: type[BaseModel], prefix: str, seen: tuple = ()) -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) of every field of `model`, nested Configs below
    their key (`prefix.key.sub`)."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        description = (field.description or "").replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")
        rows.append((key, type_name(field.annotation), default_text(field), description))
        nested = nested_model(field.annotation)
        if nested is not None and nested not in seen:
            rows += field_rows(nested, key, (*seen, nested))
    return rows


def params_reference(sections: dict[str, type[BaseModel]]) -> str:
    """The reference page: a table per params.yaml section."""
    out = [
        "# Params reference",
        "",
        "Every key of `params.yaml`, by section: its type, its default (what `params.yaml` writes out) and what it "
        "does. Generated from the stages' Configs (`rlhf/params_docs.py`) when the site builds; "
        "`rlhf check` validates a params file against the same Configs.",
    ]
    for section, model in sections.items():
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        out += ["", f"## {section}", ""]
        if doc and not doc.startswith(("Usage docs", "!!! abstract")):
            out += [doc, ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += [f"| `{k}` | {t} | {d} | {desc} |" for k, t, d, desc in field_rows(model, section)]
    return "\n".join(out) + "\n"
