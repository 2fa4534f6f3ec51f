"""Tasks in, trainer batches out: groups of K episodes, ranked so the next batch fills first.

The coordinator opens a group for each task while the staleness bound allows
(`policy.staleness`), runs its K members as episodes of the agent loop, each in its own sandbox
forked from the group's warm zygote (`rollouts`: in this process, or on the rollout worker that
holds the group), and hands the trainer batches of B complete groups.

Priorities: the ranking's view of each member follows it turn by turn (tokens and turns so far),
and every time a member finishes its episode or a group opens or closes, the open groups are
re-ranked by the critical-group policy (`policy.critical_groups`): the groups that complete the
next batch get high priority, and every generation request a member sends carries its group's
current priority (`Rollouts.set_priorities`). The simulator (`venusrl.sim`) feeds the policy at
the same moments.

Failure semantics: an episode that ends in an infrastructure failure (sandbox died or was
preempted, an engine call failed, a service timed out) is re-run by a replacement member, up to
`max_infra_retries` per group; past that it is masked, its reward None, so it never enters the
group's statistics as a 0. A group left with fewer than two scored members teaches nothing and is
dropped (counted). Every wait is bounded: a group that does not complete within
`group_timeout_s` is dropped; `next_batch` waits at most `batch_timeout_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from venusrl.coordinator.config import RolloutConfig
from venusrl.coordinator.mixing import GroupTask
from venusrl.coordinator.rollouts import GroupEpisodes, Rollouts
from venusrl.envs.environment import Environment, Task
from venusrl.envs.types import InfraFailure
from venusrl.policy.critical_groups import (
    BEST_EFFORT,
    CoordinatorSnapshot,
    CriticalGroups,
    FifoGroups,
    GroupView,
    LengthPredictor,
    MemberView,
)
from venusrl.policy.staleness import StalenessBound
from venusrl.types import Failure, FailureKind, Finish, Trajectory


class EpisodesFailing(ValueError):
    """Group after group is dropped: the run cannot make a batch."""


@dataclass
class GroupResult:
    group_id: str
    env: str  # the environment's name
    task: Task
    trajectories: list[Trajectory]  # K, in member order; masked ones have reward None
    started_version: int
    infra_failures: int = 0
    env_failures: int = 0  # of the infra failures, those the environment's own code raised
    duration_s: float = 0.0  # from opening the group to its last member's end

    @property
    def masked(self) -> int:
        return sum(t.reward is None for t in self.trajectories)

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]


@dataclass
class _OpenGroup:
    group_id: str
    env: type[Environment]
    task: Task
    arrival: int
    started_version: int
    members: list[MemberView]
    infra_failures: int = 0
    env_failures: int = 0
    results: list[Trajectory | None] = field(default_factory=list)
    last_failure: Failure | None = None


@dataclass
class CoordinatorStats:
    groups_started: int = 0
    groups_completed: int = 0
    groups_dropped: int = 0
    infra_failures: int = 0
    env_failures: int = 0  # of the infra failures, those the environment's own code raised
    masked: int = 0


class Coordinator:
    def __init__(
        self,
        tasks: Iterator[GroupTask],
        rollouts: Rollouts,
        config: RolloutConfig,
        weight_version: Callable[[], int],
    ) -> None:
        """`tasks`: what each new group plays (`mixing.mixed_tasks`); `rollouts`: where the
        groups' episodes run."""
        self.tasks, self.rollouts = tasks, rollouts
        self.config = config
        self.weight_version = weight_version
        self.bound = StalenessBound(
            config.batch_groups, config.max_staleness, config.max_train_staleness
        )
        # The bound numbers groups from version 0; a resumed run starts at a later version, with
        # the groups of every batch trained before it counted as started.
        self._groups_before = weight_version() * config.batch_groups
        self.policy = CriticalGroups() if config.priorities == "critical" else FifoGroups()
        self.lengths = LengthPredictor()
        self.stats = CoordinatorStats()
        self._open: dict[str, _OpenGroup] = {}
        self._priority: dict[str, int] = {}
        self._ready: list[GroupResult] = []  # complete groups, in completion order
        self._changed = asyncio.Event()  # a group completed or was dropped
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._launcher: asyncio.Task[None] | None = None
        # What stopped the launcher or a group's task (a task stream that ran dry, a bug): the
        # trainer's next wait raises it instead of waiting out `batch_timeout_s`.
        self._fatal: BaseException | None = None
        self._dropped_in_a_row = 0

    # --- the trainer's side ---------------------------------------------------------------------

    def start(self) -> None:
        self._launcher = asyncio.create_task(self._launch())
        self._launcher.add_done_callback(self._settled)

    async def next_batch(self) -> list[GroupResult]:
        """B complete groups for the trainer at its current version: every group the staleness
        bound makes due, then others in the order they completed (`StalenessBound.batch`).
        Waits at most `batch_timeout_s`."""
        deadline = time.monotonic() + self.config.batch_timeout_s
        version = self.weight_version()
        while True:
            if self._fatal is not None:
                raise self._fatal
            self._changed.clear()
            running = [g.started_version for g in self._open.values()]
            picked = self.bound.batch([r.started_version for r in self._ready], running, version)
            if picked is not None:
                break
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._changed.wait(), max(remaining, 0.001))
            except TimeoutError:
                raise TimeoutError(
                    f"no trainer batch within {self.config.batch_timeout_s} s: "
                    f"{len(self._ready)} of {self.config.batch_groups} groups complete"
                ) from None
        batch = [self._ready[i] for i in picked]
        taken = set(picked)
        self._ready = [r for i, r in enumerate(self._ready) if i not in taken]
        self._wake.set()  # the trainer is about to move on: more groups may start soon
        return batch

    @property
    def running_groups(self) -> int:
        return len(self._open)

    def version_changed(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        tasks = [t for t in [self._launcher, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- groups ---------------------------------------------------------------------------------

    async def _launch(self) -> None:
        while True:
            # A dropped group gives its place in a batch back: with max_staleness=0 the batch
            # could otherwise never fill.
            placed = self._groups_before + self.stats.groups_started - self.stats.groups_dropped
            startable = self.bound.startable(placed, self.weight_version())
            for _ in range(startable):
                self._spawn(self._run_group(next(self.tasks), self.stats.groups_started))
                self.stats.groups_started += 1
            self._wake.clear()
            await self._wake.wait()

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._fatal is None:
            self._fatal = task.exception()
            self._changed.set()

    async def _run_group(self, work: GroupTask, arrival: int) -> None:
        gid = f"g{next(self._ids)}"
        task, k = work.task, work.group_size
        opened = time.monotonic()
        state = _OpenGroup(
            gid, work.env, task, arrival, self.weight_version(), [MemberView(False)] * k
        )
        state.results = [None] * k
        self._open[gid] = state
        self._rerank()
        group: GroupEpisodes | None = None
        try:
            async with asyncio.timeout(self.config.group_timeout_s):
                group = await self.rollouts.open_group(
                    gid, work.env, task, self._priority.get(gid, BEST_EFFORT)
                )
                await asyncio.gather(*(self._run_member(state, group, i) for i in range(k)))
            result = GroupResult(
                gid,
                work.env.name,
                task,
                [t for t in state.results if t is not None],
                state.started_version,
                state.infra_failures,
                state.env_failures,
                time.monotonic() - opened,
            )
            scored = k - result.masked
            self.stats.masked += result.masked
            if scored < 2:
                self._dropped(str(state.last_failure))
            else:
                self.stats.groups_completed += 1
                self._dropped_in_a_row = 0
                self._ready.append(result)
        except (TimeoutError, InfraFailure) as e:
            self._dropped(f"{type(e).__name__}: {e}")
        finally:
            self._open.pop(gid, None)
            self._priority.pop(gid, None)
            if group is not None:
                await group.close()
            self._rerank()
            self._wake.set()
            self._changed.set()

    def _dropped(self, failure: str | None) -> None:
        self.stats.groups_dropped += 1
        self._dropped_in_a_row += 1
        if self._dropped_in_a_row >= self.config.max_dropped_in_a_row and self._fatal is None:
            self._fatal = EpisodesFailing(
                f"{self._dropped_in_a_row} groups in a row were dropped, none completed: their"
                f" episodes fail. The last failure: {failure}"
            )
            self._changed.set()

    async def _run_member(self, state: _OpenGroup, group: GroupEpisodes, index: int) -> None:
        while True:
            tid = f"{state.group_id}-m{index}-{next(self._ids)}"
            traj = await group.play(
                tid, lambda tokens, turns: self._progress(state, index, tokens, turns)
            )
            if traj.finish is Finish.INFRA:
                state.last_failure = traj.failure
                state.infra_failures += 1
                env_failed = traj.failed_with(FailureKind.ENVIRONMENT)
                state.env_failures += env_failed
                self.stats.infra_failures += 1
                self.stats.env_failures += env_failed
                if state.infra_failures <= self.config.max_infra_retries:
                    continue  # a replacement member runs the same task
            else:
                self.lengths.observe(state.task.id, traj.model_tokens, len(traj.turn_starts))
            state.results[index] = traj
            state.members[index] = MemberView(True, traj.model_tokens, len(traj.turn_starts))
            self._rerank()
            return

    def _progress(self, state: _OpenGroup, index: int, tokens: int, turns: int) -> None:
        """A member finished a model turn: the ranking's view of it moves on (its tokens and
        turns so far; now waiting on the environment). Re-ranking waits for the next member to
        finish, as in the simulator, so a turn costs no sort."""
        state.members[index] = MemberView(False, tokens, turns, waiting_on_tool=True)

    def _rerank(self) -> None:
        version = self.weight_version()
        groups = [
            GroupView(
                g.group_id,
                g.task.id,
                g.arrival,
                tuple(g.members),
                self.bound.due(g.started_version, version),
            )
            for g in self._open.values()
        ]
        snap = CoordinatorSnapshot(
            groups,
            self.config.batch_groups,
            len(self._ready),
            self.lengths.predictions([g.prompt_id for g in groups]),
        )
        self._priority = dict(self.policy.decide(snap).priority)
        self.rollouts.set_priorities(self._priority)
