"""Anthropic's Messages API as the gateway speaks it: a request becomes the chat request it
means (`ChatBody`), and an answer goes back as content blocks, whole or as the events of a
stream (the whole turn at once: the episode answers a turn when it is done)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field

from venusrl.engine.native_wire import Bool, Int
from venusrl.gateway.session import Answer
from venusrl.server.bodies import OpenAIBody


class TextBlock(OpenAIBody):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenAIBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        )


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(OpenAIBody):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(OpenAIBody):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(OpenAIBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesBody(OpenAIBody):
    model: str | None = None
    max_tokens: Int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    stream: Bool = False

    def as_chat(self) -> dict[str, Any]:
        """The same request in OpenAI's chat shape (validated as a `ChatBody` by the caller)."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        for m in self.messages:
            messages += _chat_messages(m)
        chat: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.input_schema}}
                for t in self.tools
            ]  # fmt: skip
        choice = self.tool_choice
        if choice is not None:
            chat["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if choice.type == "tool"
                else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            )
        return chat


def _chat_messages(m: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages
    (before its text, as the results answer the previous turn), an assistant's tool uses calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
    if m.role == "assistant":
        calls = [
            {"id": b.id, "type": "function",
             "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in m.content
            if isinstance(b, ToolUseBlock)
        ]  # fmt: skip
        return [
            {
                "role": "assistant",
                "content": text or None,
                **({"tool_calls": calls} if calls else {}),
            }
        ]
    results = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
        for b in m.content
        if isinstance(b, ToolResultBlock)
    ]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def messages_reply(answer: Answer, model: str | None) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    for call in answer.tool_calls:
        function = call["function"]
        content.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"],
             "input": json.loads(function["arguments"])}
        )  # fmt: skip
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model or "venusrl",
        "content": content,
        "stop_reason": (
            "max_tokens" if answer.cut else "tool_use" if answer.tool_calls else "end_turn"
        ),
        "stop_sequence": None,
        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens},
    }


async def message_events(reply: dict[str, Any]) -> AsyncIterator[str]:
    """A whole message as Anthropic streams one: its start, each block's start, delta and stop,
    then the stop reason."""

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    usage = reply["usage"]
    opened = {**reply, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
    yield event("message_start", message=opened)
    for index, block in enumerate(reply["content"]):
        start: dict[str, Any]
        if block["type"] == "text":
            start, delta = (
                {"type": "text", "text": ""},
                {"type": "text_delta", "text": block["text"]},
            )
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield event("content_block_start", index=index, content_block=start)
        yield event("content_block_delta", index=index, delta=delta)
        yield event("content_block_stop", index=index)
    stop = {"stop_reason": reply["stop_reason"], "stop_sequence": None}
    yield event("message_delta", delta=stop, usage={"output_tokens": usage["output_tokens"]})
    yield event("message_stop")
