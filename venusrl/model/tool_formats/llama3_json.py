"""Llama 3.1/3.2's JSON format: the calls are the message, as JSON objects.

    <|python_tag|>{"name": "guess", "parameters": {"n": 50}}; {"name": "guess", "parameters": ...}

The calls start at `<|python_tag|>` (a special token, so often gone from decoded text) or at a
line that starts with `{`; what comes before is plain content. From there on the text is one or
more objects {"name": ..., "parameters": {...}} ("arguments" is read too) separated by `;`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from venusrl.model.tool_calls import ToolCallError
from venusrl.model.tool_formats.base import ParsedCall, cut_marker_start
from venusrl.model.tool_formats.hermes import json_call

PYTHON_TAG = "<|python_tag|>"
_LINE_OPENS_OBJECT = re.compile(r"(?:^|\n)[ \t]*\{")
_DECODER = json.JSONDecoder()


class Llama3Json:
    name = "llama3_json"

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] = ()) -> list[ParsedCall]:
        start = _calls_start(text)
        if start is None:
            return []
        pos = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        calls: list[ParsedCall] = []
        while True:
            pos = _skip_space(text, pos)
            number = len(calls) + 1
            if pos == len(text):
                if not calls:  # a python tag and nothing after it
                    calls.append(
                        ToolCallError(
                            f"tool call #{number}: no call after {PYTHON_TAG}", text[start:]
                        )
                    )
                return calls
            try:
                value, end = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                problem = f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
                calls.append(ToolCallError(f"tool call #{number}: {problem}", text[pos:]))
                return calls
            except (ValueError, RecursionError) as e:  # an over-long integer literal, nesting
                calls.append(ToolCallError(f"tool call #{number}: invalid JSON: {e}", text[pos:]))
                return calls
            if isinstance(value, dict) and value.get("type") == "function":
                value = {k: v for k, v in value.items() if k != "type"}
            calls.append(json_call(value, number, text[pos:end], ("parameters", "arguments")))
            pos = _skip_space(text, end)
            if pos < len(text) and text[pos] == ";":
                pos += 1
            elif pos < len(text):
                rest = text[pos:]
                calls.append(
                    ToolCallError(
                        f"tool call #{number + 1}: calls are separated by ';', and nothing may"
                        f" follow them; got {rest[:40]!r} at character {pos}",
                        rest,
                    )
                )
                return calls

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """As Llama 3.1's template renders a call."""
        return json.dumps({"name": name, "parameters": dict(arguments)})

    def call_start(self, text: str) -> int | None:
        start = _calls_start(text)
        if start is not None:
            return start
        last_line = text.rfind("\n") + 1
        if text and not text[last_line:].strip():  # a line of blanks may yet open an object
            return last_line
        return cut_marker_start(text, (PYTHON_TAG,))

    def tool_prompt(self, functions: Sequence[Mapping[str, Any]]) -> str:
        """Llama 3.1's wording, with each function in OpenAI's wrapping."""
        listed = "".join(
            json.dumps({"type": "function", "function": dict(f)}, indent=4) + "\n\n"
            for f in functions
        )
        return (
            "Given the following functions, please respond with a JSON for a function call with"
            " its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument'
            " name and its value}. Do not use variables.\n\n"
            f"{listed}".rstrip("\n")
        )


def _calls_start(text: str) -> int | None:
    tag = text.find(PYTHON_TAG)
    line = _LINE_OPENS_OBJECT.search(text)
    found = [i for i in (tag, line.end() - 1 if line else -1) if i >= 0]
    return min(found) if found else None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
