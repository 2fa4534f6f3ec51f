"""Tool calls in model text: the contract between the model, the chat template and the environments.

The format is the one Qwen2.5/Qwen3 and Hermes chat templates teach, so a pretrained model already
knows it. A turn calls tools by writing one or more blocks, anywhere in its text:

    <tool_call>
    {"name": "guess", "arguments": {"n": 50}}
    </tool_call>

The body is one JSON object with exactly two keys: "name" (a non-empty string) and "arguments" (an
object; it may be left out when the tool takes none). The calls of a turn run in the order written.
A turn with no `<tool_call>` at all is an answer, not an action.

Each call, well-formed or not, gets exactly one response, in the same order, and the responses of a
turn are joined by newlines into the next user turn:

    <tool_response>
    higher
    </tool_response>

That is the text Qwen's template renders for consecutive `{"role": "tool"}` messages (inside one
user turn), so the agent loop can append it as a plain user message and the tokens match what the
model saw in pretraining. A malformed call gets a response that starts with "error:" and says what
is wrong, so the model can learn the format from its mistakes; parsing never raises on model text.

The system prompt that announces the tools (`render_tool_prompt`) follows Qwen's wording as well.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A `<tool_call>` block that cannot be run; `message` is written for the model to read."""

    message: str
    text: str  # the offending block as the model wrote it


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>` block of `text`, in order; each malformed one as a `ToolCallError`.

    A `<tool_call>` that is not closed before the next `<tool_call>` (or the end of the text) and a
    `</tool_call>` without an opening tag are errors too: the model meant to call something.
    """
    calls: list[ToolCall | ToolCallError] = []
    pos = 0
    number = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        stray = text.find(CALL_CLOSE, pos, len(text) if start < 0 else start)
        if stray >= 0:
            number += 1
            calls.append(
                ToolCallError(
                    f"tool call #{number}: {CALL_CLOSE} at character {stray} has no {CALL_OPEN}"
                    " before it",
                    text[pos : stray + len(CALL_CLOSE)],
                )
            )
            pos = stray + len(CALL_CLOSE)
            continue
        if start < 0:
            return calls
        number += 1
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        reopen = text.find(CALL_OPEN, body_start)
        if end < 0 or 0 <= reopen < end:
            stop = len(text) if reopen < 0 else reopen
            where = "the end of the text" if reopen < 0 else f"the next {CALL_OPEN}"
            calls.append(
                ToolCallError(
                    f"tool call #{number}: {CALL_OPEN} at character {start} is not closed with"
                    f" {CALL_CLOSE} before {where}",
                    text[start:stop],
                )
            )
            pos = stop
            continue
        calls.append(_parse_body(text[body_start:end], number, text[start : end + len(CALL_CLOSE)]))
        pos = end + len(CALL_CLOSE)


def _parse_body(body: str, number: int, block: str) -> ToolCall | ToolCallError:
    def error(problem: str) -> ToolCallError:
        return ToolCallError(f"tool call #{number}: {problem}", block)

    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return error(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}")
    except (ValueError, RecursionError) as e:  # an over-long integer literal, absurd nesting
        return error(f"invalid JSON: {e}")
    if not isinstance(call, dict):
        return error(
            'the body must be a JSON object {"name": ..., "arguments": {...}},'
            f" got {json_type(call)}"
        )
    unexpected = sorted(set(call) - {"name", "arguments"})
    if unexpected:
        return error(f'unexpected keys {unexpected}; a call has only "name" and "arguments"')
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return error('"name" must be a non-empty string naming the tool')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return error(f'"arguments" must be a JSON object, got {json_type(arguments)}')
    return ToolCall(name, arguments)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call block as a model writes it (what scripted demonstrators produce)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def format_tool_response(content: str, max_chars: int) -> str:
    """One response block; content over `max_chars` keeps its head and tail around a marker.

    Head and tail because both ends matter to a model: a command's first lines say what ran, its
    last lines hold the error or the test summary.
    """
    if len(content) > max_chars:
        head = max_chars // 2
        tail = max_chars - head
        cut = len(content) - max_chars
        content = f"{content[:head]}\n[... {cut} characters cut ...]\n{content[-tail:]}"
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def render_tool_prompt(functions: Sequence[dict[str, Any]]) -> str:
    """The system-prompt section that announces tools and the call format (Qwen's wording).

    `functions` are OpenAI-style function schemas: {"name", "description", "parameters"}.
    """
    signatures = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n"
        f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}'
    )


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for messages to the model."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"
