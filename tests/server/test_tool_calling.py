"""OpenAI tool calling through `venusrl serve` and the official `openai` client, with a model that
writes the call itself: a tiny model taught, by imitation steps in the fixture, to call
`get_weather` when asked about the weather and to answer from the tool's result. Each model is
served twice over: with a chat template that renders `tools` itself (as Qwen's does) and with the
repository's plain ChatML one, for which the server writes tools and calls as Hermes text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.conftest import write_hf_model
from tests.server.process import serving
from venusrl.model.directory import load_model
from venusrl.model.packed_rows import PackedRows
from venusrl.model.tokenizer import (
    CHATML_TEMPLATE,
    Tokenizer,
    build_byte_level_tokenizer,
    renders_tools,
    write_byte_level_tokenizer,
)
from venusrl.model.tool_formats import tool_parser
from venusrl.server.bodies import ChatBody
from venusrl.server.tool_calling import CallRules, CallWatch, template_input
from venusrl.trainer.checkpoint import write_model_dir
from venusrl.trainer.config import TrainerConfig
from venusrl.trainer.trainer import GRPOTrainer
from venusrl.types import Trajectory


def function(name: str, description: str, argument: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {argument: {"type": "string"}}}
    schema = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": schema}


TOOLS = [
    function("get_weather", "The weather in a city now.", "city"),
    function("get_time", "The local time in a city.", "city"),
]
HERMES = tool_parser("hermes")
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = HERMES.format_call("get_weather", {"city": "Paris"})
RESULT = "sunny, 21 C"
ANSWER = "It is sunny in Paris, 21 C."

# Qwen2.5's layout of tools, calls and responses, reduced (written for this test).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant{% if message.content %}\n{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {"template_with_tools": TOOLS_TEMPLATE, "chatml_fallback": CHATML_TEMPLATE}


def after_the_call(call_id: str) -> list[dict[str, Any]]:
    arguments = json.dumps({"city": "Paris"})
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]


def chat_ids(tok: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt as the server renders it."""
    body = ChatBody.model_validate({"messages": messages, "tools": TOOLS})
    rendered, tools = template_input(body, tok.renders_tools, HERMES)
    return tok.encode_chat(rendered, tools=tools)


def taught_model(root: Path, template: str) -> Path:
    """A tiny model that answers QUESTION with CALL_TEXT and the call's result with ANSWER, as
    greedy decoding reads it: imitation steps until every target token is likely enough that
    the engine's arithmetic, not quite the trainer's, cannot pick another."""
    base = write_hf_model(root / "base", "qwen3", seed=3, head_dim=16, max_position_embeddings=1024)
    plain = Tokenizer(build_byte_level_tokenizer(), chat_template=template, eos_token="<|im_end|>")
    turns = [(QUESTION, CALL_TEXT), (after_the_call("call_0"), ANSWER)]
    corpus = [plain.decode(chat_ids(plain, m), False) + text for m, text in turns]
    write_byte_level_tokenizer(base, 1024, build_byte_level_tokenizer(corpus * 4, vocab_size=512))
    config_path = base / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": template}))
    tok = Tokenizer.load(base)
    assert tok is not None
    demos = []
    for messages, text in turns:
        demo = Trajectory.start("t", "g", "p", chat_ids(tok, messages))
        target = tok.encode(text) + list(tok.eos_token_ids)
        demo.add_model_turn(target, [0.0] * len(target), [0] * len(target))
        demos.append(demo)
    trainer = GRPOTrainer(load_model(base), TrainerConfig(kl_coef=0.0))
    for _ in range(300):
        trainer.imitation_step(demos, lr=3e-3)
        if all(least_target_probability(trainer, d) > 0.9 for d in demos):
            break
    else:
        pytest.fail("the model did not learn its demonstrations in 300 imitation steps")
    write_model_dir(root / "taught", trainer.model, like=base)
    return root / "taught"


def least_target_probability(trainer: GRPOTrainer, demo: Trajectory) -> float:
    with torch.no_grad():
        rows = PackedRows.pack([demo.token_ids], torch.device("cpu"))
        logits = trainer.model.lm_head(
            trainer.model.forward_rows(rows, torch.arange(len(demo.token_ids)))
        )
    probs = torch.softmax(logits[demo.prompt_len - 1 : -1], dim=-1)
    targets = torch.tensor(demo.token_ids[demo.prompt_len :])
    return float(probs.gather(-1, targets[:, None]).min())


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    model = taught_model(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])
    overrides = ["engine.threads=1", "engine.page_size=4", "server.tool_parser=hermes"]
    with serving(model, *overrides, "server.model_name=tiny") as url:
        yield url, model


def written_by_hand(tok: Tokenizer, call_id: str) -> list[int]:
    """The prompt after the call, rendered here without the server's code: Hugging Face's inputs
    for a template that knows tools, Qwen's Hermes text for one that does not."""
    if tok.renders_tools:
        call = {"name": "get_weather", "arguments": {"city": "Paris"}}
        messages = [
            *QUESTION,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": call_id, "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": RESULT},
        ]
        return tok.encode_chat(messages, tools=TOOLS)
    system = HERMES.tool_prompt([t["function"] for t in TOOLS])
    response = f"<tool_response>\n{RESULT}\n</tool_response>"
    messages = [
        {"role": "system", "content": system},
        *QUESTION,
        {"role": "assistant", "content": CALL_TEXT},
        {"role": "user", "content": response},
    ]
    return tok.encode_chat(messages)


@pytest.fixture()
def client(served: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, messages: list[Any], **options: Any) -> Any:
    return client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=80, **options
    )


def test_openai_client_round_trip_calls_the_tool_then_answers_from_its_result(
    client: openai.OpenAI, served: tuple[str, Path]
) -> None:
    first = ask(client, QUESTION).choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The call is what the model generated, token by token.
    tok = Tokenizer.load(served[1])
    assert tok is not None and tok.decode(first.model_extra["token_ids"]) == CALL_TEXT

    result = {"role": "tool", "tool_call_id": call.id, "content": RESULT}
    response = ask(client, [*QUESTION, first.message, result])
    assert response.usage.prompt_tokens == len(written_by_hand(tok, call.id))
    second = response.choices[0]
    assert second.finish_reason == "stop"
    assert second.message.content == ANSWER and not second.message.tool_calls


def test_streamed_tool_call_deltas_reassemble_into_the_whole_answers_calls(
    client: openai.OpenAI,
) -> None:
    whole = ask(client, QUESTION).choices[0].message
    content, calls, finish = "", {}, None
    for chunk in ask(client, QUESTION, stream=True):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: its id, type and name
                assert delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [c["id"][:5] for c in calls.values()] == ["call_"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]


def test_tool_choice_none_leaves_the_call_text_as_content(client: openai.OpenAI) -> None:
    choice = ask(client, QUESTION, tool_choice="none").choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == CALL_TEXT and not choice.message.tool_calls


def test_a_named_tool_choice_returns_that_functions_call_and_never_another(
    client: openai.OpenAI,
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert ask(client, QUESTION, tool_choice=named).choices[0].finish_reason == "tool_calls"
    # The model calls get_weather: asked for get_time, the server does not pass that call off
    # as one and has no other to give, so the text comes back as written.
    other = {"type": "function", "function": {"name": "get_time"}}
    choice = ask(client, QUESTION, tool_choice=other).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == CALL_TEXT and not choice.message.tool_calls


def test_required_tool_choice_never_invents_a_call_the_model_did_not_write(
    client: openai.OpenAI,
) -> None:
    choice = ask(client, after_the_call("call_1"), tool_choice="required").choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == ANSWER and not choice.message.tool_calls


def call_with(arguments: Any) -> dict[str, Any]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'function'"),
        (
            {"tools": [{"type": "function", "function": {"description": "x"}}]},
            "tools[0].function.name",
            "required",
        ),
        ({"tools": [function("no spaces", "x", "y")]}, "tools[0].function.name", "pattern"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2]", "two functions are named 'get_weather'"),
        ({"tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required"'),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_news"}}},
            "tool_choice.function.name",
            "'get_news', which is not in tools",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"messages": [*QUESTION, {"role": "tool", "content": RESULT}]},
            "messages[1].tool_call_id",
            "tool_call_id",
        ),
        (
            {"messages": [*QUESTION, call_with('["Paris"]')]},
            "messages[1].tool_calls[0].function.arguments",
            "JSON string of an object",
        ),
        (
            {"messages": [*QUESTION, call_with("{city: Paris}")]},
            "messages[1].tool_calls[0].function.arguments",
            "JSON string of an object",
        ),
        (
            {"messages": [*QUESTION, call_with({"city": "Paris"})]},
            "messages[1].tool_calls[0].function.arguments",
            "string",
        ),
        (
            {"messages": [{**call_with("{}"), "role": "user"}]},
            "messages[0].tool_calls",
            "only an assistant",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "required"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls", "not supported"),
        ({"functions": [TOOLS[0]["function"]]}, "functions", "not supported"),
    ],
)
def test_bad_tool_requests_get_a_400_naming_the_field(
    served: tuple[str, Path], change: dict[str, Any], param: str, words: str
) -> None:
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 4, **change}
    r = httpx.post(f"{served[0]}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    # ... and the server keeps serving.
    ok = httpx.post(
        f"{served[0]}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200


def test_a_template_without_tools_gets_them_as_hermes_text_in_the_system_message() -> None:
    body = ChatBody.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                *after_the_call("call_1")[1:],
                {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
            ],
            "tools": TOOLS,
        }
    )
    messages, tools = template_input(body, renders_tools(CHATML_TEMPLATE), HERMES)
    assert tools is None  # the template would not show them
    prompt = HERMES.tool_prompt([t["function"] for t in TOOLS])
    assert messages == [
        {"role": "system", "content": f"Be brief.\n\n{prompt}"},
        {"role": "assistant", "content": CALL_TEXT},
        # One turn's responses are one user message, as Qwen's template writes them.
        {
            "role": "user",
            "content": f"<tool_response>\n{RESULT}\n</tool_response>\n"
            "<tool_response>\nwindy\n</tool_response>",
        },
    ]


def test_a_template_that_knows_tools_gets_them_and_the_calls_arguments_as_objects() -> None:
    # As Hugging Face's apply_chat_template passes them: the template serialises the arguments.
    body = ChatBody.model_validate({"messages": after_the_call("call_1"), "tools": TOOLS})
    messages, tools = template_input(body, renders_tools(TOOLS_TEMPLATE), HERMES)
    assert tools == TOOLS
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "content": RESULT, "tool_call_id": "call_1"}


def test_streamed_content_holds_back_only_what_may_begin_a_call() -> None:
    rules = CallRules.of(ChatBody.model_validate({"messages": QUESTION, "tools": TOOLS}), HERMES)
    assert rules is not None
    watch = CallWatch(rules)
    assert watch.push("Let me check: a<") == "Let me check: a"  # "<" may open a call
    assert watch.push("b ") == "<b "  # ... and did not
    assert watch.push("<tool") == ""  # may be "<tool_call>"
    assert watch.push("_call>\n" + CALL_TEXT.removeprefix("<tool_call>\n")) == ""
    rest, calls = watch.finish()
    assert rest == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    # A turn whose call text holds no call that can run is content after all, every character.
    watch = CallWatch(rules)
    sent = watch.push("Here: <tool_call>\n{not json}\n</tool_call>")
    rest, calls = watch.finish()
    assert sent + rest == "Here: <tool_call>\n{not json}\n</tool_call>" and calls == []


def test_a_turns_calls_stand_together_or_the_whole_text_is_content() -> None:
    rules = CallRules.of(ChatBody.model_validate({"messages": QUESTION, "tools": TOOLS}), HERMES)
    assert rules is not None
    time_call = HERMES.format_call("get_time", {"city": "Paris"})
    content, calls = rules.split(f"Checking both.\n{CALL_TEXT}\n{time_call}")
    assert content == "Checking both.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"city": "Paris"}),
    ]
    assert len({c["id"] for c in calls}) == 2
    # One call that cannot run (malformed, or of a function not offered) and none is returned:
    # the client sees what the model wrote.
    for bad in ("<tool_call>\n{oops}\n</tool_call>", HERMES.format_call("get_news", {})):
        text = f"{CALL_TEXT}\n{bad}"
        assert rules.split(text) == (text, [])
