"""A rollout worker: an engine, a sandbox pool and the agent loops beside them, as one Ray actor.

Each worker runs, in its own process on the CPUs or GPUs Ray gives it, what one process runs
locally: the in-process engine on its thread, a sandbox pool with the node's memory (shared out
among the workers of the node), and the agent loops of the groups placed on it
(`coordinator.rollouts.LocalRollouts`). The driver's side of the seam is `fleet.RolloutFleet`.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

import ray
import torch

from venusrl.config import Config
from venusrl.coordinator.admission import TurnWindow
from venusrl.coordinator.agent_loop import ChatFormat
from venusrl.coordinator.rollouts import LocalGroup, LocalRollouts
from venusrl.envs.accounts import PoolStats
from venusrl.envs.environment import Environment, Task
from venusrl.envs.pool import SandboxPool
from venusrl.envs.sandbox import Sandbox
from venusrl.envs.types import ExecResult, GiB, SandboxCrashed, TemplateSpec
from venusrl.model.tokenizer import Tokenizer
from venusrl.model.weight_stream import Bucket, Spec
from venusrl.policy.kv_window import CriticalWindow
from venusrl.rewards.kinds import reward_pool
from venusrl.rewards.pool import Rewards
from venusrl.runtime.cluster.ray_cluster import (
    ActorLost,
    at_default_priority,
    available_memory_bytes,
)
from venusrl.runtime.cluster.reward_worker import RemoteRewards
from venusrl.runtime.cluster.weight_feed import WeightFeed
from venusrl.runtime.engines import LocalEngine
from venusrl.runtime.faults import engine_faults, sandbox_faults
from venusrl.types import GenerationOutput, Progress, SamplingParams, Trajectory, TurnMeta

NODE_MEMORY_FRACTION = 0.8  # of the node's available memory, at most, for its sandboxes


class WorkerReport(TypedDict):
    node: str
    pid: int  # its sandbox pool's cgroups are named after it (`envs.orphans`)
    pool: PoolStats
    served: list[str]  # trajectory ids this engine generated for
    episodes_in_flight: int
    rewards: dict[str, int]  # its scorings: sent to the reward worker, lost with it, or its own


def _node_id() -> str:
    return str(ray.get_runtime_context().get_node_id())


class RolloutWorker:
    """One rollout worker (a Ray actor). Groups and sandboxes are named by keys. Every method
    is a coroutine: the driver calls each through `ray_cluster.call` by the method itself."""

    def __init__(self, cfg: Config, index: int) -> None:
        at_default_priority()
        self.cfg = cfg
        self.index = index
        torch.set_num_threads(self.cfg.engine.threads or 1)
        self.pool: SandboxPool | None = None
        self.engine: LocalEngine | None = None
        self.rollouts: LocalRollouts | None = None
        self.window: TurnWindow | None = None
        self._groups: dict[str, LocalGroup] = {}
        self._sandboxes: dict[str, Sandbox] = {}
        # Episodes in flight: how far each is, and when (this process's clock) it said so.
        self._progress: dict[str, tuple[Progress, float]] = {}
        self.served: set[str] = set()  # trajectory ids this engine generated for
        self._faults: list[asyncio.Task[None]] = []  # `faults.*_sandboxes`
        self._feed: WeightFeed | None = None  # a publish under way

    async def node_id(self) -> str:
        return _node_id()

    async def ready(self, templates: list[TemplateSpec], workers_on_node: int) -> str:
        """Start the pool (its share of the node's memory) and prepare `templates` (again,
        after a restart); the node's id."""
        if self.pool is None:
            sb = self.cfg.sandbox
            # Sized from the node: the configured budget, but never more than the node can give.
            node_budget = min(
                int(sb.memory_budget_gib * GiB),
                int(NODE_MEMORY_FRACTION * available_memory_bytes()),
            )
            pool = SandboxPool.from_config(sb, node_budget // workers_on_node)
            await pool.start()
            self.pool = pool
        for spec in templates:
            await self.pool.prepare_template(spec)
        return _node_id()

    async def room(self) -> int:
        return self._pool().room_bytes()

    async def start_engine(
        self,
        model_files: dict[str, bytes],
        version: int,
        sampling: SamplingParams,
        reward_worker: Any | None = None,
    ) -> None:
        """`reward_worker`: the run's reward workers (a Ray actor, `reward_worker.RewardWorker`),
        or None to score inline."""
        # The engine and the tokenizer read the files once: the directory goes right after, so a
        # worker that is killed leaves nothing behind in /tmp.
        with tempfile.TemporaryDirectory(prefix="venusrl-engine-") as tmp:
            model_dir = Path(tmp)
            for name, data in model_files.items():
                (model_dir / name).write_bytes(data)
            tokenizer = Tokenizer.load(model_dir)
            if tokenizer is None or tokenizer.chat_template is None:
                raise ValueError("the published model needs a tokenizer with a chat template")
            self.engine = LocalEngine(model_dir, self.cfg, version)
        seed = self.cfg.run.seed + self.index
        generate = engine_faults(self._generate, self.cfg.faults, seed)
        fmt = ChatFormat(tokenizer, self.cfg.rollout.tool_parser)
        local = reward_pool(self.cfg.reward, self.cfg.rollout.reward_timeout_s)
        rewards: Rewards = (
            local
            if reward_worker is None
            else RemoteRewards(reward_worker, local, self.cfg.reward.retries)
        )
        # Each worker's engine its own KV window (`rollout.admission=critical`), in the
        # driver's ranking (`set_priorities`); its members stay on this engine.
        self.window = (
            TurnWindow(CriticalWindow(), await self.engine.kv_capacities())
            if self.cfg.rollout.admission == "critical"
            else None
        )
        self.rollouts = LocalRollouts(
            self._pool(), generate, fmt, sampling, self.cfg.rollout,
            end_trajectory=self.engine.end_trajectory,
            admission=self.window,
            resume_preempted=False,  # the fleet moves it to another worker
            rewards=rewards,
        )  # fmt: skip
        # From here on: the warm start's sandboxes are spared, as in one process.
        self._faults = sandbox_faults(self._pool(), self.cfg.faults, seed)

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
    ) -> GenerationOutput:
        assert self.engine is not None
        if meta.trajectory_id is not None:
            self.served.add(meta.trajectory_id)
        return await self.engine.generate(prompt_ids, params, meta)

    async def engine_counters(self) -> dict[str, float]:
        """The engine's totals, and its KV window's."""
        if self.engine is None:
            return {}
        counted = await self.engine.counters()
        if self.window is not None:
            counted |= self.window.book.counters()
        return counted

    async def pool_stats(self) -> PoolStats:
        return self._pool().stats()

    async def begin_weights(self, manifest: dict[str, Spec], version: int) -> None:
        """An update of the engine's weights to `version`: announced by `manifest` (answered
        once the engine accepts it), its buckets to come (`weights_bucket`), then
        `end_weights`."""
        if self.engine is None:  # restarted since the publish began: it waits for the next
            raise ActorLost("the worker restarted: no engine to update yet")
        timeout_s = self.cfg.trainer.rank_timeout_s  # the longest the trainer may take
        self._feed = WeightFeed(self.engine, manifest, version, timeout_s)
        await self._feed.started()

    async def weights_bucket(self, bucket: Bucket) -> None:
        """Answered once the engine has copied `bucket`. A worker restarted since the update
        began has no feed: it answers as a lost actor, so that the publish leaves it out (it
        waits for the next) rather than fail for every engine."""
        if self._feed is None:
            raise ActorLost("the worker restarted during a weight update")
        await self._feed.give(bucket)

    async def end_weights(self, broke: str | None) -> None:
        feed, self._feed = self._feed, None
        if feed is not None:
            await feed.end(broke)

    # --- groups and their episodes ----------------------------------------------------------

    async def open_group(self, key: str, env: type[Environment], task: Task, priority: int) -> None:
        rollouts = self._rollouts()
        rollouts.set_priorities({**rollouts.priority, key: priority})
        self._groups[key] = await rollouts.open_group(key, env, task, priority)

    async def play(
        self, key: str, trajectory_id: str, replay: Trajectory | None
    ) -> tuple[Trajectory, float, dict[str, tuple[Progress, float]]]:
        """One member's episode of group `key` (going on from `replay`, when given); when it
        started on this worker's clock; the progress of the other episodes in flight here, each
        with how many seconds before this return it was reported (when a tool call began is
        what the driver's ranking reads from it, and the driver hears of it only now)."""
        started = time.monotonic()
        group = self._groups.get(key)
        if group is None:  # this worker restarted since the group opened
            raise SandboxCrashed(f"group {key} is not on this worker (it restarted)")
        # An episode going on from its record has got that far: its replay reports nothing.
        so_far = replay.progress() if replay else Progress(0, 0, 0, 0.0)
        self._progress[trajectory_id] = (so_far, started)
        try:
            traj = await group.play(
                trajectory_id, lambda p, age: self._report(trajectory_id, p, age), replay
            )
        finally:
            del self._progress[trajectory_id]
        now = time.monotonic()
        return traj, started, {t: (p, now - at) for t, (p, at) in self._progress.items()}

    def _report(self, trajectory_id: str, p: Progress, age: float) -> None:
        self._progress[trajectory_id] = (p, time.monotonic() - age)

    async def close_group(self, key: str) -> None:
        group = self._groups.pop(key, None)
        if group is not None:
            await group.close()

    async def set_priorities(self, priority: dict[str, int]) -> None:
        self._rollouts().set_priorities(priority)

    # --- single sandboxes (the warm start's demonstrations) ---------------------------------

    async def create(
        self,
        template: str | TemplateSpec,
        priority: int,
        setup: str | None,
        files: Mapping[str, bytes] | None,
    ) -> str:
        sb = await self._pool().create(template, priority, setup, files)
        self._sandboxes[sb.id] = sb
        return sb.id

    async def exec(
        self,
        sandbox: str,
        command: str | Sequence[str],
        timeout_s: float,
        max_output_bytes: int,
        stdin: bytes = b"",
    ) -> ExecResult:
        return await self._sandbox(sandbox).exec(
            command, timeout_s=timeout_s, max_output_bytes=max_output_bytes, stdin=stdin
        )

    async def run_python(self, sandbox: str, source: str, timeout_s: float) -> ExecResult:
        return await self._sandbox(sandbox).run_python(source, timeout_s=timeout_s)

    async def read_file(self, sandbox: str, path: str) -> bytes:
        return await self._sandbox(sandbox).read_file(path)

    async def write_file(self, sandbox: str, path: str, data: bytes) -> None:
        await self._sandbox(sandbox).write_file(path, data)

    def _sandbox(self, key: str) -> Sandbox:
        sb = self._sandboxes.get(key)
        if sb is None:
            raise SandboxCrashed(f"sandbox {key} is not on this worker (it restarted)")
        return sb

    async def close_sandbox(self, sandbox: str) -> None:
        sb = self._sandboxes.pop(sandbox, None)
        if sb is not None:
            await sb.close()

    # --- reports and shutdown ---------------------------------------------------------------

    async def report(self) -> WorkerReport:
        return {
            "node": _node_id(),
            "pid": os.getpid(),
            "pool": self._pool().stats(),
            "served": sorted(self.served),
            "episodes_in_flight": len(self._progress),
            "rewards": {} if self.rollouts is None else self.rollouts.reward_counters(),
        }

    async def shutdown(self) -> None:
        for task in self._faults:
            task.cancel()
        if self.rollouts is not None:
            await self.rollouts.rewards.close()
        if self.engine is not None:
            await self.engine.close()
        if self.pool is not None:
            await self.pool.close()

    def _pool(self) -> SandboxPool:
        if self.pool is None:
            raise RuntimeError("the worker's pool is not started: call ready() first")
        return self.pool

    def _rollouts(self) -> LocalRollouts:
        if self.rollouts is None:
            raise RuntimeError("the worker has no engine yet: call start_engine() first")
        return self.rollouts
