"""The HTTP server's config section (`server.*`)."""

from __future__ import annotations

from pydantic import Field, field_validator

from venusrl.sections import Section


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(
        None,
        min_length=1,  # an empty key (an unset variable) must not silently turn auth off
        description="if set, requests need 'Authorization: Bearer'",
    )
    model_name: str | None = Field(None, description="name served at /v1/models; default: dir name")
    tool_parser: str = Field(
        "hermes", description="how tool calls look in the model's text (chat `tools`)"
    )

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, name: str) -> str:
        from venusrl.server.tool_calling import tool_parser  # torch-free, as configs are read

        tool_parser(name)
        return name
