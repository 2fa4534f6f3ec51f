"""OpenAI tool calling on the chat route: a request's tools and tool turns into the chat template,
and the model's text back into `tool_calls`, whole or streamed. How calls look in model text is
the parser's business alone (`tool_parser`), so that another format is another parser.

The server does not constrain decoding: `tool_choice: "required"` or a named function returns
the calls the model wrote (of that function), and when it wrote none that can be run, its text
as content with its own finish reason. A call is never made up from nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from venusrl.model.tool_calls import ToolCall, format_tool_response
from venusrl.model.tool_formats import ToolParser, with_tool_prompt

Tools = Sequence[Mapping[str, Any]]  # OpenAI's {"type": "function", "function": {...}} schemas

if TYPE_CHECKING:  # the bodies bring the server's imports; naming a parser needs none of them
    from venusrl.server.bodies import ChatBody, ChatMessage


def template_input(
    body: ChatBody, template_renders_tools: bool, parser: ToolParser
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools the chat template is given. A template that knows tools gets them
    as Hugging Face's `apply_chat_template` passes them (call arguments as objects); for one that
    does not, the tools are announced in the system message and the calls and responses written
    as the parser's text, as Qwen's template writes them."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    if template_renders_tools:
        return [hf_message(m) for m in body.messages], tools
    return _as_text(body.messages, tools, parser), None


def hf_message(m: ChatMessage) -> dict[str, Any]:
    # "" rather than None for a call turn's missing content: templates concatenate it.
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.parsed_arguments()},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _as_text(
    messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None, parser: ToolParser
) -> list[dict[str, Any]]:
    rendered: list[dict[str, Any]] = []
    previous = None
    for m in messages:
        text = m.text()
        if m.role == "tool":
            block = format_tool_response(text, len(text))  # whole: not ours to cut
            if previous == "tool":  # a turn's responses are one user message, as Qwen's
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block})
        elif m.tool_calls:
            calls = [parser.format_call(c.function.name, c.function.parsed_arguments())
                     for c in m.tool_calls]  # fmt: skip
            rendered.append(
                {"role": m.role, "content": "\n".join([text, *calls] if text else calls)}
            )
        else:
            rendered.append({"role": m.role, "content": text})
        previous = m.role
    if tools:
        return with_tool_prompt(rendered, parser.tool_prompt([t["function"] for t in tools]))
    return rendered


@dataclass(frozen=True)
class CallRules:
    """What of a request's answer may be calls: the parser, and the functions it may call."""

    parser: ToolParser
    tools: Tools
    callable_names: frozenset[str]

    @classmethod
    def of(cls, body: ChatBody, parser: ToolParser) -> CallRules | None:
        """None when no call can come back: no tools, or `tool_choice: "none"`."""
        choice = body.tool_choice
        if not body.tools or choice == "none":
            return None
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        if choice is None or isinstance(choice, str):  # "auto" or "required"
            return cls(parser, tools, frozenset(t.function.name for t in body.tools))
        return cls(parser, tools, frozenset([choice.function.name]))

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's content and its calls in OpenAI's shape. Calls come back only when
        every call the model wrote is well formed and of a function it may call; otherwise the
        whole text is content, as written. Content is the text before the first call."""
        start = self.parser.call_start(text)
        if start is None:
            return text, []
        written = self.parser.parse(text, self.tools)
        calls = [c for c in written if isinstance(c, ToolCall) and c.name in self.callable_names]
        if not calls or len(calls) < len(written):
            return text, []
        content = text[:start]
        return (content if content.strip() else None), [_openai_call(c) for c in calls]


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


class CallWatch:
    """One streamed choice's text: content goes out as it comes until call text begins (or may:
    a trailing "<tool" of "<tool_call>" waits for the next piece); from there the text is held
    until the turn ends, when it becomes the calls or, holding none that can be run, content
    after all. Held because whether the calls stand is known only at the end, and a streamed
    call cannot be taken back."""

    def __init__(self, rules: CallRules) -> None:
        self.rules = rules
        self.text, self._sent = "", 0

    def push(self, piece: str) -> str:
        """The content to send now."""
        self.text += piece
        start = self.rules.parser.call_start(self.text)
        end = len(self.text) if start is None else max(start, self._sent)
        content, self._sent = self.text[self._sent : end], end
        return content

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the turn's end: the content still to send, and the calls."""
        _, calls = self.rules.split(self.text)
        rest = "" if calls else self.text[self._sent :]
        self._sent = len(self.text)
        return rest, calls


def call_deltas(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The calls as OpenAI streams them: per call, its id, type and name, then its arguments."""
    deltas: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        function = call["function"]
        head = {"name": function["name"], "arguments": ""}
        deltas.append({"index": index, "id": call["id"], "type": "function", "function": head})
        deltas.append({"index": index, "function": {"arguments": function["arguments"]}})
    return deltas
