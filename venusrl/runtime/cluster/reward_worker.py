"""The run's reward workers on Ray: one actor of their own, apart from the rollout workers.

Every rollout worker sends it the trajectories whose turns are over (`RemoteRewards`), and it
scores them `reward.workers` at a time, the most critical group's first (the driver pushes it the
coordinator's ranking, `RewardWorker.set_priorities`), as the pool does in one process
(`rewards.pool`): a reward service's or a judge's requests, and the environments graded from
their output alone (`Environment.grade`, the swe environment's tests) in fresh sandboxes of its
own pool, on its own node. It asks Ray for no CPU (it waits on services and sandboxes; its
graders' memory is its pool's budget), and for `reward.ray_resource` where that is set, so that
it lands on the nodes that declare it (CPU-only nodes: `ray start --resources='{"reward": 1}'`).

An environment whose reward reads its episode's own sandbox is scored where that sandbox is: by
its rollout worker's own pool, with the same bound and retries.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray

from venusrl.config import Config
from venusrl.envs.environment import Environment, SandboxHandle, Task
from venusrl.envs.loading import environment_class
from venusrl.envs.pool import SandboxPool
from venusrl.envs.types import GiB
from venusrl.policy.critical_groups import reward_rank
from venusrl.rewards.kinds import reward_pool
from venusrl.rewards.pool import Rank, RewardFailed, RewardJob, RewardPool
from venusrl.runtime.cluster.ray_cluster import (
    ActorLost,
    at_default_priority,
    available_memory_bytes,
    call,
)
from venusrl.types import Trajectory

# Of the node's available memory, the share its graders' sandboxes may take at most.
GRADER_MEMORY_FRACTION = 0.25


def reward_actor(cfg: Config) -> Any:
    """The run's reward worker, started (Ray's handle: called through `ray_cluster.call`).
    A `reward.ray_resource` no node declares is refused at once: Ray would keep it pending."""
    rt, resource = cfg.runtime, cfg.reward.ray_resource
    if resource and resource not in ray.cluster_resources():
        raise ValueError(
            f"reward.ray_resource={resource!r}: no node of the cluster declares it (start the"
            f" reward worker's node with `ray start --resources='{{\"{resource}\": 1}}'`)"
        )
    return (
        ray.remote(RewardWorker)
        .options(
            name="rewards",
            namespace=rt.namespace,
            num_cpus=0,
            resources={resource: 1} if resource else None,
            max_restarts=rt.actor_restarts,
            max_task_retries=0,  # a scoring lost with it is tried again by its caller
        )
        .remote(cfg)
    )


class RewardWorker:
    """The reward workers (a Ray actor). Every method is a coroutine."""

    def __init__(self, cfg: Config) -> None:
        at_default_priority()
        self.cfg = cfg
        self.rewards = reward_pool(cfg.reward, cfg.rollout.reward_timeout_s)
        entries = cfg.rollout.mix or []
        names = [e.env for e in entries] or [cfg.rollout.env]
        self.envs: dict[str, type[Environment]] = {}
        for name in names:
            env = environment_class(name)
            self.envs[env.name] = env
        self.ranking: dict[str, int] = {}
        self.place: dict[str, int] = {}
        self._pool: SandboxPool | None = None
        self._starting = asyncio.Lock()

    async def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    async def score(
        self, env_name: str, task: Task, trajectory: Trajectory, turns: tuple[str, ...]
    ) -> float:
        """One finished trajectory's reward (`RewardFailed`, `EnvironmentFailed` as the pool's)."""
        env = self.envs.get(env_name)
        if env is None:
            raise ValueError(f"no environment {env_name!r} in this run's mix")

        async def open_sandbox() -> SandboxHandle:
            pool = await self._sandboxes()
            return await pool.create(env.template_for(task), setup=task.setup, files=task.files)

        job = RewardJob(env, task, trajectory, turns, open_sandbox=open_sandbox)
        group = trajectory.group_id
        rank: Rank = lambda: reward_rank(group, self.ranking, self.place)  # noqa: E731
        return await self.rewards.score(job, rank)

    async def set_priorities(self, priority: dict[str, int]) -> None:
        """The coordinator's ranking: every open group's priority, in its order."""
        self.ranking = priority
        self.place = {gid: i for i, gid in enumerate(priority)}

    async def counters(self) -> dict[str, int]:
        return self.rewards.counters()

    async def report(self) -> dict[str, Any]:
        """Where it runs, what it scored, and how many graders' sandboxes its pool made."""
        stats = self._pool.stats().as_dict() if self._pool is not None else {}
        return {
            "node": await self.node_id(),
            "pid": os.getpid(),
            "sandboxes_created": stats.get("sandboxes_created", 0),
            **self.rewards.counters(),
        }

    async def shutdown(self) -> None:
        await self.rewards.close()
        if self._pool is not None:
            await self._pool.close()

    async def _sandboxes(self) -> SandboxPool:
        """Its graders' pool, started by the first grading that needs a sandbox."""
        async with self._starting:
            if self._pool is None:
                budget = min(
                    int(self.cfg.sandbox.memory_budget_gib * GiB),
                    int(GRADER_MEMORY_FRACTION * available_memory_bytes()),
                )
                pool = SandboxPool.from_config(self.cfg.sandbox, budget)
                await pool.start()
                self._pool = pool
            return self._pool


class RemoteRewards:
    """A rollout worker's side of the reward worker (`rewards.pool.Rewards`): what reads its
    episode's sandbox is scored here, by `local`; the rest goes to the actor, and a scoring it
    lost (the actor died, Ray restarts it) is sent again `retries` times, then fails the
    trajectory as any platform failure of its reward does (`RewardFailed`: never a 0)."""

    inline = False

    def __init__(self, actor: Any, local: RewardPool, retries: int, backoff_s: float = 1.0) -> None:
        self.actor, self.local = actor, local
        self.retries, self.backoff_s = retries, backoff_s
        self.sent = self.lost = 0

    def reads_sandbox(self, env: type[Environment]) -> bool:
        return self.local.reads_sandbox(env)

    async def score(self, job: RewardJob, rank: Rank = lambda: (0, 0)) -> float:
        if self.local.reads_sandbox(job.env):
            return await self.local.score(job, rank)
        error: ActorLost | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.sent += 1
            try:
                return await call(
                    self.actor, RewardWorker.score, job.env.name, job.task, job.trajectory,
                    job.turns,
                )  # fmt: skip
            except ActorLost as e:
                self.lost += 1
                error = e
        raise RewardFailed(
            f"{job.env.name}'s reward{job.where}: the reward worker was lost: {error}"
        )

    def counters(self) -> dict[str, int]:
        """This worker's own scorings; the actor's are the fleet's to read."""
        return {"rewards_sent": self.sent, "rewards_lost": self.lost}

    async def close(self) -> None:
        await self.local.close()
