"""A generation request: what was asked, what was produced, and where its KV lives."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from venusrl.engine.radix_tree import RadixNode


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` is greedy.

    Logprobs are those of the sampled token under softmax(logits / temperature) (raw logits when
    greedy), before top-k/top-p truncation: the behaviour policy a trainer corrects against.
    `top_logprobs > 0` also returns that many most likely tokens of the same distribution at each
    position (OpenAI's `logprobs`/`top_logprobs`, at most `MAX_TOP_LOGPROBS`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        problems = _type_problems(self)
        if problems:  # comparing values of the wrong type would only raise confusing errors
            raise ValueError("; ".join(problems))
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            problems.append(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            problems.append(f"seed must be in [0, 2**63), got {self.seed}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        # Below ~1e-5, logits / temperature overflows fp32; such temperatures mean greedy.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; clients ask within it

# A position's most likely tokens as (token id, logprob), most likely first.
TopLogprobs = list[tuple[int, float]]


def _type_problems(p: SamplingParams) -> list[str]:
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    problems = []
    for name in ("max_tokens", "top_k", "top_logprobs"):
        if not is_int(getattr(p, name)):
            problems.append(f"{name} must be an integer, got {getattr(p, name)!r}")
    for name in ("temperature", "top_p"):
        value = getattr(p, name)
        if not (isinstance(value, int | float) and not isinstance(value, bool)):
            problems.append(f"{name} must be a number, got {value!r}")
    if p.seed is not None and not is_int(p.seed):
        problems.append(f"seed must be an integer, got {p.seed!r}")
    if not isinstance(p.ignore_eos, bool):
        problems.append(f"ignore_eos must be true or false, got {p.ignore_eos!r}")
    if not isinstance(p.stop, tuple) or not all(isinstance(s, str) for s in p.stop):
        problems.append(f"stop must be a tuple of strings, got {p.stop!r}")
    if not isinstance(p.stop_token_ids, tuple) or not all(is_int(t) for t in p.stop_token_ids):
        problems.append(f"stop_token_ids must be a tuple of integers, got {p.stop_token_ids!r}")
    return problems


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


@dataclass(frozen=True)
class GenerationOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str
    cached_prompt_tokens: int
    # One per token when params.top_logprobs > 0; empty otherwise.
    top_logprobs: list[TopLogprobs] = field(default_factory=list)

    @classmethod
    def of(cls, r: Request) -> GenerationOutput:
        assert r.finish_reason is not None
        return cls(
            r.request_id,
            list(r.prompt_ids),
            list(r.output_ids),
            list(r.output_logprobs),
            list(r.output_versions),
            r.finish_reason,
            r.cached_prompt_tokens,
            list(r.output_top_logprobs),
        )
