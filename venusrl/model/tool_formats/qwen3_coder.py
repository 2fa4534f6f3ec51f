"""Qwen3-Coder's XML format: each argument is text between tags, typed by the tool's schema.

    <tool_call>
    <function=write_file>
    <parameter=path>
    a.py
    </parameter>
    <parameter=content>
    print(1)
    </parameter>
    </function>
    </tool_call>

A value is the text between `<parameter=KEY>` and `</parameter>` less one line break at each end,
so code goes in as written, without JSON escaping. It is converted by the parameter's JSON type in
the tool's schema: "integer", "number" and "boolean" from their literals, "object" and "array" from
JSON, anything else (or a parameter the schema does not type) stays a string.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from venusrl.model.tool_calls import ToolCall, ToolCallError
from venusrl.model.tool_formats.base import (
    ParsedCall,
    cut_marker_start,
    function_schemas,
    tagged_blocks,
)
from venusrl.model.tool_formats.hermes import CALL_CLOSE, CALL_OPEN

_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


class Qwen3Coder:
    name = "qwen3_coder"

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] = ()) -> list[ParsedCall]:
        schemas = function_schemas(tools)
        calls: list[ParsedCall] = []
        for number, block in enumerate(tagged_blocks(text, CALL_OPEN, CALL_CLOSE), 1):
            if block.body is None:
                calls.append(ToolCallError(f"tool call #{number}: {block.problem}", block.text))
            else:
                calls.append(_parse_function(block.body, number, block.text, schemas))
        return calls

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """As Qwen3-Coder's template renders a call: objects and arrays as JSON, the rest with
        Python's `str` (the template's `| string`)."""
        parameters = "".join(
            f"<parameter={key}>\n"
            f"{json.dumps(value) if isinstance(value, dict | list) else str(value)}\n"
            "</parameter>\n"
            for key, value in arguments.items()
        )
        return f"{CALL_OPEN}\n<function={name}>\n{parameters}</function>\n{CALL_CLOSE}"

    def call_start(self, text: str) -> int | None:
        start = text.find(CALL_OPEN)
        return start if start >= 0 else cut_marker_start(text, (CALL_OPEN,))

    def tool_prompt(self, functions: Sequence[Mapping[str, Any]]) -> str:
        """Qwen3-Coder's wording, with each function as JSON."""
        listed = "\n".join(json.dumps(dict(f)) for f in functions)
        return (
            "# Tools\n\nYou have access to the following tools:\n\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "If you choose to call a tool ONLY reply in the following format with NO suffix:\n\n"
            f"{CALL_OPEN}\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
            "value_1\n</parameter>\n</function>\n"
            f"{CALL_CLOSE}"
        )


def _parse_function(
    body: str, number: int, text: str, schemas: Mapping[str, Mapping[str, Any]]
) -> ToolCall | ToolCallError:
    def error(problem: str) -> ToolCallError:
        return ToolCallError(f"tool call #{number}: {problem}", text)

    function = _FUNCTION.fullmatch(body)
    if function is None:
        return error(
            "the call must be one <function=NAME>...</function> with a <parameter=KEY>"
            "VALUE</parameter> for each argument"
        )
    name, inner = function.group(1).strip(), function.group(2)
    if not name:
        return error("<function=...> must name the tool")
    properties = schemas.get(name, {}).get("properties", {})
    arguments: dict[str, Any] = {}
    pos = 0
    for parameter in _PARAMETER.finditer(inner):
        between = inner[pos : parameter.start()]
        if between.strip():
            return error(f"unexpected text {between.strip()[:40]!r} between parameters of {name}")
        pos = parameter.end()
        key = parameter.group(1).strip()
        if not key:
            return error(f"a <parameter=...> of {name} has no name")
        if key in arguments:
            return error(f"parameter {key!r} of {name} is given twice")
        raw = parameter.group(2).removeprefix("\n").removesuffix("\n")
        schema = properties.get(key, {}) if isinstance(properties, Mapping) else {}
        value, problem = _typed(raw, _declared_types(schema))
        if problem:
            return error(f"parameter {key!r} of {name} {problem}, got {raw[:40]!r}")
        arguments[key] = value
    rest = inner[pos:]
    if rest.strip():
        what = "is not closed with </parameter>" if "<parameter=" in rest else "is unexpected"
        return error(f"the text {rest.strip()[:40]!r} in {name} {what}")
    return ToolCall(name, arguments)


def _declared_types(schema: object) -> list[object]:
    """The JSON types a property's schema allows: its "type" (one or a list), or those of its
    "anyOf" branches (pydantic writes `int | None` so)."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    if isinstance(declared, list):
        return declared
    if declared is not None:
        return [declared]
    branches = schema.get("anyOf")
    return [t for b in branches for t in _declared_types(b)] if isinstance(branches, list) else []


def _typed(raw: str, json_types: list[object]) -> tuple[Any, str]:
    """(value, "") as the schema's types read `raw`, or (None, what it must be)."""
    if "null" in json_types and raw.strip() in ("null", "None"):
        return None, ""
    kinds = [t for t in json_types if t != "null"]
    return _as_type(raw, kinds[0] if len(kinds) == 1 else None)


def _as_type(raw: str, json_type: object) -> tuple[Any, str]:
    text = raw.strip()
    if json_type == "integer":
        try:
            return int(text), ""
        except ValueError:
            return None, "must be an integer"
    if json_type == "number":
        try:
            number = float(text)
        except ValueError:
            return None, "must be a number"
        if not math.isfinite(number):
            return None, "must be a finite number"
        return (int(number) if number.is_integer() and "." not in text else number), ""
    if json_type == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower() == "true", ""
        return None, "must be true or false"
    if json_type in ("object", "array"):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return None, f"must be a JSON {json_type}"
        expected = dict if json_type == "object" else list
        return (value, "") if isinstance(value, expected) else (None, f"must be a JSON {json_type}")
    return raw, ""
