"""The reward workers: bounded, in the ranking's order, and a failure is never a 0."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from venusrl.envs.environment import Environment, EnvironmentFailed, Task
from venusrl.rewards.breaker import CircuitBreaker
from venusrl.rewards.kinds import EnvironmentReward
from venusrl.rewards.pool import RewardFailed, RewardJob, RewardPool, RewardUnavailable
from venusrl.types import Trajectory


class Scored(Environment):
    """An episode whose reward its test decides."""

    name = "scored"

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        yield Task("t0", "a prompt")

    async def reward(self) -> float:
        raise ZeroDivisionError("the author's bug")


def job(tid: str, task: str = "t0") -> RewardJob:
    traj = Trajectory.start(tid, "g0", task, [1, 2])
    traj.add_model_turn([3, 4], [0.0, 0.0], [0, 0])
    episode = Scored(Task(task, "a prompt"), None)  # type: ignore[arg-type]
    return RewardJob.of(episode, traj, str)


class Gate:
    """A scorer that holds each reward until the test lets it go, and records the order."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.running = self.most = 0
        self.go = asyncio.Event()

    async def score(self, j: RewardJob) -> float:
        self.started.append(j.trajectory.trajectory_id)
        self.running += 1
        self.most = max(self.most, self.running)
        await self.go.wait()
        self.running -= 1
        return 1.0

    def reads_sandbox(self, env: type[Environment]) -> bool:
        return False

    async def close(self) -> None:
        pass


def test_rewards_run_at_most_workers_at_once_the_most_critical_groups_first() -> None:
    async def main() -> list[str]:
        gate = Gate()
        pool = RewardPool(gate, workers=2, timeout_s=5)
        first = [asyncio.create_task(pool.score(job(f"early{i}"))) for i in range(2)]
        await asyncio.sleep(0.01)
        # Queued behind the first two: a best-effort group's, then a critical group ranked
        # second, then one ranked first. They start in rank order, not arrival order.
        ranks = {"best-effort": (0, 0), "critical-2nd": (-1, 1), "critical-1st": (-1, 0)}
        later = [asyncio.create_task(pool.score(job(t), lambda r=r: r)) for t, r in ranks.items()]
        await asyncio.sleep(0.01)
        assert (pool.busy, pool.queued) == (2, 3)
        gate.go.set()
        assert await asyncio.gather(*first, *later) == [1.0] * 5
        assert gate.most == 2
        assert pool.counters()["rewards_scored"] == 5
        return gate.started

    assert asyncio.run(main())[2:] == ["critical-1st", "critical-2nd", "best-effort"]


def test_inline_rewards_all_run_at_once() -> None:
    async def main() -> int:
        gate = Gate()
        pool = RewardPool(gate, workers=None, timeout_s=5)
        tasks = [asyncio.create_task(pool.score(job(f"t{i}"))) for i in range(6)]
        await asyncio.sleep(0.01)
        gate.go.set()
        await asyncio.gather(*tasks)
        return gate.most

    assert asyncio.run(main()) == 6


def test_a_reward_that_times_out_is_tried_again_then_fails_the_trajectory_not_with_a_zero() -> None:
    class Hangs(Gate):
        async def score(self, j: RewardJob) -> float:
            self.started.append(j.trajectory.trajectory_id)
            await asyncio.sleep(10)
            return 0.0

    async def main() -> RewardPool:
        pool = RewardPool(Hangs(), workers=1, timeout_s=0.05, retries=1, backoff_s=0.01)
        with pytest.raises(RewardFailed, match=r"trajectory a.*failed 2 times.*reward_timeout_s"):
            await pool.score(job("a"))
        return pool

    pool = asyncio.run(main())
    assert pool.counters() == {"reward_queue": 0, "reward_workers_busy": 0, "rewards_scored": 0,
                               "reward_retries": 1, "rewards_failed": 1}  # fmt: skip


def test_a_reward_unavailable_once_is_scored_on_the_retry() -> None:
    class Flaky(Gate):
        async def score(self, j: RewardJob) -> float:
            self.started.append(j.trajectory.trajectory_id)
            if len(self.started) == 1:
                raise RewardUnavailable("the service restarted")
            return 0.5

    async def main() -> float:
        return await RewardPool(Flaky(), workers=1, timeout_s=1, backoff_s=0.01).score(job("a"))

    assert asyncio.run(main()) == 0.5


def test_an_environment_reward_that_raises_names_the_environment_task_and_trajectory() -> None:
    async def main() -> None:
        pool = RewardPool(EnvironmentReward(), workers=1, timeout_s=1, retries=3)
        with pytest.raises(EnvironmentFailed) as raised:
            await pool.score(job("g0-m3-a0", task="task-17"))
        message = str(raised.value)
        assert "scored.reward" in message and "task-17" in message and "g0-m3-a0" in message
        assert pool.retried == 0  # an author's bug is not tried again

    asyncio.run(main())


def test_a_cancelled_wait_gives_its_place_to_the_next() -> None:
    async def main() -> list[str]:
        gate = Gate()
        pool = RewardPool(gate, workers=1, timeout_s=5)
        running = asyncio.create_task(pool.score(job("running")))
        await asyncio.sleep(0.01)
        gone = asyncio.create_task(pool.score(job("gone")))  # its group timed out
        after = asyncio.create_task(pool.score(job("after")))
        await asyncio.sleep(0.01)
        gone.cancel()
        gate.go.set()
        await asyncio.gather(running, after)
        assert (pool.busy, pool.queued) == (0, 0)
        return gate.started

    assert asyncio.run(main()) == ["running", "after"]


def test_the_breaker_opens_after_failures_in_a_row_and_one_probe_decides() -> None:
    b = CircuitBreaker(failures=3, cooldown_s=10)
    for now in (0, 1):
        b.failed(now)
        assert b.wait_s(now) == 0
    b.failed(2)
    assert b.wait_s(5) == 7  # open: nothing goes until the cooldown is over
    assert b.wait_s(12) == 0  # the probe goes
    assert b.wait_s(12) > 0  # the others wait for its answer
    b.failed(13)  # the probe failed: open again, for twice as long
    assert b.wait_s(20) == 13
    assert b.wait_s(33) == 0
    b.succeeded()
    assert b.wait_s(33) == 0 and b.wait_s(33) == 0 and b.trips == 2


def test_a_wait_cancelled_while_another_reward_ends_leaks_no_place() -> None:
    async def main() -> tuple[int, int, list[str]]:
        gate = Gate()
        pool = RewardPool(gate, workers=1, timeout_s=5)
        running = asyncio.create_task(pool.score(job("running")))
        await asyncio.sleep(0.01)
        gone = asyncio.create_task(pool.score(job("gone")))
        after = asyncio.create_task(pool.score(job("after")))
        await asyncio.sleep(0.01)
        gate.go.set()  # the running reward ends and hands its place on...
        gone.cancel()  # ...to a wait whose future is cancelled, its task not yet woken
        await asyncio.gather(running, after)
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        return pool.busy, pool.queued, gate.started

    assert asyncio.run(main()) == (0, 0, ["running", "after"])


def test_a_probe_that_gets_no_answer_lets_the_next_caller_probe() -> None:
    b = CircuitBreaker(failures=1, cooldown_s=1)
    b.failed(0)
    assert b.wait_s(1) == 0  # the probe goes, and is cancelled on its way
    b.abandoned()
    assert b.wait_s(1) == 0  # not stuck half open: another probe goes
