"""What crosses roles (DESIGN.md contracts): a turn's request to an engine and what it returns,
and the trajectory, a token record. A leaf: it imports nothing of the package.

A trajectory holds the token ids of the whole episode in order (prompt, then each model turn and
each observation), a mask of which tokens the model produced (only those are trained), the
behaviour logprob and weight version of every model token, where each model turn starts, the
reward and, for an episode the platform failed, what failed. Nothing is ever re-tokenised: the
trainer sees exactly the tokens the engine saw.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, NamedTuple, Protocol


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


# How an engine takes new weights (`engine.weight_update`): keep, flush or drain.
WeightUpdate = Literal["keep", "flush", "drain"]

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


@dataclass(frozen=True)
class TurnMeta:
    """What a generation request says about the turn it belongs to, beyond its tokens: the
    engine schedules, caches and keeps KV by it."""

    priority: int = 0  # higher runs first (`policy.critical_groups`: HIGH or BEST_EFFORT)
    trajectory_id: str | None = None  # its turns share KV; `end_trajectory` lets it go
    group_id: str | None = None  # GRPO siblings share their prompt's KV
    # After this turn the trajectory waits on a tool, expected back within this many seconds:
    # its KV is pinned until then (engine.retention=trajectory).
    expected_wait_s: float | None = None


class Generate(Protocol):
    """One turn of generation: an in-process engine (`AsyncEngine.generate`), a served one
    (`RemoteEngine.generate`), or anything that answers as they do (scripted demonstrations)."""

    async def __call__(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
    ) -> GenerationOutput: ...


@dataclass(frozen=True)
class TurnTimes:
    """When one turn happened (`time.monotonic()` seconds): the request went to the engine, its
    tokens came back, the environment finished acting on them (tool calls included)."""

    requested: float
    generated: float
    acted: float


class Progress(NamedTuple):
    """A member's episode so far, as the coordinator ranks its group (`GroupBook.progress`):
    reported after each model turn and after each tool call that another turn follows.
    Absolute, not a change: a report relayed late or twice (from a rollout worker) is harmless."""

    tokens: int  # the model's, so far
    turns: int  # model turns taken
    tool_calls: int  # of them, those whose tool call has returned
    tool_s: float  # the seconds those calls took
    grading: bool = False  # its turns are over and its reward is being scored

    @property
    def in_tool(self) -> bool:
        """Its latest turn's tool call is under way (or its reward, after the last turn)."""
        return self.tool_calls < self.turns or self.grading


class FailureKind(StrEnum):
    """What failed an episode that ended `Finish.INFRA`: never the policy, so the episode is
    replaced or masked, not scored. What the coordinator does next depends on it (a preempted
    episode goes on from its record; an environment's own bug is counted apart)."""

    SANDBOX = "sandbox"  # it could not start, crashed, expired or stopped answering
    PREEMPTED = "preempted"  # its pool took it back (memory ran high); the record so far is sound
    REPLAY_DIVERGED = "replay_diverged"  # acting again on the record gave other observations
    ENGINE = "engine"  # a generation call failed
    ENVIRONMENT = "environment"  # the environment's own code raised: its author's bug
    TIMEOUT = "timeout"  # an environment step or the reward took longer than its limit
    WORKER = "worker"  # the rollout worker that held it failed or died
    REWARD = "reward"  # scoring it failed: a reward service that timed out, erred or answered
    # something that is not a reward, past its retries


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str  # what went wrong, for people

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class Finish(StrEnum):
    DONE = "done"  # the episode ended (the model answered or the task is solved)
    TURN_CAP = "turn_cap"  # the environment's turn limit
    CONTEXT_CAP = "context_cap"  # no room left in the context window
    TIME_CAP = "time_cap"  # the episode's wall-clock limit (`rollout.episode_timeout_s`)
    TOKEN_CAP = "token_cap"  # the model's tokens for the episode (`rollout.max_episode_tokens`)
    INFRA = (
        "infra"  # the platform failed (sandbox, engine, service timeout): not the policy's fault
    )


@dataclass
class Trajectory:
    trajectory_id: str
    group_id: str
    prompt_id: str
    token_ids: list[int]
    mask: list[int]  # 1: produced by the model (trained); 0: prompt or observation
    logprobs: list[float]  # behaviour logprob for model tokens, 0.0 elsewhere
    versions: list[int]  # weight version for model tokens, -1 elsewhere
    turn_starts: list[int] = field(default_factory=list)
    tool_calls: int = 0
    reward: float | None = None
    finish: Finish | None = None
    failure: Failure | None = None  # what went wrong, for INFRA
    turn_times: list[TurnTimes] = field(default_factory=list)  # one per turn the environment ran
    cut_turns: list[int] = field(default_factory=list)  # turns the engine stopped at max_tokens
    output: str | None = None  # what the episode produced beyond its transcript (a diff)
    reward_s: float | None = None  # from the end of its turns to its reward: queue and scoring
    # sum(mask), kept as turns are added: asked for at every turn (budgets, progress reports),
    # where a sum over a long record would cost a pass over its whole context each time.
    _model_tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._model_tokens = sum(self.mask)

    @classmethod
    def start(
        cls, trajectory_id: str, group_id: str, prompt_id: str, prompt_ids: Sequence[int]
    ) -> Trajectory:
        n = len(prompt_ids)
        return cls(
            trajectory_id, group_id, prompt_id, list(prompt_ids), [0] * n, [0.0] * n, [-1] * n
        )

    def fail(self, kind: FailureKind, message: str) -> None:
        """End it as an infrastructure failure: no reward, for the coordinator to replace or
        mask."""
        self.finish, self.failure, self.reward = Finish.INFRA, Failure(kind, message), None

    def failed_with(self, kind: FailureKind) -> bool:
        return self.failure is not None and self.failure.kind is kind

    @property
    def prompt_len(self) -> int:
        return self.turn_starts[0] if self.turn_starts else len(self.token_ids)

    def add_model_turn(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        cut: bool = False,
    ) -> None:
        """The model's tokens of one turn; `cut`: the engine stopped them at the turn's
        max_tokens (finish reason "length")."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError("a model turn needs one logprob and one version per token")
        if cut:
            self.cut_turns.append(len(self.turn_starts))
        self.turn_starts.append(len(self.token_ids))
        self.token_ids += token_ids
        self.mask += [1] * len(token_ids)
        self._model_tokens += len(token_ids)
        self.logprobs += logprobs
        self.versions += versions

    def add_observation(self, token_ids: Sequence[int]) -> None:
        self.token_ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    @property
    def model_tokens(self) -> int:
        return self._model_tokens

    def turn_spans(self) -> list[tuple[int, int, int]]:
        """Each turn's (start, end of the model's tokens, end): the model's tokens, then the
        observation that followed them (none after the last)."""
        bounds = [*self.turn_starts, len(self.token_ids)]
        return [
            (start, start + [*self.mask[start:end], 0].index(0), end)
            for start, end in itertools.pairwise(bounds)
        ]

    def progress(self) -> Progress:
        """How far the episode is: what the environment acted on counts as a returned call."""
        tool_s = sum(t.acted - t.generated for t in self.turn_times)
        return Progress(self.model_tokens, len(self.turn_starts), len(self.turn_times), tool_s)

    def staleness(self, trainer_version: int) -> int:
        """How many versions behind the oldest model token is, when trained at this version."""
        produced = [v for v, m in zip(self.versions, self.mask, strict=True) if m]
        return trainer_version - min(produced) if produced else 0
