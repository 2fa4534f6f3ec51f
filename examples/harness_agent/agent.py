"""A small agent harness of its own, written against OpenAI's client and nothing of venusrl: it
asks the model, runs the `add` calls the model makes, nudges it when it answers without having
used the tool, and prints its answer. `venusrl train` points it at the gateway through
OPENAI_BASE_URL (the session is in the URL) and gives it the task in VENUSRL_TASK_PROMPT."""

from __future__ import annotations

import json
import os
import sys

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "The sum of two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "3"))


def add(arguments: str) -> str:
    try:
        given = json.loads(arguments)
        return str(int(given["a"]) + int(given["b"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


def main() -> None:
    client = openai.OpenAI()
    messages: list[dict] = [
        {"role": "system", "content": "Add the numbers with the add tool, then say the sum."},
        {"role": "user", "content": os.environ["VENUSRL_TASK_PROMPT"]},
    ]
    answer, added = "", False
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=64
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if message.tool_calls:
            for call in message.tool_calls:
                result = add(call.function.arguments) if call.function.name == "add" else "error"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            added = True
        elif added:
            break
        else:
            messages.append({"role": "user", "content": "Use the add tool, then say the sum."})
    print(answer)


if __name__ == "__main__":
    sys.exit(main())
