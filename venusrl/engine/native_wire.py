"""The native API's messages, both ways, as one set of types: the server (`server/native_routes.py`)
validates requests and answers with them, and the client (`remote.py`) builds its requests and
reads the replies with the same ones, so the two sides cannot drift apart.

The API has no clients to tolerate: a misspelt key is an error, not a default, and JSON types are
taken as they are ("5" is not a number, true is not 1).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict

from venusrl.types import MAX_TOP_LOGPROBS, GenerationOutput, SamplingParams, TurnMeta

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


class NativeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GenerateSampling(NativeBody):
    max_tokens: Int = Field(16, ge=1)
    temperature: Float = Field(1.0, ge=0, le=100)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)
    seed: Int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[Int] = Field(default_factory=list)
    ignore_eos: Bool = False
    top_logprobs: Int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)

    @classmethod
    def of(cls, params: SamplingParams) -> GenerateSampling:
        return cls(**{**vars(params), "stop": list(params.stop),
                      "stop_token_ids": list(params.stop_token_ids)})  # fmt: skip

    def params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            **{
                **self.model_dump(),
                "stop": tuple(stop),
                "stop_token_ids": tuple(self.stop_token_ids),
            }
        )


class GenerateBody(NativeBody):
    input_ids: list[Int] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    request_id: str | None = None
    trajectory_id: str | None = None
    group_id: str | None = None
    priority: Int = 0
    expected_wait_s: Float | None = Field(None, ge=0)  # the tool wait after this turn

    @classmethod
    def of(
        cls, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta, request_id: str | None
    ) -> GenerateBody:
        sampling = GenerateSampling.of(params)
        return cls(
            input_ids=prompt_ids, sampling_params=sampling, request_id=request_id, **vars(meta)
        )

    def meta(self) -> TurnMeta:
        return TurnMeta(self.priority, self.trajectory_id, self.group_id, self.expected_wait_s)


class EndTrajectoryBody(NativeBody):
    trajectory_id: str


class UpdateWeightsBody(NativeBody):
    path: str = Field(min_length=1)
    version: Int | None = Field(None, ge=0)
    flush_cache: Bool = False


# --- replies ------------------------------------------------------------------------------------


class Health(NativeBody):
    status: str
    weight_version: Int
    running: Int  # requests in the engine's batch
    waiting: Int
    free_device_kv_pages: Int
    free_host_kv_pages: Int
    device_kv_tokens: Int  # what its device KV holds in all (the KV window's capacity)


class GenerateReply(NativeBody):
    request_id: str
    token_ids: list[Int]
    logprobs: list[Float]
    weight_versions: list[Int]  # the version that sampled each token
    top_logprobs: list[list[tuple[Int, Float]]] = Field(default_factory=list)
    finish_reason: str
    prompt_tokens: Int
    cached_tokens: Int = 0  # prompt tokens served from the prefix cache

    @classmethod
    def of(cls, out: GenerationOutput) -> GenerateReply:
        return cls(
            request_id=out.request_id,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            weight_versions=out.weight_versions,
            top_logprobs=out.top_logprobs,
            finish_reason=out.finish_reason,
            prompt_tokens=len(out.prompt_ids),
            cached_tokens=out.cached_prompt_tokens,
        )

    def output(self, prompt_ids: list[int]) -> GenerationOutput:
        return GenerationOutput(
            self.request_id,
            list(prompt_ids),
            self.token_ids,
            self.logprobs,
            self.weight_versions,
            self.finish_reason,
            self.cached_tokens,
            [list(top) for top in self.top_logprobs],
        )


class EndTrajectoryReply(NativeBody):
    trajectory_id: str


class UpdateWeightsReply(NativeBody):
    weight_version: Int
