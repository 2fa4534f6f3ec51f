"""The request bodies, validated before anything runs. The OpenAI-compatible ones tolerate
fields they do not use (OpenAI's clients send many) but refuse those that would change the
answer; the native ones forbid unknown keys."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from venusrl.engine.native_wire import Bool, Float, Int
from venusrl.server.errors import ApiError
from venusrl.types import MAX_TOP_LOGPROBS

# Fields of OpenAI's API that change what is generated, with the value that changes nothing:
# ignoring one silently would answer something else than what was asked.
UNSUPPORTED: dict[str, Any] = {
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "best_of": 1,
    "suffix": "",
    "response_format": {"type": "text"},
    "functions": [],  # the deprecated form of `tools`
    "function_call": "none",
    # The model writes the calls it writes: at most one would drop the others.
    "parallel_tool_calls": True,
}


class OpenAIBody(BaseModel):
    # OpenAI clients send fields we do not use (kept, to refuse those that would change the
    # answer), and null for a field they leave unset.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def refuse_unsupported(self) -> None:
        for key, value in (self.model_extra or {}).items():
            if key in UNSUPPORTED and value != UNSUPPORTED[key]:
                raise ApiError(400, f"{key} is not supported by this server", key)


class StreamOptions(OpenAIBody):
    include_usage: Bool = False


class SamplingBody(OpenAIBody):
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0, le=100)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)
    seed: Int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool = False
    n: Int = Field(1, ge=1, le=64)
    stream: Bool = False
    stream_options: StreamOptions | None = None


class CompletionBody(SamplingBody):
    model: str | None = None
    prompt: str | list[Int] | list[str] | list[list[Int]]
    # k: the sampled tokens' logprobs and, when k > 0, each position's k most likely tokens
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False


class ContentPart(OpenAIBody):
    type: Literal["text"]
    text: str


# OpenAI's rule for a function's name.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionSchema(OpenAIBody):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, as the template shows it
    strict: Bool | None = None


class ToolSpec(OpenAIBody):
    type: Literal["function"]
    function: FunctionSchema


class FunctionName(OpenAIBody):
    name: str


class NamedToolChoice(OpenAIBody):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(OpenAIBody):
    name: str = Field(min_length=1)
    arguments: str  # OpenAI's shape: the arguments object, as JSON text

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, text: str) -> str:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise PydanticCustomError(
                "json_object", "must be a JSON string of an object, got {text!r}", {"text": text}
            )
        return text

    def parsed_arguments(self) -> dict[str, Any]:
        arguments: dict[str, Any] = json.loads(self.arguments)
        return arguments


class AssistantToolCall(OpenAIBody):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(OpenAIBody):
    role: str
    # Left out (or null) only in an assistant turn that calls tools: `ChatBody.cross_check`.
    content: str | list[ContentPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None  # in a tool message: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatBody(SamplingBody):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    # Unset: "auto" with tools, "none" without (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def cross_check(self) -> None:
        """What one field cannot check alone: 400 naming the field."""
        names = [tool.function.name for tool in self.tools or []]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ApiError(400, f"tools: two functions are named {name!r}", f"tools[{i}]")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ApiError(400, "tool_choice needs tools to choose from", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ApiError(
                400,
                f"tool_choice names the function {choice.function.name!r}, which is not in "
                f"tools (functions: {', '.join(names)})",
                "tool_choice.function.name",
            )
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise ApiError(
                    400,
                    f"messages[{i}].tool_calls: only an assistant message calls tools, "
                    f"not a {m.role!r} one",
                    f"messages[{i}].tool_calls",
                )
            if m.content is None and not m.tool_calls:
                raise ApiError(
                    400,
                    f"messages[{i}].content: required (only an assistant message that calls "
                    "tools may leave it out)",
                    f"messages[{i}].content",
                )
            if m.role == "tool" and m.tool_call_id is None:
                raise ApiError(
                    400,
                    f"messages[{i}].tool_call_id: a tool message needs the id of the call it "
                    "answers",
                    f"messages[{i}].tool_call_id",
                )
