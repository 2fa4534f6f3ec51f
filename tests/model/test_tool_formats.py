"""Tool-call formats: each parser reads what its models write, answers every malformed call with
a message for the model instead of raising, and reads back what its `format_call` writes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from venusrl.model.tool_calls import ToolCall, ToolCallError, format_tool_response
from venusrl.model.tool_formats import (
    TOOL_PARSERS,
    ToolParser,
    detect_tool_parser,
    resolve_tool_parser,
    tool_parser,
)

HERMES = tool_parser("hermes")
CODER = tool_parser("qwen3_coder")
LLAMA = tool_parser("llama3_json")
TEMPLATES = __import__("pathlib").Path(__file__).parents[1] / "chat_templates"
# What Tool.schema() gives: the parameters' JSON types convert Qwen3-Coder's text values.
TOOLS = [
    {
        "name": "write_file",
        "description": "Write a file.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "mode": {"type": "integer"},
                "append": {"type": "boolean"},
                "lines": {"type": "array"},
                "meta": {"type": "object"},
                "ratio": {"type": "number"},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["path", "content"],
        },
    },
    {
        "name": "guess",
        "description": "Guess.",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    },
]


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def only_error(text: str, parser: ToolParser = HERMES) -> str:
    [parsed] = parser.parse(text, TOOLS)
    assert isinstance(parsed, ToolCallError), parsed
    return parsed.message


# --- every format -----------------------------------------------------------------------------

ARGUMENTS = [
    {"n": 50},
    {"path": "a.py", "content": "def f(x):\n    return {'a': [x]}\n", "mode": 420},
    {"path": "b", "content": "", "append": True, "lines": [1, "x"], "meta": {"k": None}},
    {"path": "c", "content": "  spaced  ", "ratio": 0.25, "note": None},
    {},
]


@pytest.mark.parametrize("parser", TOOL_PARSERS.values(), ids=TOOL_PARSERS)
@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_format_call_reads_back_as_the_same_call(parser: ToolParser, arguments: dict[str, Any]):
    name = "guess" if set(arguments) <= {"n"} else "write_file"
    assert parser.parse(parser.format_call(name, arguments), TOOLS) == [ToolCall(name, arguments)]


@pytest.mark.parametrize("parser", TOOL_PARSERS.values(), ids=TOOL_PARSERS)
def test_text_before_a_call_is_content_and_the_call_is_read(parser: ToolParser):
    text = "I will guess the middle.\n" + parser.format_call("guess", {"n": 50})
    assert parser.parse(text, TOOLS) == [ToolCall("guess", {"n": 50})]
    assert parser.call_start(text) == len("I will guess the middle.\n")


@pytest.mark.parametrize("parser", TOOL_PARSERS.values(), ids=TOOL_PARSERS)
def test_several_calls_keep_their_order(parser: ToolParser):
    separator = "; " if parser is LLAMA else "\n"
    text = separator.join(parser.format_call("guess", {"n": n}) for n in (1, 2, 3))
    assert parser.parse(text, TOOLS) == [ToolCall("guess", {"n": n}) for n in (1, 2, 3)]


@pytest.mark.parametrize("parser", TOOL_PARSERS.values(), ids=TOOL_PARSERS)
def test_a_plain_answer_has_no_calls_and_no_call_start(parser: ToolParser):
    text = "The number is 42, found in 6 guesses."
    assert parser.parse(text, TOOLS) == []
    assert parser.call_start(text) is None


@pytest.mark.parametrize("parser", TOOL_PARSERS.values(), ids=TOOL_PARSERS)
def test_call_start_holds_back_a_marker_cut_off_at_the_end(parser: ToolParser):
    """The server streams content up to `call_start`: a marker still arriving must wait."""
    full = "Sure.\n" + parser.format_call("guess", {"n": 5})
    start = parser.call_start(full)
    assert start == len("Sure.\n")
    for end in range(start + 1, len(full) + 1):
        assert parser.call_start(full[:end]) == start, full[:end]


_TAGGY_TEXT = st.lists(
    st.sampled_from(
        [
            "<tool_call>",
            "</tool_call>",
            "<function=guess>",
            "</function>",
            "<parameter=n>",
            "</parameter>",
            '{"name": "guess", "parameters": {"n": 1}}',
            "<|python_tag|>",
            '{"name": "f", "arguments": {}}',
            "{",
            "}",
            ";",
            "\n",
        ]
    )
    | st.text(max_size=20)
).map("".join)


@given(_TAGGY_TEXT)
def test_any_text_parses_without_raising(text: str):
    for parser in TOOL_PARSERS.values():
        for parsed in parser.parse(text, TOOLS):
            assert isinstance(parsed, ToolCall | ToolCallError)
        start = parser.call_start(text)
        assert start is None or 0 <= start <= len(text)


# --- hermes ----------------------------------------------------------------------------------


def test_one_call_with_arguments_is_parsed():
    assert HERMES.parse(f"Let me try 50.\n{call('guess', n=50)}") == [ToolCall("guess", {"n": 50})]


def test_several_calls_in_one_turn_keep_their_order():
    text = f"{call('write_file', path='a', content='x')} then {call('bash', command='cat a')}"
    assert HERMES.parse(text) == [
        ToolCall("write_file", {"path": "a", "content": "x"}),
        ToolCall("bash", {"command": "cat a"}),
    ]


def test_missing_arguments_mean_none():
    assert HERMES.parse('<tool_call>{"name": "status"}</tool_call>') == [ToolCall("status")]


def test_text_without_tool_call_tags_has_no_calls():
    assert HERMES.parse('The answer is 42. {"name": "guess", "arguments": {}}') == []


def test_unclosed_tag_is_an_error_that_says_so():
    assert "not closed" in only_error('<tool_call>{"name": "guess", "arguments": {"n": 5}}')


def test_a_tag_left_open_before_the_next_call_does_not_swallow_it():
    parsed = HERMES.parse(f'<tool_call>{{"name": "guess"\n{call("guess", n=7)}')
    assert isinstance(parsed[0], ToolCallError) and "before the next <tool_call>" in (
        parsed[0].message
    )
    assert parsed[1:] == [ToolCall("guess", {"n": 7})]


def test_closing_tag_without_opening_is_an_error():
    assert "has no <tool_call> before it" in only_error('{"name": "guess"}</tool_call>')


def test_invalid_json_error_gives_the_position():
    # Lines count from the one holding <tool_call>, as the model wrote them.
    message = only_error('<tool_call>\n{"name": "guess" "arguments": {"n": 5}}\n</tool_call>')
    assert message == "tool call #1: invalid JSON at line 2 column 18: Expecting ',' delimiter"


def test_hermes_body_that_is_not_an_object_is_an_error():
    assert "got an array" in only_error("<tool_call>[1, 2]</tool_call>")


@pytest.mark.parametrize("body", ['{"arguments": {}}', '{"name": ""}', '{"name": 3}'])
def test_missing_or_bad_name_is_an_error(body: str):
    assert '"name" must be a non-empty string' in only_error(f"<tool_call>{body}</tool_call>")


def test_arguments_that_are_not_an_object_are_an_error():
    message = only_error('<tool_call>{"name": "guess", "arguments": "{\\"n\\": 5}"}</tool_call>')
    assert '"arguments" must be a JSON object, got a string' in message


def test_unexpected_keys_are_an_error():
    message = only_error('<tool_call>{"name": "guess", "arguments": {}, "id": 1}</tool_call>')
    assert "unexpected keys ['id']" in message


@pytest.mark.parametrize("body", ["[" * 100_000, "1" * 5_000])
def test_pathological_json_is_an_error_not_an_exception(body: str):
    assert "invalid JSON" in only_error(f"<tool_call>{body}</tool_call>")


def test_errors_are_numbered_and_keep_the_offending_text():
    parsed = HERMES.parse(f"{call('guess', n=1)}<tool_call>nope</tool_call>")
    assert isinstance(parsed[1], ToolCallError)
    assert parsed[1].message.startswith("tool call #2:")
    assert parsed[1].text == "<tool_call>nope</tool_call>"


def test_tool_prompt_lists_each_function_and_the_call_format():
    prompt = HERMES.tool_prompt([{"name": "guess", "description": "d", "parameters": {}}])
    assert '{"type": "function", "function": {"name": "guess"' in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in prompt


# --- qwen3_coder ------------------------------------------------------------------------------


def test_coder_values_are_typed_by_the_tool_schema():
    text = (
        "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
        '<parameter=content>\nx = "<b>"\n\n</parameter>\n<parameter=mode>\n644\n</parameter>\n'
        "<parameter=append>\nfalse\n</parameter>\n<parameter=lines>\n[1, 2]\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    assert CODER.parse(text, TOOLS) == [
        ToolCall(
            "write_file",
            {
                "path": "src/a.py",
                "content": 'x = "<b>"\n',
                "mode": 644,
                "append": False,
                "lines": [1, 2],
            },
        )
    ]


def test_coder_values_stay_text_without_a_schema():
    text = (
        "<tool_call>\n<function=guess>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    assert CODER.parse(text) == [ToolCall("guess", {"n": "7"})]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            "<function=guess>\n<parameter=n>\nseven\n</parameter>\n</function>",
            "parameter 'n' of guess must be an integer, got 'seven'",
        ),
        (
            "<function=write_file>\n<parameter=append>\nyes\n</parameter>\n</function>",
            "must be true or false",
        ),
        (
            "<function=write_file>\n<parameter=lines>\n[1,\n</parameter>\n</function>",
            "must be a JSON array",
        ),
        ('{"name": "guess", "arguments": {"n": 1}}', "one <function=NAME>...</function>"),
        ("<function=>\n</function>", "must name the tool"),
        ("<function=guess>\n<parameter=n>\n1\n</function>", "is not closed with </parameter>"),
        (
            "<function=guess>\n<parameter=n>\n1\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>",
            "given twice",
        ),
        (
            "<function=guess>\nplease\n<parameter=n>\n1\n</parameter>\n</function>",
            "unexpected text 'please'",
        ),
        ("<function=guess>\n<parameter=n>\n1\n</parameter>\n", "one <function=NAME>...</function>"),
    ],
)
def test_coder_malformed_calls_say_what_is_wrong(body: str, says: str):
    message = only_error(f"<tool_call>\n{body}\n</tool_call>", CODER)
    assert message.startswith("tool call #1: ") and says in message


def test_coder_unclosed_call_is_an_error():
    assert "not closed with </tool_call>" in only_error("<tool_call>\n<function=guess>\n", CODER)


# --- llama3_json ------------------------------------------------------------------------------


def test_llama_calls_after_the_python_tag_and_arguments_as_parameters_or_arguments():
    text = (
        '<|python_tag|>{"name": "guess", "parameters": {"n": 1}};'
        '{"name": "guess", "arguments": {"n": 2}}'
    )
    assert LLAMA.parse(text) == [ToolCall("guess", {"n": 1}), ToolCall("guess", {"n": 2})]
    assert LLAMA.parse('{"type": "function", "name": "guess", "parameters": {}}') == [
        ToolCall("guess")
    ]


def test_llama_json_inside_a_sentence_is_not_a_call():
    assert LLAMA.parse('The object {"name": "x"} is a dict.') == []


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"name": "guess", "parameters": {"n": 1}', "invalid JSON at line 1"),
        (
            '{"name": "guess", "parameters": [1]}',
            '"parameters" must be a JSON object, got an array',
        ),
        ('{"parameters": {}}', '"name" must be a non-empty string'),
        ('{"name": "guess", "parameters": {}, "id": 3}', "unexpected keys ['id']"),
        ('{"name": "guess", "parameters": {}, "arguments": {}}', "the arguments are given twice"),
        ("<|python_tag|>", "no call after <|python_tag|>"),
        ("<|python_tag|>[1]", "must be a JSON object"),
    ],
)
def test_llama_malformed_calls_say_what_is_wrong(text: str, says: str):
    message = only_error(text, LLAMA)
    assert message.startswith("tool call #1: ") and says in message


def test_llama_text_after_the_calls_is_an_error():
    parsed = LLAMA.parse('{"name": "guess", "parameters": {"n": 1}} and then I will win')
    assert parsed[0] == ToolCall("guess", {"n": 1})
    assert isinstance(parsed[1], ToolCallError) and "separated by ';'" in parsed[1].message


# --- choosing a format ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("qwen3.jinja", "hermes"),
        ("qwen3_coder.jinja", "qwen3_coder"),
        ("llama3_1.jinja", "llama3_json"),
    ],
)
def test_the_format_is_detected_from_the_real_chat_template(template: str, parser: str):
    text = (TEMPLATES / template).read_text()
    assert detect_tool_parser(text) == parser
    assert resolve_tool_parser("auto", text).name == parser


def test_a_template_without_tools_falls_back_to_hermes():
    from venusrl.model.tokenizer import CHATML_TEMPLATE

    assert detect_tool_parser(CHATML_TEMPLATE) is None
    assert resolve_tool_parser("auto", CHATML_TEMPLATE).name == "hermes"
    assert resolve_tool_parser("llama3_json", CHATML_TEMPLATE).name == "llama3_json"


def test_an_unknown_parser_name_is_an_error_listing_the_known_ones():
    with pytest.raises(
        ValueError,
        match="unknown tool parser 'mistral'; the tool parsers are: hermes, qwen3_coder,"
        " llama3_json",
    ):
        tool_parser("mistral")


@given(st.text(max_size=300), st.integers(min_value=10, max_value=200))
def test_a_response_is_capped_and_keeps_both_ends(content: str, max_chars: int):
    response = format_tool_response(content, max_chars)
    assert response.startswith("<tool_response>\n") and response.endswith("\n</tool_response>")
    if len(content) <= max_chars:
        assert response == f"<tool_response>\n{content}\n</tool_response>"
    else:
        assert f"[... {len(content) - max_chars} characters cut ...]" in response
        assert content[: max_chars // 2] in response and content[-(max_chars // 2) :] in response


def test_a_template_with_tools_in_an_unknown_format_is_read_as_hermes_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mistral = "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    assert resolve_tool_parser("auto", mistral).name == "hermes"
    assert "set rollout.tool_parser" in caplog.text
