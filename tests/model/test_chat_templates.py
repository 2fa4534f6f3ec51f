"""Models' own chat templates render here exactly as transformers renders them, tools included."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chat_templates import MODELS, tokenizer, transformers_tokenizer
from venusrl.envs.environment import Tool
from venusrl.model.tokenizer import CHATML_TEMPLATE, Tokenizer, build_byte_level_tokenizer


def lookup(key: str, table: str = "main") -> str:
    """Look a key up in a table.

    Args:
        key: the key, as <b>written</b> & 'quoted' — é
        table: which table
    """
    return key


TOOLS = [
    {"type": "function", "function": Tool.from_function(lookup).schema()},
    {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the number.",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "description": "from 1 to 100"}},
                "required": ["n"],
            },
        },
    },
]


def conversation(model: str) -> list[dict[str, Any]]:
    calls = [{"type": "function", "function": {"name": "guess", "arguments": {"n": 50}}}]
    if model != "llama3_1":  # Llama 3.1's template takes one call per message
        calls.append(
            {"type": "function", "function": {"name": "lookup", "arguments": {"key": "é"}}}
        )
    tool_answers = ["higher", 'a "quoted"\nline'][: len(calls)]
    return [
        {"role": "system", "content": "You solve tasks with tools."},
        {"role": "user", "content": "Find the number."},
        {"role": "assistant", "content": "", "tool_calls": calls},
        *({"role": "tool", "content": a} for a in tool_answers),
        {"role": "assistant", "content": "It is 75."},
        {"role": "user", "content": "Again, please."},
    ]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers_on_the_models_own_template(
    model: str, with_tools: bool, add_generation_prompt: bool
) -> None:
    ours, theirs = tokenizer(model), transformers_tokenizer(model)
    messages = conversation(model)
    tools = TOOLS if with_tools else None
    expected = theirs.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt, tools) == expected
    # Encoded, the template's markup is control tokens and the rest text, as transformers has it.
    encoded = theirs.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    assert ours.encode_chat(messages, add_generation_prompt, tools) == encoded["input_ids"]


def test_tool_schemas_are_written_as_json_not_html_escaped_or_sorted() -> None:
    """Jinja's own `tojson` escapes <, >, & and ' and sorts keys; models were trained on
    `json.dumps`, as transformers renders it."""
    text = tokenizer("qwen3").apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=TOOLS[:1]
    )
    assert "as <b>written</b> & 'quoted' — é" in text
    assert text.index('"name": "lookup"') < text.index('"description"')


def test_a_template_that_knows_tools_says_so_and_chatml_does_not() -> None:
    assert all(tokenizer(model).renders_tools for model in MODELS)
    plain = Tokenizer(build_byte_level_tokenizer(), chat_template=CHATML_TEMPLATE)
    assert not plain.renders_tools
