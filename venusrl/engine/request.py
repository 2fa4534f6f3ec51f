"""A generation request: what was asked, what was produced, and where its KV lives."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from venusrl.engine.radix_tree import RadixNode
from venusrl.types import GenerationOutput, SamplingParams, TopLogprobs


@dataclass
class Banded:
    """A request whose completed pages keep one layer band on device (`policy.layer_residency`):
    `pages[first : first + len(host)]` are band pages holding `layers` of them, and `host` a
    whole copy of each, from which attention reads the other layers."""

    bands: int
    band: int
    layers: range
    first: int
    host: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        """Index in `pages` after the last band page."""
        return self.first + len(self.host)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # higher runs first
    arrival: int = 0  # order of arrival, the FIFO tie-break
    trajectory_id: str | None = None
    group_id: str | None = None
    namespace: object = None  # radix-cache namespace, fixed at submission
    expected_wait_s: float | None = None  # the tool wait after it (KV retention pin)

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    # One per output token when params.top_logprobs > 0; empty otherwise.
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache on admission
    admissions: int = 0  # > 1 after a preemption
    # Tokens of its prefix the engine had computed before (an earlier turn of its trajectory,
    # or itself before a preemption): what it finds cached short of that is a re-prefill.
    expected_cached: int = 0
    arrived_at: float = 0.0  # the engine's clock
    after_tool: bool = False  # a later request of a trajectory the engine remembers

    # KV state. pages[:num_shared_pages] are borrowed from the radix tree and protected by a
    # lock on `tree_node`; the rest are owned by this request.
    pages: list[int] = field(default_factory=list)
    num_shared_pages: int = 0
    tree_node: RadixNode | None = None
    num_computed: int = 0  # tokens of all_ids whose KV sits in pages
    banded: Banded | None = None  # set while only a layer band of its pages is on device
    sampling_seed: int | None = None  # the sampler's stream (`sampler.uniforms`); None: greedy

    all_ids: list[int] = field(init=False, default_factory=list)  # prompt + output

    def __post_init__(self) -> None:
        self.all_ids = self.prompt_ids + self.output_ids

    def append_token(
        self, token: int, logprob: float, version: int, top: TopLogprobs | None = None
    ) -> None:
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        if top is not None:
            self.output_top_logprobs.append(top)
        self.all_ids.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def output(self) -> GenerationOutput:
        assert self.finish_reason is not None
        return GenerationOutput(
            self.request_id,
            list(self.prompt_ids),
            list(self.output_ids),
            list(self.output_logprobs),
            list(self.output_versions),
            self.finish_reason,
            self.cached_prompt_tokens,
            list(self.output_top_logprobs),
        )
