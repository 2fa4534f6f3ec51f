"""Records that cross roles: a trajectory is a token record (DESIGN.md contract 4).

Token ids of the whole episode in order (prompt, then each model turn and each observation), a
mask of which tokens the model produced (only those are trained), the behaviour logprob and weight
version of every model token, where each model turn starts, the reward and the failure class.
Nothing is ever re-tokenised: the trainer sees exactly the tokens the engine saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True)
class TurnTimes:
    """When one turn happened (`time.monotonic()` seconds): the request went to the engine, its
    tokens came back, the environment finished acting on them (tool calls included)."""

    requested: float
    generated: float
    acted: float


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
        self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
    ) -> None:
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError("a model turn needs one logprob and one version per token")
        self.turn_starts.append(len(self.token_ids))
        self.token_ids += token_ids
        self.mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.versions += versions

    def add_observation(self, token_ids: Sequence[int]) -> None:
        self.token_ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    def staleness(self, trainer_version: int) -> int:
        """How many versions behind the oldest model token is, when trained at this version."""
        produced = [v for v, m in zip(self.versions, self.mask, strict=True) if m]
        return trainer_version - min(produced) if produced else 0
