"""Reward workers: finished trajectories scored apart from their rollout, in the ranking's order.

A trajectory whose turns are over gives its engine's KV and its place in the KV window up, and
waits here for one of `workers` places; the most critical group's trajectories are scored first
(a group whose members are all being graded completes the next batch soonest, and the ranking
says so: `policy.critical_groups`). A scoring that fails for the platform (it timed out, a reward
service erred or answered no reward: `RewardUnavailable`) is tried again `retries` times, then
fails the trajectory (`RewardFailed`, `FailureKind.REWARD`) for the coordinator to replace or
mask: never a 0. An environment's own bug (`EnvironmentFailed`) and a sandbox that died
(`InfraFailure`) go through at once: trying again cannot mend them.

Inline (`workers` None) is the same scoring in the episode itself, every one at once, holding its
places until its reward is in: what RL frameworks do, kept as the benchmark's baseline.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from venusrl.envs.environment import Environment, OpenSandbox, Task
from venusrl.types import Trajectory

# How a waiting trajectory ranks for a place, lowest first: its group's priority (negated) and
# the group's place in the ranking, read when a place frees (the ranking moves while it waits).
Rank = Callable[[], tuple[int, int]]


@dataclass(frozen=True)
class RewardJob:
    """One finished trajectory to score: its environment's class, its task, its record and the
    model's turns as text. An environment's reward that reads the episode's sandbox gets the
    episode (`episode`, its sandbox still open); one graded from the output alone gets fresh
    sandboxes of the task's template (`open_sandbox`, `Environment.grade`). All but those two
    travel to a reward worker on another node."""

    env: type[Environment]
    task: Task
    trajectory: Trajectory
    turns: tuple[str, ...]
    episode: Environment | None = None
    open_sandbox: OpenSandbox | None = None

    @classmethod
    def of(
        cls,
        episode: Environment,
        trajectory: Trajectory,
        decode: Callable[[Sequence[int]], str],
        open_sandbox: OpenSandbox | None = None,
    ) -> RewardJob:
        """The job of `episode`'s finished `trajectory` (`decode`: token ids to text); the
        episode goes with it only where its reward reads its sandbox."""
        t = trajectory
        turns = tuple(decode(t.token_ids[start:end]) for start, end, _ in t.turn_spans())
        env = type(episode)
        kept = episode if env.reward_reads_sandbox else None
        return cls(env, episode.task, trajectory, turns, kept, open_sandbox)

    @property
    def where(self) -> str:
        """What an error says the reward was for."""
        return f" (task {self.task.id}, trajectory {self.trajectory.trajectory_id})"


class Scorer(Protocol):
    """A kind of reward (`reward.kind`)."""

    def reads_sandbox(self, env: type[Environment]) -> bool:
        """Whether scoring an episode of `env` reads its sandbox (else it closes as the turns
        end)."""
        ...

    async def score(self, job: RewardJob) -> float:
        """The trajectory's reward; `RewardUnavailable` when the platform failed to give it."""
        ...

    async def close(self) -> None: ...


class RewardUnavailable(Exception):
    """Scoring failed for the platform, not for the trajectory: trying again may give it."""


class RewardFailed(Exception):
    """Scoring failed for the platform past its retries: the trajectory is replaced or masked."""


class Rewards(Protocol):
    """What the rollout scores its finished trajectories with: a `RewardPool` here, or the run's
    reward worker on Ray (`runtime.cluster.reward_worker`)."""

    @property
    def inline(self) -> bool:
        """Scored in the episode, holding its places (`reward.placement=inline`)."""
        ...

    def reads_sandbox(self, env: type[Environment]) -> bool: ...

    async def score(self, job: RewardJob, rank: Rank = ...) -> float: ...

    def counters(self) -> dict[str, int]: ...

    async def close(self) -> None: ...


@dataclass
class _Waiting:
    rank: Rank
    seq: int
    granted: asyncio.Future[None]


class RewardPool:
    def __init__(
        self,
        scorer: Scorer,
        workers: int | None,
        timeout_s: float,
        retries: int = 1,
        backoff_s: float = 0.5,
    ) -> None:
        """`scorer` run `workers` at a time (None: inline, all at once), each scoring within
        `timeout_s` and tried `retries` more times after a platform failure, `backoff_s`
        doubling between tries."""
        if workers is not None and workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.scorer, self.workers, self.timeout_s = scorer, workers, timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self.busy = 0  # scoring now
        self.scored = self.failed = self.retried = 0
        self._waiting: list[_Waiting] = []
        self._seq = itertools.count()

    @property
    def inline(self) -> bool:
        return self.workers is None

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def reads_sandbox(self, env: type[Environment]) -> bool:
        return self.scorer.reads_sandbox(env)

    async def score(self, job: RewardJob, rank: Rank = lambda: (0, 0)) -> float:
        """`job`'s reward, once a worker is free for it (`rank` orders the waiting)."""
        await self._place(rank)
        try:
            return await self._tries(job)
        finally:
            self.busy -= 1
            self._grant()

    def counters(self) -> dict[str, int]:
        """For the step line: the pool as the step ends, and its counts so far."""
        return {
            "reward_queue": self.queued,
            "reward_workers_busy": self.busy,
            "rewards_scored": self.scored,
            "reward_retries": self.retried,
            "rewards_failed": self.failed,
        }

    async def close(self) -> None:
        await self.scorer.close()

    async def _tries(self, job: RewardJob) -> float:
        error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.timeout_s):
                    reward = await self.scorer.score(job)
                self.scored += 1
                return reward
            except TimeoutError as e:
                if time.monotonic() - started < self.timeout_s:  # the scorer's own timeout
                    error = RewardUnavailable(f"{type(e).__name__}: {e}")
                else:
                    error = RewardUnavailable(
                        f"took longer than rollout.reward_timeout_s={self.timeout_s:g} s"
                    )
            except RewardUnavailable as e:
                error = e
        self.failed += 1
        tries = self.retries + 1
        raise RewardFailed(
            f"{job.env.name}'s reward{job.where} failed {tries} time{'s' * (tries > 1)}: {error}"
        )

    async def _place(self, rank: Rank) -> None:
        limit = math.inf if self.workers is None else self.workers
        if self.busy < limit and not self._waiting:
            self.busy += 1
            return
        waiting = _Waiting(rank, next(self._seq), asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        try:
            await waiting.granted
        except asyncio.CancelledError:
            if waiting.granted.done() and not waiting.granted.cancelled():
                self.busy -= 1  # granted as it was cancelled: the place goes to the next
            elif waiting in self._waiting:
                self._waiting.remove(waiting)
            self._grant()
            raise

    def _grant(self) -> None:
        limit = math.inf if self.workers is None else self.workers
        while self.busy < limit and self._waiting:
            best = min(self._waiting, key=lambda w: (*w.rank(), w.seq))
            self._waiting.remove(best)
            if best.granted.done():  # cancelled, its task not yet woken: no place for it
                continue
            self.busy += 1
            best.granted.set_result(None)
