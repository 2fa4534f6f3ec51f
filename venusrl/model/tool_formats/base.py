"""What every tool-call format provides, and the pieces two formats share."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from venusrl.model.tool_calls import ToolCall, ToolCallError

ParsedCall = ToolCall | ToolCallError


class ToolParser(Protocol):
    """How one family of models writes tool calls in its text.

    `tools` are the function schemas the model was shown, as `Tool.schema()` gives them
    ({"name", "description", "parameters"}) or in OpenAI's {"type": "function", "function": ...}
    wrapping; a format whose arguments are text (Qwen3-Coder's XML) converts them by the
    parameters' JSON types, the others ignore them.
    """

    name: str

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] = ()) -> list[ParsedCall]:
        """Every call of `text`, in order; a malformed one as a `ToolCallError`. No call at all:
        the text is an answer. Never raises on model text."""
        ...

    def format_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the model writes it; `parse` reads it back."""
        ...

    def call_start(self, text: str) -> int | None:
        """Where the tool-call text of a growing `text` begins, or may begin (a marker cut off at
        its end): what comes before is plain content and can be streamed; None: all of it is."""
        ...

    def tool_prompt(self, functions: Sequence[Mapping[str, Any]]) -> str:
        """A system-prompt section that announces `functions` and this call format, for a chat
        template that does not render tools itself."""
        ...


def function_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Tool name -> its parameters' JSON schema, whichever of the two shapes `tools` come in."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool) if tool.get("type") == "function" else tool
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            out[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return out


def cut_marker_start(text: str, markers: Sequence[str]) -> int | None:
    """Where `text` ends with the beginning of one of `markers` ("<tool_c"), or None."""
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        if any(m.startswith(text[start:]) for m in markers):
            return start
    return None


class Block(NamedTuple):
    """One tagged block of model text: its `body` between the tags, or None with the `problem`
    when a tag has no pair; `text` is the block as written."""

    body: str | None
    text: str
    problem: str = ""


def tagged_blocks(text: str, open_tag: str, close_tag: str) -> Iterator[Block]:
    """Each `open_tag ... close_tag` block of `text`, in order. A tag without its pair is a
    block with a problem: the model meant to make a call."""
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        stray = text.find(close_tag, pos, len(text) if start < 0 else start)
        if stray >= 0:
            problem = f"{close_tag} at character {stray} has no {open_tag} before it"
            yield Block(None, text[pos : stray + len(close_tag)], problem)
            pos = stray + len(close_tag)
            continue
        if start < 0:
            return
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        reopen = text.find(open_tag, body_start)
        if end < 0 or 0 <= reopen < end:
            stop = len(text) if reopen < 0 else reopen
            where = "the end of the text" if reopen < 0 else f"the next {open_tag}"
            problem = (
                f"{open_tag} at character {start} is not closed with {close_tag} before {where}"
            )
            yield Block(None, text[start:stop], problem)
            pos = stop
            continue
        yield Block(text[body_start:end], text[start : end + len(close_tag)])
        pos = end + len(close_tag)


def with_tool_prompt(messages: Sequence[Mapping[str, Any]], section: str) -> list[dict[str, Any]]:
    """`messages` with a tool announcement (`ToolParser.tool_prompt`) after the system
    message's text, or as a system message of its own where there is none: where a template
    that does not render tools is told about them."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{section}"
    else:
        out.insert(0, {"role": "system", "content": section})
    return out
