"""A remote reward service: each finished trajectory POSTed to it, its reward in the answer.

The request (JSON, docs/rewards.md): `trajectory_id`, `group_id`, `task_id`, `environment`,
`prompt` (the task's), `reference` (its ground truth, never shown to the model), `turns` (the
model's turns as text), `output` (what the episode produced: a diff) and `finish`. The answer:
`{"reward": <a finite number>}`; anything else is no answer, sent again (`http.ServiceClient`).
"""

from __future__ import annotations

import math
from typing import Any

from venusrl.envs.environment import Environment
from venusrl.rewards.config import ServiceConfig
from venusrl.rewards.http import ServiceClient
from venusrl.rewards.pool import RewardJob


def request(job: RewardJob) -> dict[str, Any]:
    t = job.trajectory
    return {
        "trajectory_id": t.trajectory_id,
        "group_id": t.group_id,
        "task_id": job.task.id,
        "environment": job.env.name,
        "prompt": job.task.prompt,
        "reference": dict(job.task.reference),
        "turns": list(job.turns),
        "output": t.output,
        "finish": None if t.finish is None else str(t.finish),
    }


def reward_of(answer: Any) -> float:
    """The reward in a service's answer; ValueError when there is none."""
    if not isinstance(answer, dict) or "reward" not in answer:
        raise ValueError('the answer is not an object with a "reward"')
    reward = answer["reward"]
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"reward {reward!r} is not a finite number")
    return float(reward)


class RemoteReward:
    def __init__(self, config: ServiceConfig) -> None:
        self.service = ServiceClient(config)

    def reads_sandbox(self, env: type[Environment]) -> bool:
        return False  # it reads the record alone

    async def score(self, job: RewardJob) -> float:
        return await self.service.post("", request(job), reward_of)

    async def close(self) -> None:
        await self.service.close()
