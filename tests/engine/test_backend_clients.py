"""Shape checks of the vLLM and SGLang clients, not backend tests: a small real HTTP server
records what the clients send and answers in each backend's documented shape (vLLM 0.32's
`/v1/completions` and `/server_info`, as a real server answered them; SGLang's `/generate` and
`/update_weights_from_disk` from its documentation, never from a running SGLang). The slow test
`tests/runtime/test_vllm_backend.py` trains against a real vLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Reply, StandIn
from venusrl.engine.remote import RemoteEngine, RemoteEngineError
from venusrl.engine.sglang_client import SglangEngine
from venusrl.engine.vllm_client import VllmEngine
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta


def vllm_completion(body: dict[str, Any]) -> tuple[int, Any]:
    """Two tokens, in the shape vLLM 0.32 answered `return_token_ids` with `logprobs=2`."""
    return 200, {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "",
                "logprobs": {
                    "text_offset": [0, 12],
                    "token_logprobs": [-0.5, -1.25],
                    "tokens": ["token_id:493", "token_id:258"],
                    "top_logprobs": [
                        {"token_id:493": -0.5, "token_id:553": -2.0, "token_id:8": -1.0},
                        {"token_id:258": -1.25, "token_id:493": -0.75},
                    ],
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": [493, 258],
                "prompt_token_ids": body["prompt"],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": None},
    }


def vllm_server_info(logprobs_mode: str, policy: str, max_model_len: int) -> Reply:
    config = {
        "model_config": {"logprobs_mode": logprobs_mode, "max_model_len": max_model_len},
        "scheduler_config": {"policy": policy},
    }
    return lambda body: (200, {"vllm_config": config, "vllm_env": {}, "system_env": {}})


def test_a_vllm_turn_sends_token_ids_and_returns_tokens_logprobs_and_the_gates_version(
    stand_in: StandIn,
) -> None:
    stand_in.replies["/v1/completions"] = vllm_completion
    client = VllmEngine(stand_in.url, eos_token_ids=[258], version=4)
    params = SamplingParams(max_tokens=5, temperature=0.7, stop_token_ids=(9,), top_logprobs=2)

    async def turns() -> list[Any]:
        try:
            return [
                await client.generate([1, 2, 3], params, TurnMeta(priority=1)),
                await client.generate([1, 2, 3], params, TurnMeta(priority=0)),
            ]
        finally:
            await client.close()

    high, _ = asyncio.run(turns())
    (_, sent), (_, sent_low) = stand_in.requests
    assert sent["prompt"] == [1, 2, 3] and sent["max_tokens"] == 5
    assert sent["temperature"] == 0.7 and sent["logprobs"] == 2
    assert sent["return_token_ids"] and sent["return_tokens_as_token_ids"]
    assert sent["stop_token_ids"] == [9, 258]  # the model's EOS: the server may know none
    assert sent["priority"] == -1  # vLLM runs lower values first
    assert "priority" not in sent_low  # 0 is refused by a server without priority scheduling
    assert sent["cache_salt"] == "venusrl-weights-v4"  # no KV of other weights is reused
    assert high.token_ids == [493, 258] and high.logprobs == [-0.5, -1.25]
    assert high.weight_versions == [4, 4] and high.finish_reason == "stop"
    assert high.top_logprobs == [[(493, -0.5), (8, -1.0)], [(493, -0.75), (258, -1.25)]]


UNTIED = {"model_type": "qwen3", "tie_word_embeddings": False}  # a model's config.json


def test_vllm_refuses_a_model_whose_output_head_is_tied_to_its_embedding(
    stand_in: StandIn,
) -> None:
    """vLLM 0.32's in-place reload keeps a tied head's old tensor (seen in the slow test)."""
    stand_in.replies["/server_info?config_format=json"] = vllm_server_info(
        "processed_logprobs", "priority", 1024
    )
    tied = UNTIED | {"tie_word_embeddings": True}
    with pytest.raises(RemoteEngineError, match="tie_word_embeddings"):
        asyncio.run(VllmEngine(stand_in.url, [258], 0).check(tied, 1024, priorities=True))


def test_a_vllm_server_that_cannot_serve_the_run_is_refused_with_the_flags_it_needs(
    stand_in: StandIn,
) -> None:
    stand_in.replies["/server_info?config_format=json"] = vllm_server_info(
        "raw_logprobs", "fcfs", 512
    )
    client = VllmEngine(stand_in.url, [258], 0)
    with pytest.raises(RemoteEngineError) as err:
        asyncio.run(client.check(UNTIED, max_context=1024, priorities=True))
    for flag in ("--logprobs-mode processed_logprobs", "--scheduling-policy priority",
                 "rollout.priorities=fifo", "--max-model-len 1024"):  # fmt: skip
        assert flag in str(err.value)
    stand_in.replies["/server_info?config_format=json"] = vllm_server_info(
        "processed_logprobs", "fcfs", 1024
    )
    asyncio.run(client.check(UNTIED, max_context=1024, priorities=False))  # fifo: none sent


def sglang_generate(body: dict[str, Any]) -> tuple[int, Any]:
    """SGLang's documented `/generate` reply with `return_logprob` and `top_logprobs_num=1`."""
    return 200, {
        "text": "",
        "output_ids": [17, 2],
        "meta_info": {
            "id": "abc",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": 2,
            "cached_tokens": 2,
            "output_token_logprobs": [[-0.25, 17, None], [-0.5, 2, None]],
            "output_top_logprobs": [[[-0.25, 17, None]], [[-0.5, 2, None]]],
            "weight_version": "default",
        },
    }


def test_an_sglang_turn_sends_input_ids_and_every_sampling_parameter(stand_in: StandIn) -> None:
    stand_in.replies["/generate"] = sglang_generate
    client = SglangEngine(stand_in.url, eos_token_ids=[2], version=3)
    params = SamplingParams(max_tokens=4, temperature=1.0, top_logprobs=1)

    async def turn() -> Any:
        try:
            return await client.generate([5, 6, 7], params, TurnMeta(priority=1))
        finally:
            await client.close()

    out = asyncio.run(turn())
    ((path, sent),) = stand_in.requests
    assert path == "/generate" and sent["input_ids"] == [5, 6, 7]
    assert sent["return_logprob"] is True and sent["top_logprobs_num"] == 1
    assert sent["priority"] == 1  # SGLang runs higher values first by default
    # Given whole: SGLang would otherwise take generation_config.json's defaults.
    assert sent["sampling_params"] == {
        "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "stop": [], "stop_token_ids": [2], "ignore_eos": False, "no_stop_trim": True,
    }  # fmt: skip
    assert out.token_ids == [17, 2] and out.logprobs == [-0.25, -0.5]
    assert out.weight_versions == [3, 3] and out.finish_reason == "stop"
    assert out.cached_prompt_tokens == 2 and out.top_logprobs == [[(17, -0.25)], [(2, -0.5)]]


def test_an_sglang_weight_update_it_refuses_keeps_the_old_version(stand_in: StandIn) -> None:
    stand_in.replies["/update_weights_from_disk"] = lambda body: (
        200, {"success": False, "message": "shape mismatch", "num_paused_requests": 0}
    )  # fmt: skip
    stand_in.replies["/generate"] = sglang_generate
    client = SglangEngine(stand_in.url, [2], version=3)

    async def update_then_turn() -> list[int]:
        try:
            with pytest.raises(RemoteEngineError, match="shape mismatch"):
                await client.update_weights(Path("/ckpt/v4"), 4)
            return (await client.generate([1], SamplingParams(), TurnMeta())).weight_versions
        finally:
            await client.close()

    assert asyncio.run(update_then_turn()) == [3, 3]
    body = dict(stand_in.requests)["/update_weights_from_disk"]
    assert body == {"model_path": "/ckpt/v4", "weight_version": "4", "flush_cache": True}


@pytest.mark.parametrize(
    ("client", "path", "reply"),
    [
        (VllmEngine, "/v1/completions", {"choices": [{"token_ids": [1, 2]}]}),
        (SglangEngine, "/generate", {"meta_info": {"id": "x"}}),
        (VllmEngine, "/v1/completions", None),  # an empty 200
    ],
)
def test_a_malformed_reply_is_an_engine_failure_not_a_crash(
    stand_in: StandIn, client: type[VllmEngine | SglangEngine], path: str, reply: Any
) -> None:
    """RemoteEngineError is what the agent loop counts as the platform failing the episode."""
    stand_in.replies[path] = lambda body: (200, reply)
    engine = client(stand_in.url, [2], 0)

    async def turn() -> None:
        try:
            await engine.generate([1], SamplingParams(), TurnMeta())
        finally:
            await engine.close()

    with pytest.raises(RemoteEngineError, match="malformed"):
        asyncio.run(turn())


def test_a_native_reply_missing_a_field_or_of_the_wrong_type_is_an_engine_failure(
    stand_in: StandIn,
) -> None:
    good = {"request_id": "r", "token_ids": [5], "logprobs": [-0.1], "weight_versions": [0],
            "finish_reason": "length", "prompt_tokens": 1}  # fmt: skip
    engine = RemoteEngine(stand_in.url)

    async def turn() -> GenerationOutput:
        return await engine.generate([1], SamplingParams(max_tokens=1), TurnMeta())

    async def check() -> None:
        try:
            stand_in.replies["/generate"] = lambda body: (200, good)
            out = await turn()
            assert out.token_ids == [5] and out.weight_versions == [0]
            for broken, field in [
                ({k: v for k, v in good.items() if k != "weight_versions"}, "weight_versions"),
                ({**good, "token_ids": ["5"]}, "token_ids.0"),
                ({**good, "surprise": 1}, "surprise"),
            ]:
                stand_in.replies["/generate"] = lambda body, broken=broken: (200, broken)
                with pytest.raises(RemoteEngineError, match=f"malformed reply.*{field}"):
                    await turn()
        finally:
            await engine.close()

    asyncio.run(check())
