"""SGLang's server as a rollout backend (`rollout.backend=sglang`), written from its documented
native API and never run against a real server here (SGLang needs a GPU): the request and reply
shapes are checked against a stand-in only. Start it with `--enable-priority-scheduling` (it runs
higher `priority` values first, our order) unless rollout.priorities=fifo.

A turn is `/generate` with `input_ids`, every sampling parameter given (SGLang would otherwise
take the model's `generation_config.json` defaults) and `return_logprob`: `output_token_logprobs`
holds (logprob, token id, text) per generated token. New weights load through
`/update_weights_from_disk`, which also flushes the radix cache: no KV of older weights is reused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from venusrl.engine.backend_client import BackendClient
from venusrl.engine.remote import RemoteEngineError
from venusrl.types import GenerationOutput, SamplingParams, TopLogprobs, TurnMeta


class SglangEngine(BackendClient):
    backend = "sglang"

    async def check(self, model: dict[str, Any], max_context: int, priorities: bool) -> None:
        info = await self.server.call("/get_server_info")
        if not isinstance(info, dict):
            raise self.malformed("/get_server_info", TypeError(type(info).__name__))
        if priorities and info.get("enable_priority_scheduling") is False:
            raise RemoteEngineError(
                f"SGLang at {self.url} ignores the priorities of critical groups: start it with"
                " --enable-priority-scheduling, or set rollout.priorities=fifo"
            )
        context = info.get("context_length")
        if isinstance(context, int) and context < max_context:
            raise RemoteEngineError(
                f"SGLang at {self.url} serves at most {context} tokens, fewer than"
                f" rollout.max_context={max_context}: start it with --context-length"
                f" {max_context} or lower rollout.max_context"
            )

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta, version: int
    ) -> GenerationOutput:
        body = generate_request(prompt_ids, params, meta, self.stop_token_ids(params))
        d = await self.server.call("/generate", body)
        try:
            return generate_output(d, prompt_ids, params, version)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise self.malformed("/generate", e) from None

    async def _load(self, path: Path, version: int) -> None:
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        d = await self.server.call("/update_weights_from_disk", body)
        if not (isinstance(d, dict) and d.get("success")):
            raise RemoteEngineError(f"{self.url}/update_weights_from_disk: {d!r}")


def generate_request(
    prompt_ids: list[int], params: SamplingParams, meta: TurnMeta, stop_token_ids: list[int]
) -> dict[str, Any]:
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,  # SGLang's "off" is -1
        "min_p": 0.0,
        "stop": list(params.stop),
        "stop_token_ids": stop_token_ids,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": True,
    }
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    request = {
        "input_ids": prompt_ids,
        "sampling_params": sampling,
        "return_logprob": True,
        "top_logprobs_num": params.top_logprobs,
    }
    if meta.priority:  # a server without priority scheduling may refuse the field
        request["priority"] = meta.priority
    return request


def generate_output(
    d: dict[str, Any], prompt_ids: list[int], params: SamplingParams, version: int
) -> GenerationOutput:
    info = d["meta_info"]
    sampled = info["output_token_logprobs"]  # [logprob, token id, text or None] per token
    token_ids = [int(entry[1]) for entry in sampled]
    if "output_ids" in d and [int(t) for t in d["output_ids"]] != token_ids:
        raise ValueError("output_ids and output_token_logprobs name different tokens")
    top: list[TopLogprobs] = []
    if params.top_logprobs:
        for position in info["output_top_logprobs"]:
            top.append([(int(entry[1]), float(entry[0])) for entry in position])
    finish = info["finish_reason"]
    return GenerationOutput(
        str(info["id"]),
        list(prompt_ids),
        token_ids,
        [float(entry[0]) for entry in sampled],
        [version] * len(token_ids),
        str(finish["type"] if isinstance(finish, dict) else finish),
        int(info.get("cached_tokens") or 0),
        top,
    )
