"""A tool's JSON schema from a Python function: its signature's annotations, and its docstring's
summary and Args section (Google style, as Hugging Face's `get_json_schema` reads it).

pydantic turns the annotations into JSON schema (int, float, str, bool, lists, dicts, Literal,
Optional, ...), so the types mean what they mean to the rest of the Python world.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

import pydantic

_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARG = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def function_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """{"name", "description", "parameters"} of `function`, as `Tool.schema()` gives them.

    Raises ValueError, naming the function, when it has no docstring or takes *args/**kwargs
    (the model calls a tool with named arguments only).
    """
    name = getattr(function, "__name__", repr(function))
    doc = inspect.getdoc(function)
    if not doc:
        raise ValueError(f"tool function {name} needs a docstring: it tells the model what it does")
    summary, described = _read_docstring(doc)
    try:  # annotations written as strings (`from __future__ import annotations`) resolved
        hints = typing.get_type_hints(function)
    except Exception as e:
        raise ValueError(f"tool function {name}: its annotations do not resolve: {e}") from e
    fields: dict[str, Any] = {}
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ValueError(
                f"tool function {name}: *{parameter.name} cannot be called with named arguments"
            )
        annotation = hints.get(parameter.name, Any)
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (
            annotation,
            pydantic.Field(default, description=described.get(parameter.name)),
        )
    model = pydantic.create_model(f"{name}_arguments", **fields)
    parameters = _without_titles(model.model_json_schema())
    parameters.setdefault("properties", {})
    return {"name": name, "description": summary, "parameters": parameters}


def _read_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the text before the first section, argument name -> its description)."""
    summary: list[str] = []
    described: dict[str, str] = {}
    section, current = "", ""
    for line in doc.splitlines():
        heading = _SECTION.match(line.strip())
        if heading:
            section, current = heading.group(1), ""
        elif not section:
            summary.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            indented = line.startswith((" ", "\t"))
            arg = _ARG.match(line.strip())
            if arg and (not current or not line.startswith(" " * 8)):
                current = arg.group(1).lstrip("*")
                described[current] = arg.group(2).strip()
            elif current and indented:  # a continuation line
                described[current] = f"{described[current]} {line.strip()}".strip()
    return " ".join(" ".join(summary).split()), described


def _without_titles(schema: Any) -> Any:
    """pydantic's schema less the "title" it gives every model and field: noise in a prompt.
    (A property that is itself called "title" stays.)"""
    if isinstance(schema, list):
        return [_without_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs") and isinstance(value, dict):
            out[key] = {k: _without_titles(v) for k, v in value.items()}
        else:
            out[key] = _without_titles(value)
    return out
