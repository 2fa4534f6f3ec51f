"""Tool-call formats: how a family of models writes tool calls, one named parser each.

`tool_parser(name)` gives one (`hermes`, `qwen3_coder`, `llama3_json`); `detect_tool_parser`
names the one a chat template teaches, read from the template's own text. A run picks one with
`rollout.tool_parser` ("auto": the template's, else Hermes, which the tiny CPU model learns).
"""

from __future__ import annotations

import logging

from venusrl.model.tool_formats.base import ParsedCall, ToolParser, with_tool_prompt
from venusrl.model.tool_formats.hermes import Hermes
from venusrl.model.tool_formats.llama3_json import Llama3Json
from venusrl.model.tool_formats.qwen3_coder import Qwen3Coder

__all__ = [
    "TOOL_PARSERS",
    "ParsedCall",
    "ToolParser",
    "detect_tool_parser",
    "resolve_tool_parser",
    "tool_parser",
    "tool_parser_setting",
    "with_tool_prompt",
]

log = logging.getLogger(__name__)
TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (Hermes(), Qwen3Coder(), Llama3Json())}


def tool_parser(name: str) -> ToolParser:
    """The parser called `name`; an unknown name is an error that lists the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(TOOL_PARSERS)
        raise ValueError(f"unknown tool parser {name!r}; the tool parsers are: {known}") from None


def tool_parser_setting(setting: str) -> str:
    """A config's tool-parser setting, checked: "auto" or a parser's name."""
    if setting != "auto":
        tool_parser(setting)
    return setting


def detect_tool_parser(chat_template: str) -> str | None:
    """The format `chat_template` renders tool calls in, by the markup it writes; None when it
    shows none (a template without tools)."""
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or "tools_in_user_message" in chat_template:
        return "llama3_json"
    return None


def resolve_tool_parser(setting: str, chat_template: str | None) -> ToolParser:
    """`rollout.tool_parser`'s parser for a model: a name, or "auto" for the template's own
    format (`detect_tool_parser`), Hermes where the template shows none."""
    if setting != "auto":
        return tool_parser(setting)
    detected = detect_tool_parser(chat_template or "")
    if detected is None and chat_template and "tools" in chat_template:
        # A template that renders tools in a format of its own (Mistral's [TOOL_CALLS], ...):
        # its model's calls would all read as plain answers.
        log.warning(
            "the chat template renders tools in a format none of the tool parsers (%s) reads;"
            " tool calls are read as hermes: set rollout.tool_parser if the model writes them"
            " otherwise",
            ", ".join(TOOL_PARSERS),
        )
    return tool_parser(detected or "hermes")
