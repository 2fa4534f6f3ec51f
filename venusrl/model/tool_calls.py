"""A tool call as the environment runs it, and the tool responses of our own rendering.

Parsing a call out of model text is the model's format's business (`venusrl.model.tool_formats`:
one parser per family of chat templates); what comes out is a `ToolCall`, or a `ToolCallError`
whose message is written for the model to read, so that it can learn the format from its
mistakes. Parsing never raises on model text.

Each call, well-formed or not, gets exactly one response, in the same order. A chat template
that renders tools writes them as its own `{"role": "tool"}` messages; for one that does not (the
byte-level tokenizer of the CPU example), the responses of a turn are joined by newlines into the
next user turn, as Qwen's template renders consecutive tool messages:

    <tool_response>
    higher
    </tool_response>
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A tool call that cannot be run; `message` is written for the model to read."""

    message: str
    text: str  # the offending text as the model wrote it


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call in the Hermes format, the one scripted demonstrators write (the warm start
    rewrites their calls in the model's own format: `coordinator.demonstrations`)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def clip_response(content: str, max_chars: int) -> str:
    """`content`, or over `max_chars` its head and tail around a marker.

    Head and tail because both ends matter to a model: a command's first lines say what ran, its
    last lines hold the error or the test summary.
    """
    if len(content) <= max_chars:
        return content
    head = max_chars // 2
    tail = max_chars - head
    cut = len(content) - max_chars
    return f"{content[:head]}\n[... {cut} characters cut ...]\n{content[-tail:]}"


def format_tool_response(content: str, max_chars: int) -> str:
    """One response block of a user turn; content over `max_chars` is clipped (`clip_response`)."""
    return f"{RESPONSE_OPEN}\n{clip_response(content, max_chars)}\n{RESPONSE_CLOSE}"


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
