"""The kinds of reward (`reward.kind`), and the pool a run scores with (`reward.placement`)."""

from __future__ import annotations

from venusrl.envs.environment import Environment, checked_reward, environment_call
from venusrl.rewards.config import RewardConfig
from venusrl.rewards.judge import JudgeReward
from venusrl.rewards.pool import RewardJob, RewardPool, Scorer
from venusrl.rewards.remote import RemoteReward


class EnvironmentReward:
    """The environment's own `reward`: the swe environment's grading runs the task's tests in a
    fresh sandbox of its image, so with the pool's workers bounded, so are graders' sandboxes
    (and the episode's own has closed by then: `Environment.reward_reads_sandbox`)."""

    def reads_sandbox(self, env: type[Environment]) -> bool:
        return env.reward_reads_sandbox

    async def score(self, job: RewardJob) -> float:
        env = job.env
        if env.reward_reads_sandbox:
            if job.episode is None:
                raise ValueError(f"{env.name}'s reward reads its episode, which is not here")
            verb, call = "reward", job.episode.reward()
        else:
            if job.open_sandbox is None:
                raise ValueError(f"{env.name} grades in fresh sandboxes; no pool opens them here")
            verb, call = "grade", env.grade(job.task, job.trajectory.output, job.open_sandbox)
        reward = await environment_call(env, verb, call, job.where)
        return checked_reward(env, reward, job.where)

    async def close(self) -> None:
        pass


def scorer(config: RewardConfig) -> Scorer:
    if config.kind == "remote":
        return RemoteReward(config.service)
    if config.kind == "judge":
        return JudgeReward(config.service, config.judge)
    return EnvironmentReward()


def reward_pool(config: RewardConfig, timeout_s: float) -> RewardPool:
    """The run's reward workers; `timeout_s`: one scoring's limit (`rollout.reward_timeout_s`)."""
    workers = config.workers if config.placement == "pool" else None
    return RewardPool(scorer(config), workers, timeout_s, config.retries)
