"""The HTTP server, driven by the official `openai` client and raw HTTP, on a real port."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.conftest import write_hf_model
from tests.engine.test_parity_hf import reference_logprobs, reference_tokens
from venusrl.engine.remote import RemoteEngine
from venusrl.engine.tokenizer import Tokenizer, write_byte_level_tokenizer

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_hf_model(tmp_path_factory.mktemp("served"), "qwen3", seed=3, head_dim=16)
    write_byte_level_tokenizer(path, 512)
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "venusrl.cli",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--api-key",
            API_KEY,
            "engine.threads=1",
            "engine.page_size=4",
            "engine.device_kv_pages=512",
            "server.model_name=tiny",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited early:\n{proc.stdout.read() if proc.stdout else ''}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("server did not become healthy within 60 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture()
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_openai_client_greedy_completion_matches_transformers(
    client: openai.OpenAI, reference: Any
) -> None:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(300, 512, (n,), generator=g).tolist() for n in (5, 23, 61)]
    for prompt in prompts:
        resp = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=32,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        choice = resp.choices[0]
        token_ids = choice.model_extra["token_ids"]
        expected = reference_tokens(reference, prompt, 32)
        assert len(set(expected)) > 4
        assert token_ids == expected
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        torch.testing.assert_close(
            torch.tensor(choice.logprobs.token_logprobs),
            reference_logprobs(reference, prompt, expected),
            atol=1e-4,
            rtol=0,
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 32


def test_models_endpoint_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion_applies_the_chat_template(client: openai.OpenAI, model_dir: Path) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    resp = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,  # type: ignore[arg-type]
        temperature=0,
        logprobs=True,
    )
    tok = Tokenizer.load(model_dir)
    assert tok is not None
    expected_prompt = tok.encode(tok.apply_chat_template(messages))
    assert resp.usage is not None and resp.usage.prompt_tokens == len(expected_prompt)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])


def test_streamed_completion_yields_the_same_tokens(client: openai.OpenAI) -> None:
    prompt = list(range(300, 340))
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    streamed: list[int] = []
    finish = None
    for chunk in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
    ):
        streamed += chunk.choices[0].model_extra["token_ids"]
        finish = chunk.choices[0].finish_reason or finish
    assert streamed == whole.choices[0].model_extra["token_ids"]
    assert finish == "length"


def test_streamed_text_equals_the_whole_response_with_a_stop_string(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny",
        prompt="The sky",
        max_tokens=40,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    free = client.completions.create(**kwargs).choices[0].text
    assert len(free) > 6, "the model produced too little text to test with"
    stop = free[3:5]
    whole = client.completions.create(**kwargs, stop=[stop]).choices[0]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kwargs, stop=[stop], stream=True)
    )
    assert whole.text == free[: free.find(stop)]
    assert streamed == whole.text
    assert whole.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(
    client: openai.OpenAI,
) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", prompt=list(range(300, 320)), max_tokens=16, temperature=1.0, seed=11, n=3
    )
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    ids_a = [c.model_extra["token_ids"] for c in a.choices]
    assert ids_a == [c.model_extra["token_ids"] for c in b.choices]
    assert len({tuple(x) for x in ids_a}) == 3


def test_native_generate_returns_tokens_logprobs_and_versions(server: str) -> None:
    body = {
        "input_ids": list(range(300, 330)),
        "trajectory_id": "t1",
        "group_id": "g1",
        "priority": 5,
        "sampling_params": {"max_tokens": 10, "temperature": 0},
    }
    r = httpx.post(f"{server}/generate", json=body, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["token_ids"]) == len(out["logprobs"]) == len(out["weight_versions"]) == 10
    assert all(v == 0 for v in out["weight_versions"])
    assert all(lp <= 0 for lp in out["logprobs"])


def engine_counters(server: str) -> dict[str, float]:
    async def read() -> dict[str, float]:
        remote = RemoteEngine(server, API_KEY)
        try:
            return await remote.counters()
        finally:
            await remote.close()

    return asyncio.run(read())


def test_a_trajectory_keeps_its_kv_across_a_tool_wait_and_ends_over_http(server: str) -> None:
    before = engine_counters(server)
    body = {
        "input_ids": list(range(340, 380)),
        "trajectory_id": "waits",
        "expected_wait_s": 30.0,
        "sampling_params": {"max_tokens": 4, "temperature": 0},
    }
    r = httpx.post(f"{server}/generate", json=body, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    body["input_ids"] = body["input_ids"] + r.json()["token_ids"] + [5, 6, 7]  # the observation
    r = httpx.post(f"{server}/generate", json=body, headers=auth(), timeout=60)
    assert r.status_code == 200 and r.json()["cached_tokens"] >= 40, r.text
    r = httpx.post(f"{server}/end_trajectory", json={"trajectory_id": "waits"}, headers=auth())
    assert r.status_code == 200, r.text
    # `GET /stats` counts the hit, and the forward passes of both turns.
    after = engine_counters(server)
    assert after["device_hit_tokens"] - before["device_hit_tokens"] >= 40
    assert after["generated_tokens"] - before["generated_tokens"] == 8
    assert after["tool_returns"] - before["tool_returns"] == 1  # the second turn
    assert after["busy_s"] > before["busy_s"]


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": list(range(600)), "max_tokens": 4}, 400, "context limit"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 511}, 400, "context limit"),
        ("/v1/completions", {"model": "gpt-9", "prompt": [1]}, 404, "does not exist"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
        ("/v1/completions", {"prompt": [1], "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_tokenz": 3}},
            400,
            "max_tokenz",
        ),
        ("/generate", {"input_ids": [], "sampling_params": {}}, 400, "input_ids"),
        ("/generate", {"input_ids": [1], "expected_wait_s": -1}, 400, "expected_wait_s"),
        ("/generate", {"input_ids": [1], "expected_wait_s": 1}, 400, "trajectory_id"),
        ("/end_trajectory", {}, 400, "trajectory_id"),
        ("/update_weights", {"path": "/nonexistent"}, 400, "not a directory"),
        ("/update_weights", {"path": "/etc"}, 400, "no *.safetensors"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_k": 1.5}}, 400, "top_k"),
        ("/generate", {"input_ids": [1], "sampling_params": {"stop": ["a", 5]}}, 400, "stop"),
        ("/v1/completions", {"prompt": [1], "seed": 2**64}, 400, "seed"),
        ("/v1/completions", {"prompt": [1], "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content"),
    ],
)
def test_bad_requests_get_a_4xx_that_says_what_is_wrong(
    server: str, path: str, body: dict[str, Any], status: int, words: str
) -> None:
    r = httpx.post(f"{server}{path}", json=body, headers=auth(), timeout=60)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    # ... and the server keeps serving.
    ok = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": [300, 301], "max_tokens": 2},
        headers=auth(),
        timeout=60,
    )
    assert ok.status_code == 200


def test_a_vanishing_temperature_samples_greedily_instead_of_failing(server: str) -> None:
    body = {"prompt": list(range(300, 330)), "max_tokens": 8}
    greedy = httpx.post(
        f"{server}/v1/completions", json={**body, "temperature": 0}, headers=auth(), timeout=60
    )
    tiny = httpx.post(
        f"{server}/v1/completions", json={**body, "temperature": 1e-40}, headers=auth(), timeout=60
    )
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]


def test_malformed_json_is_a_400(server: str) -> None:
    r = httpx.post(
        f"{server}/v1/completions",
        content=b"{not json",
        headers={**auth(), "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_requests_without_the_api_key_are_refused(server: str) -> None:
    r = httpx.post(f"{server}/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=30)
    assert r.status_code == 401
    assert httpx.get(f"{server}/stats", timeout=30).status_code == 401
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def test_hot_weight_update_switches_outputs_to_the_new_weights(
    server: str, client: openai.OpenAI, tmp_path: Path
) -> None:
    import transformers

    new_dir = write_hf_model(tmp_path / "v1", "qwen3", seed=99, head_dim=16)
    new_hf = transformers.AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    r = httpx.post(
        f"{server}/update_weights",
        json={"path": str(new_dir), "flush_cache": True},
        headers=auth(),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == 1
    prompt = list(range(310, 345))
    resp = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].model_extra["token_ids"] == reference_tokens(new_hf, prompt, 16)
    gen = httpx.post(
        f"{server}/generate",
        headers=auth(),
        timeout=60,
        json={"input_ids": prompt, "sampling_params": {"max_tokens": 3}},
    ).json()
    assert gen["weight_versions"] == [1, 1, 1]
