"""vLLM's OpenAI-compatible server as a rollout backend (`rollout.backend=vllm`; built against
vLLM 0.32). Start it so that it can serve a run:

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --scheduling-policy priority --logprobs-mode processed_logprobs --max-model-len N \\
        --enable-prompt-tokens-details  # optional: cached prompt tokens in the counters

A turn is `/v1/completions` with the token ids as the prompt, `return_token_ids` and
`logprobs`: the sampled tokens and each one's logprob under the sampling distribution
(`processed_logprobs`: temperature applied, as `SamplingParams` promises; with top-p or top-k on,
which the agent loop never sets, vLLM's are of the truncated distribution). Critical groups go first
through the request's `priority` (vLLM runs lower values first). New weights load in place from a
model directory through the development route `/collective_rpc` (`reload_weights`): no other
route of this version loads weights from a directory into a running server. That reload keeps
a tied output head's old tensor, so a model with `tie_word_embeddings` is refused. The prefix
cache is salted with the weight version, so KV computed by older weights is never reused.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from venusrl.engine.backend_client import BackendClient
from venusrl.engine.remote import RemoteEngineError
from venusrl.types import GenerationOutput, SamplingParams, TopLogprobs, TurnMeta

START_IT = (
    "start vLLM with VLLM_SERVER_DEV_MODE=1 --scheduling-policy priority"
    " --logprobs-mode processed_logprobs (see venusrl/engine/vllm_client.py)"
)

log = logging.getLogger(__name__)


class VllmEngine(BackendClient):
    backend = "vllm"

    async def check(self, model: dict[str, Any], max_context: int, priorities: bool) -> None:
        if model.get("tie_word_embeddings"):
            # Measured on 0.32: `reload_weights` loads the embedding but puts the tied output
            # head's old tensor back ("ParallelLMHead: Failed to load weights"), so the server
            # would sample from a head the trainer no longer has.
            raise RemoteEngineError(
                "vLLM cannot reload a model whose output head is tied to its embedding"
                " (tie_word_embeddings in config.json): its in-place reload keeps the old head."
                " Train an untied model with rollout.backend=vllm, or use rollout.backend=venus"
            )
        try:
            info = await self.server.call("/server_info?config_format=json")
            config = info["vllm_config"]
            served, scheduler = config["model_config"], config["scheduler_config"]
        except RemoteEngineError as e:
            raise RemoteEngineError(f"{e}\n  the weight updates need its development routes: "
                                    f"{START_IT}") from None  # fmt: skip
        except (KeyError, TypeError) as e:
            raise self.malformed("/server_info", e) from None
        problems = []
        if served.get("logprobs_mode") != "processed_logprobs":
            problems.append(
                f"it returns {served.get('logprobs_mode')}, not the logprobs of the distribution"
                " it samples from: start it with --logprobs-mode processed_logprobs"
            )
        if priorities and scheduler.get("policy") != "priority":
            problems.append(
                f"its scheduling policy is {scheduler.get('policy')!r}, so it refuses the"
                " priorities of critical groups: start it with --scheduling-policy priority,"
                " or set rollout.priorities=fifo"
            )
        if int(served.get("max_model_len") or 0) < max_context:
            problems.append(
                f"it serves at most {served.get('max_model_len')} tokens, fewer than"
                f" rollout.max_context={max_context}: start it with --max-model-len {max_context}"
                " or lower rollout.max_context"
            )
        if problems:
            raise RemoteEngineError(f"vLLM at {self.url}: " + "; ".join(problems))

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta, version: int
    ) -> GenerationOutput:
        d = await self.server.call("/v1/completions", completion_request(
            prompt_ids, params, meta, self.stop_token_ids(params), version
        ))  # fmt: skip
        try:
            return completion_output(d, prompt_ids, params, version)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise self.malformed("/v1/completions", e) from None

    async def _load(self, path: Path, version: int) -> None:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        await self.server.call("/collective_rpc", rpc)
        # Only for people reading the server (`GET /weight_info`); our tokens carry the version,
        # so a failure here must not stop the run with the weights loaded and the gate behind.
        try:
            await self.server.call("/update_weight_version", {"new_version": str(version)})
        except RemoteEngineError as e:
            log.warning("vLLM at %s: weights loaded, labelling them failed: %s", self.url, e)


def completion_request(
    prompt_ids: list[int],
    params: SamplingParams,
    meta: TurnMeta,
    stop_token_ids: list[int],
    version: int,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt_ids,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0 is off in vLLM too
        "stop": list(params.stop),
        "stop_token_ids": stop_token_ids,
        "ignore_eos": params.ignore_eos,
        "include_stop_str_in_output": True,
        "logprobs": params.top_logprobs,  # 0: the sampled token's only
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,  # top logprobs keyed "token_id:N", not by text
        "cache_salt": f"venusrl-weights-v{version}",
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if meta.priority:  # a nonzero priority is an error on a server without priority scheduling
        body["priority"] = -meta.priority
    return body


def completion_output(
    d: dict[str, Any], prompt_ids: list[int], params: SamplingParams, version: int
) -> GenerationOutput:
    choice = d["choices"][0]
    token_ids = [int(t) for t in choice["token_ids"]]
    logprobs = choice["logprobs"]
    sampled = [float(x) for x in logprobs["token_logprobs"]]
    if len(sampled) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but {len(sampled)} logprobs")
    top: list[TopLogprobs] = []
    if params.top_logprobs:  # vLLM adds the sampled token to each position's top
        for position in logprobs["top_logprobs"]:
            pairs = [(int(k.removeprefix("token_id:")), float(v)) for k, v in position.items()]
            top.append(sorted(pairs, key=lambda p: -p[1])[: params.top_logprobs])
    details = (d.get("usage") or {}).get("prompt_tokens_details") or {}
    return GenerationOutput(
        str(d["id"]),
        list(prompt_ids),
        token_ids,
        sampled,
        [version] * len(token_ids),
        str(choice["finish_reason"]),
        int(details.get("cached_tokens") or 0),
        top,
    )
