"""A remote reward service and a judge model over HTTP: the documented request, retries,
bounded in-flight requests, and an answer that is no reward never becomes one."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StandIn
from tests.rewards.test_reward_pool import job
from tests.server.process import serving
from venusrl.model.directory import init_model_dir
from venusrl.rewards.config import JudgeConfig, RewardConfig, ServiceConfig
from venusrl.rewards.judge import JudgeReward, judge_prompt
from venusrl.rewards.kinds import reward_pool
from venusrl.rewards.pool import RewardFailed, RewardUnavailable
from venusrl.rewards.remote import RemoteReward


def service(url: str, **overrides: Any) -> ServiceConfig:
    return ServiceConfig(url=url, backoff_s=0.01, breaker_cooldown_s=0.2, **overrides)


def test_a_remote_reward_service_gets_the_documented_request_and_its_reward_counts(
    stand_in: StandIn,
) -> None:
    stand_in.replies["/score"] = lambda body: (200, {"reward": 0.75})

    async def main() -> float:
        remote = RemoteReward(service(stand_in.url + "/score"))
        try:
            return await remote.score(job("g0-m1-a0", task="task-3"))
        finally:
            await remote.close()

    assert asyncio.run(main()) == 0.75
    ((path, body),) = stand_in.requests
    assert path == "/score"
    assert body == {
        "trajectory_id": "g0-m1-a0", "group_id": "g0", "task_id": "task-3",
        "environment": "scored", "prompt": "a prompt", "reference": {}, "turns": ["[3, 4]"],
        "output": None, "finish": None,
    }  # fmt: skip


def test_a_service_that_errs_is_asked_again_with_backoff_until_it_answers(
    stand_in: StandIn,
) -> None:
    answers = iter([(503, {"detail": "warming up"}), (429, {}), (200, {"reward": 1})])
    stand_in.replies["/"] = lambda body: next(answers)

    async def main() -> float:
        remote = RemoteReward(service(stand_in.url + "/"))
        try:
            return await remote.score(job("a"))
        finally:
            await remote.close()

    assert asyncio.run(main()) == 1.0
    assert len(stand_in.requests) == 3


@pytest.mark.parametrize(
    "answer", [{"score": 1}, {"reward": "high"}, {"reward": float("nan")}, [1.0], {"reward": True}]
)
def test_an_answer_without_a_finite_reward_is_no_reward(stand_in: StandIn, answer: Any) -> None:
    stand_in.replies["/"] = lambda body: (200, answer)

    async def main() -> None:
        remote = RemoteReward(service(stand_in.url + "/", retries=1))
        try:
            with pytest.raises(RewardUnavailable, match=r"2 tries failed.*not"):
                await remote.score(job("a"))
        finally:
            await remote.close()

    asyncio.run(main())


def test_a_refused_request_is_not_sent_again(stand_in: StandIn) -> None:
    stand_in.replies["/"] = lambda body: (422, {"detail": "missing field"})

    async def main() -> None:
        remote = RemoteReward(service(stand_in.url + "/"))
        try:
            with pytest.raises(RewardUnavailable, match="refused the request: HTTP 422"):
                await remote.score(job("a"))
        finally:
            await remote.close()

    asyncio.run(main())
    assert len(stand_in.requests) == 1


def test_requests_in_flight_are_bounded(stand_in: StandIn) -> None:
    lock, now, most = threading.Lock(), [0], [0]

    def slow(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1
        return 200, {"reward": 0.0}

    stand_in.replies["/"] = slow

    async def main() -> list[float]:
        remote = RemoteReward(service(stand_in.url + "/", max_in_flight=2))
        try:
            return await asyncio.gather(*(remote.score(job(f"t{i}")) for i in range(8)))
        finally:
            await remote.close()

    assert asyncio.run(main()) == [0.0] * 8
    assert most[0] == 2


def test_a_service_that_is_down_trips_the_breaker_and_its_trajectories_fail_not_score_zero(
    stand_in: StandIn,
) -> None:
    stand_in.replies["/"] = lambda body: (500, {"detail": "down"})
    down = service(stand_in.url + "/", retries=2, breaker_failures=3)
    config = RewardConfig(kind="remote", retries=0, workers=4, service=down)

    async def main() -> None:
        pool = reward_pool(config, timeout_s=5)
        try:
            for tid in ("a", "b"):
                with pytest.raises(RewardFailed, match=f"trajectory {tid}.*HTTP 500"):
                    await pool.score(job(tid))
            assert pool.failed == 2
            breaker = pool.scorer.service.breaker  # type: ignore[attr-defined]
            assert breaker.trips >= 1
        finally:
            await pool.close()

    started = time.monotonic()
    asyncio.run(main())
    # 6 requests would go without a breaker; with it the first 3 open it, and each later one
    # waits a cooldown (0.2 s, then 0.4 s) for its probe.
    assert len(stand_in.requests) == 6 and time.monotonic() - started > 0.5


def test_the_judge_reads_the_last_score_out_of_its_answer(stand_in: StandIn) -> None:
    said = iter(
        ["Score: 12", "Fine work. Score: 3. On reflection, Score: 8", "no score here", "nor here"]
    )
    stand_in.replies["/v1/chat/completions"] = lambda body: (
        200, {"choices": [{"message": {"role": "assistant", "content": next(said)}}]}
    )  # fmt: skip

    async def main() -> float:
        judge = JudgeReward(service(stand_in.url + "/v1", retries=1), JudgeConfig(model="j"))
        try:
            scored = await judge.score(job("a"))  # 12 is out of [0, 10]: asked again
            with pytest.raises(RewardUnavailable, match="no score matching"):
                await judge.score(job("b"))
            return scored
        finally:
            await judge.close()

    assert asyncio.run(main()) == 0.8
    path, body = stand_in.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "j" and body["temperature"] == 0
    assert "a prompt" in body["messages"][0]["content"]


def test_a_judge_prompt_fills_its_four_fields_and_leaves_other_braces() -> None:
    template = 'Task: {prompt}\nAnswer: {response}\nDiff: {output}\nRef: {reference}\n{"a": {x}}'
    assert judge_prompt(template, job("a")) == (
        'Task: a prompt\nAnswer: [3, 4]\nDiff: \nRef: {}\n{"a": {x}}'
    )


def test_a_remote_or_judge_reward_without_a_url_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"reward\.kind=judge needs reward\.service\.url"):
        RewardConfig(kind="judge")
    with pytest.raises(ValueError, match="not an http"):
        ServiceConfig(url="localhost:8000")
    with pytest.raises(ValueError, match="has no group"):
        JudgeConfig(score_pattern=r"Score: \d+")


def test_a_judge_on_venusrl_serve_that_writes_no_score_fails_its_rewards_never_zero(
    tmp_path: Path,
) -> None:
    """A real judge server (random weights: its answers hold no score) answers every request,
    four at once; each reward fails, to be replaced or masked."""
    model = init_model_dir(tmp_path / "judge", preset="tiny", seed=0)
    judge = JudgeConfig(model="judge", max_tokens=8)
    with serving(model) as url:
        service = ServiceConfig(url=url + "/v1", retries=0, max_in_flight=4)
        config = RewardConfig(kind="judge", workers=4, retries=0, service=service, judge=judge)

        async def main() -> list[Any]:
            pool = reward_pool(config, timeout_s=60)
            try:
                jobs = (pool.score(job(f"t{i}")) for i in range(4))
                return await asyncio.gather(*jobs, return_exceptions=True)
            finally:
                await pool.close()

        results = asyncio.run(main())
    assert all(isinstance(r, RewardFailed) for r in results), results
    assert all("no score matching" in str(r) for r in results)
