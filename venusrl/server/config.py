"""The HTTP server's config section (`server.*`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from venusrl.model.tool_formats import tool_parser_setting
from venusrl.sections import Section


class ServerConfig(Section):
    """`venusrl serve`: where it listens, who may call it, how it reads tool calls."""

    host: str = Field("127.0.0.1", description="bind address (loopback by default)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    api_key: str | None = Field(
        None,
        min_length=1,  # an empty key (an unset variable) must not silently turn auth off
        description="if set, requests need 'Authorization: Bearer'",
    )
    model_name: str | None = Field(None, description="name served at /v1/models; default: dir name")
    tool_parser: Annotated[str, AfterValidator(tool_parser_setting)] = Field(
        "auto",
        description="how tool calls look in the model's text (chat `tools`): a parser's name"
        " (hermes, qwen3_coder, llama3_json) or auto, the chat template's own format",
    )
