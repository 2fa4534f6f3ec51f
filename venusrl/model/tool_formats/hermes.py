"""The Hermes format, Qwen2.5's and Qwen3's: a JSON object in `<tool_call>` tags.

A turn calls tools by writing one or more blocks, anywhere in its text:

    <tool_call>
    {"name": "guess", "arguments": {"n": 50}}
    </tool_call>

The body is one JSON object with exactly two keys: "name" (a non-empty string) and "arguments" (an
object; it may be left out when the tool takes none).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from venusrl.model.tool_calls import ToolCall, ToolCallError, format_tool_call, json_type
from venusrl.model.tool_formats.base import ParsedCall, cut_marker_start, tagged_blocks

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


class Hermes:
    name = "hermes"

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] = ()) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for number, block in enumerate(tagged_blocks(text, CALL_OPEN, CALL_CLOSE), 1):
            if block.body is None:
                calls.append(ToolCallError(f"tool call #{number}: {block.problem}", block.text))
            else:
                calls.append(parse_json_call(block.body, number, block.text, ("arguments",)))
        return calls

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return format_tool_call(name, dict(arguments))

    def call_start(self, text: str) -> int | None:
        start = text.find(CALL_OPEN)
        return start if start >= 0 else cut_marker_start(text, (CALL_OPEN,))

    def tool_prompt(self, functions: Sequence[Mapping[str, Any]]) -> str:
        """Qwen's wording, as its template writes it."""
        signatures = "\n".join(
            json.dumps({"type": "function", "function": dict(f)}) for f in functions
        )
        return (
            "# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n"
            f"{CALL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{CALL_CLOSE}"
        )


def parse_json_call(
    body: str, number: int, text: str, argument_keys: Sequence[str]
) -> ToolCall | ToolCallError:
    """One call written as a JSON object {"name": ..., KEY: {...}}, KEY one of `argument_keys`
    (Hermes says "arguments", Llama 3 "parameters")."""

    def error(problem: str) -> ToolCallError:
        return ToolCallError(f"tool call #{number}: {problem}", text)

    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return error(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}")
    except (ValueError, RecursionError) as e:  # an over-long integer literal, absurd nesting
        return error(f"invalid JSON: {e}")
    return json_call(call, number, text, argument_keys)


def json_call(
    call: object, number: int, text: str, argument_keys: Sequence[str]
) -> ToolCall | ToolCallError:
    """A decoded JSON value as a call, or what is wrong with it."""
    shape = ", ".join(f'"{k}": {{...}}' for k in argument_keys[:1])

    def error(problem: str) -> ToolCallError:
        return ToolCallError(f"tool call #{number}: {problem}", text)

    if not isinstance(call, dict):
        return error(
            f'the call must be a JSON object {{"name": ..., {shape}}}, got {json_type(call)}'
        )
    unexpected = sorted(set(call) - {"name", *argument_keys})
    if unexpected:
        keys = " and ".join(f'"{k}"' for k in ("name", argument_keys[0]))
        return error(f"unexpected keys {unexpected}; a call has only {keys}")
    given = [k for k in argument_keys if k in call]
    if len(given) > 1:
        return error(f"the arguments are given twice, as {given}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return error('"name" must be a non-empty string naming the tool')
    arguments = call.get(given[0], {}) if given else {}
    if not isinstance(arguments, dict):
        return error(f'"{given[0]}" must be a JSON object, got {json_type(arguments)}')
    return ToolCall(name, arguments)
