"""Wait for a venusrl server, then query it with the official openai client."""

from __future__ import annotations

import argparse
import json
import time

import httpx
import openai


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--timeout-s", type=float, default=120)
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout_s
    while True:
        try:
            if httpx.get(f"{args.base_url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no healthy server at {args.base_url} after {args.timeout_s} s")
        time.sleep(0.3)

    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=16, temperature=0
    )
    done = client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=8, temperature=0)
    native = httpx.post(
        f"{args.base_url}/generate",
        json={
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {"max_tokens": 8, "temperature": 0},
            "trajectory_id": "demo-0",
            "group_id": "demo",
            "priority": 1,
        },
        timeout=60,
    ).json()
    print(
        json.dumps(
            {
                "model": model,
                "chat_token_ids": chat.choices[0].model_extra["token_ids"],  # type: ignore[index]
                "completion_token_ids": done.choices[0].model_extra["token_ids"],  # type: ignore[index]
                "generate": native,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
