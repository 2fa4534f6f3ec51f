"""Where a group's episodes run: beside the engine and the sandboxes that serve them.

The coordinator decides which groups open, ranks them and collects their results; it hands each
group to `Rollouts` and asks it for one episode per member. `LocalRollouts` plays them in this
process: the member's sandbox forks from the group's zygote, the agent loop drives the engine
turn by turn, and every request carries the group's current priority. On a Ray cluster each
rollout worker runs a `LocalRollouts` of its own next to its engine and its sandbox pool, so an
episode is one call from the coordinator, not one per turn and per tool call
(`venusrl.runtime.cluster.worker`). A finished episode is scored by the reward workers
(`venusrl.rewards`); off the rollout's path its KV and its KV-window place go first.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from venusrl.coordinator.admission import AdmissionWindow, TurnWindow
from venusrl.coordinator.agent_loop import ChatFormat, failure_kind, run_episode
from venusrl.coordinator.config import RolloutConfig
from venusrl.envs.environment import Environment, EnvironmentFailed, Task
from venusrl.envs.service import GroupHandle, SandboxHandle, SandboxService
from venusrl.envs.types import InfraFailure
from venusrl.policy.critical_groups import BEST_EFFORT, reward_rank
from venusrl.rewards.kinds import EnvironmentReward
from venusrl.rewards.pool import RewardJob, RewardPool, Rewards
from venusrl.types import FailureKind, Generate, Progress, SamplingParams, Trajectory

log = logging.getLogger(__name__)

# A member's progress, after each model turn and each tool call that another turn follows, and
# how many seconds ago it was reported: 0 where it is passed on at once; a rollout worker's reports
# reach the driver later, and when a tool call began is what the ranking reads from them.
OnProgress = Callable[[Progress, float], None]


class GroupEpisodes(Protocol):
    """An open group: its members' sandboxes fork from one warm zygote, on one machine."""

    async def play(self, trajectory_id: str, on_progress: OnProgress) -> Trajectory:
        """One member's episode. Never raises for the platform's failures: they come back as a
        trajectory that finished `Finish.INFRA`, for the coordinator to replace or mask."""
        ...

    async def close(self) -> None: ...


class Rollouts(Protocol):
    async def open_group(
        self, group_id: str, env: type[Environment], task: Task, priority: int
    ) -> GroupEpisodes:
        """Raises `InfraFailure` when no sandbox group can be had for the task."""
        ...

    def set_priorities(self, priority: Mapping[str, int]) -> None:
        """Every open group's priority (group id -> class), after the coordinator re-ranked
        them; groups left out are best effort. Requests sent from now on carry it."""
        ...

    def reward_counters(self) -> dict[str, int]:
        """The reward workers as a step ends (`RewardPool.counters`)."""
        ...

    @property
    def resumed_episodes(self) -> int:
        """Episodes whose sandbox their pool preempted that went on in a fresh sandbox from
        their record (`agent_loop.run_episode`'s `replay`), instead of starting over."""
        ...


def failed(
    trajectory_id: str, group_id: str, task: Task, kind: FailureKind, message: str
) -> Trajectory:
    """The record of an episode that failed before it began."""
    traj = Trajectory.start(trajectory_id, group_id, task.id, [])
    traj.fail(kind, message)
    return traj


class LocalRollouts:
    """Episodes in this process, on `pool` and `generate`."""

    def __init__(
        self,
        pool: SandboxService,
        generate: Generate,
        fmt: ChatFormat,
        sampling: SamplingParams,
        rollout: RolloutConfig,
        end_trajectory: Callable[[str], Awaitable[None]] | None = None,
        admission: AdmissionWindow | TurnWindow | None = None,
        resume_preempted: bool = True,
        rewards: Rewards | None = None,
        engines: Sequence[Generate] | None = None,
    ) -> None:
        """`end_trajectory` tells the engine that an episode is over, so that the KV it kept for
        the trajectory between turns can go; `admission`: episodes run only while its window
        has room, or (a `TurnWindow`) each turn only while its trajectory holds a place in the
        engine's KV window (None: all at once); `resume_preempted`: an episode whose sandbox
        the pool preempted goes on here in a fresh one (False: it ends `Finish.INFRA`, for a caller
        that moves it elsewhere, as the Ray fleet does); `rewards`: the reward workers (None: the
        environment's own reward, inline); `engines`: the engines a `TurnWindow` places turns
        on, one per capacity it was given (None: `generate` alone)."""
        self.pool, self.generate, self.fmt = pool, generate, fmt
        self.sampling, self.rollout = sampling, rollout
        self.end_trajectory = end_trajectory
        self.admission = admission if isinstance(admission, AdmissionWindow) else None
        self.turns = admission if isinstance(admission, TurnWindow) else None
        if self.turns is not None:
            self.generate = self.turns.gate(engines or [generate])
        self.resume_preempted = resume_preempted
        self.rewards: Rewards = rewards or RewardPool(
            EnvironmentReward(), None, rollout.reward_timeout_s
        )
        self.priority: Mapping[str, int] = {}
        self.ranked: dict[str, int] = {}  # open group id -> its place in the ranking
        self.groups: dict[str, GroupHandle] = {}  # open groups' sandboxes, by group id
        self.resumed: list[str] = []  # trajectory ids, in the order they resumed
        self.tracebacks_shown: set[tuple[str, str]] = set()  # (environment, where it raised)

    @property
    def resumed_episodes(self) -> int:
        return len(self.resumed)

    def reward_counters(self) -> dict[str, int]:
        return self.rewards.counters()

    def rank(self, group_id: str) -> tuple[int, int]:
        """Where a group's rewards wait for a worker: critical groups first, in ranking order."""
        return reward_rank(group_id, self.priority, self.ranked)

    async def open_group(
        self, group_id: str, env: type[Environment], task: Task, priority: int
    ) -> LocalGroup:
        handle = await self.pool.open_group(
            env.template_for(task), priority=priority, setup=task.setup, files=task.files
        )
        self.groups[group_id] = handle
        return LocalGroup(self, handle, group_id, env, task)

    def set_priorities(self, priority: Mapping[str, int]) -> None:
        """Each open group's priority, in the ranking's order."""
        self.priority = priority
        self.ranked = {gid: i for i, gid in enumerate(priority)}
        if self.turns is not None:
            self.turns.set_ranking(priority)
        for group_id, handle in self.groups.items():  # the pool admits and preempts by it
            handle.set_priority(priority.get(group_id, BEST_EFFORT))


async def _no_slot() -> None:
    """The slot an episode holds without an admission window: nothing to let go."""


class LocalGroup:
    def __init__(
        self,
        rollouts: LocalRollouts,
        handle: GroupHandle,
        group_id: str,
        env: type[Environment],
        task: Task,
    ) -> None:
        self.rollouts, self.handle = rollouts, handle
        self.group_id, self.env, self.task = group_id, env, task

    async def play(
        self, trajectory_id: str, on_progress: OnProgress, replay: Trajectory | None = None
    ) -> Trajectory:
        """`replay`: go on with this record of the episode, whose sandbox failed elsewhere
        (`agent_loop.run_episode`). An episode whose sandbox the pool preempts (memory ran
        high) goes on once in a fresh one, admitted when the pool has room again, from its
        record: the turns the model took are kept and their KV is still in this engine's cache
        (`LocalRollouts.resume_preempted`)."""
        r = self.rollouts
        try:
            traj = await self._episode(trajectory_id, on_progress, replay)
            if (
                r.resume_preempted
                and replay is None
                and traj.failed_with(FailureKind.PREEMPTED)
                and traj.turn_starts
            ):
                r.resumed.append(trajectory_id)
                traj = await self._episode(trajectory_id, on_progress, traj)
            return traj
        finally:
            await self._turns_over(trajectory_id)

    async def _turns_over(self, trajectory_id: str) -> None:
        """The trajectory's place in the KV window and its KV go (again: harmless)."""
        r = self.rollouts
        if r.turns is not None:
            r.turns.end(trajectory_id)
        if r.end_trajectory is not None:
            # A hint for the engine's cache: an engine that cannot take it (down, restarting)
            # has lost that KV anyway.
            with contextlib.suppress(Exception):
                await r.end_trajectory(trajectory_id)

    async def _score(
        self,
        env: Environment,
        traj: Trajectory,
        on_progress: OnProgress,
        leave_slot: Callable[[], Awaitable[None]],
        sandbox: SandboxHandle,
    ) -> float:
        """The finished episode's reward from the run's reward workers; off the rollout's path
        its places (its admission slot, its KV-window place, its KV and, where the scorer does
        not read it, its sandbox) go first, and the coordinator learns that only its reward is
        left."""
        r, gid = self.rollouts, self.group_id
        if not r.rewards.inline:
            await leave_slot()
            await self._turns_over(traj.trajectory_id)
            if not r.rewards.reads_sandbox(type(env)):
                await sandbox.close()
            on_progress(traj.progress()._replace(grading=True), 0.0)
        started = time.monotonic()
        try:
            job = RewardJob.of(env, traj, r.fmt.text, self.handle.add)
            return await r.rewards.score(job, lambda: r.rank(gid))
        finally:
            traj.reward_s = time.monotonic() - started

    async def _episode(
        self, trajectory_id: str, on_progress: OnProgress, replay: Trajectory | None
    ) -> Trajectory:
        """The episode in a sandbox of its own, closed at its end."""
        r, gid = self.rollouts, self.group_id
        try:
            sandbox = await self.handle.add()
        except InfraFailure as e:
            return failed(
                trajectory_id, gid, self.task, FailureKind.SANDBOX, f"sandbox did not start: {e}"
            )
        # The sandbox is up while the episode waits for admission, as in the simulator.
        slot = r.admission.slot() if r.admission else contextlib.nullcontext(_no_slot)
        try:
            async with slot as leave:
                return await run_episode(
                    self.env(self.task, sandbox),
                    r.generate,
                    r.fmt,
                    r.sampling,
                    r.rollout,
                    trajectory_id,
                    gid,
                    self.task.id,
                    priority=lambda: r.priority.get(gid, BEST_EFFORT),
                    on_progress=lambda t: on_progress(t.progress(), 0.0),
                    replay=replay,
                    score=lambda env, traj: self._score(env, traj, on_progress, leave, sandbox),
                )
        except Exception as e:  # an engine call that failed is the platform's fault too
            # A bug in the environment's code is masked and replaced the same way, so that one
            # bad episode does not end the run; its author needs the traceback once per bug
            # (where it raised), not once per episode.
            raised = traceback.extract_tb(e.__cause__.__traceback__) if e.__cause__ else []
            kind = (self.env.name, str(raised[-1][:2]) if raised else str(e))
            if isinstance(e, EnvironmentFailed) and kind not in r.tracebacks_shown:
                r.tracebacks_shown.add(kind)
                log.warning("episode %s: %s", trajectory_id, e, exc_info=e)
            if isinstance(e, EnvironmentFailed) and e.record is not None:
                return e.record  # what the episode played is kept, not trained on
            return failed(
                trajectory_id, gid, self.task, failure_kind(e), f"{type(e).__name__}: {e}"
            )
        finally:
            await sandbox.close()

    async def close(self) -> None:
        self.rollouts.groups.pop(self.group_id, None)
        await self.handle.close()
