"""Tasks in, trainer batches out: groups of K episodes, ranked so the next batch fills first.

The coordinator opens a group for each task while the staleness bound allows
(`policy.staleness`), runs its K members as episodes of the agent loop, each in its own sandbox
forked from the group's warm zygote (`rollouts`: in this process, or on the rollout worker that
holds the group), and hands the trainer batches of B complete groups.

Priorities: the ranking's view of each member follows it turn by turn (tokens, turns, tool calls
and their seconds so far),
and every time a member finishes its episode or groups open or close, the open groups are
re-ranked by the critical-group policy (`policy.critical_groups`) at the decode speed and tool
time the members' turns show (`TurnRates`): the groups that complete the next batch get high
priority, and every generation request a member sends carries its group's current priority
(`Rollouts.set_priorities`). The books of it all are `group_book.GroupBook`, which the simulator
(`venusrl.sim`) keeps the same way.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from venusrl.coordinator.config import RolloutConfig
from venusrl.coordinator.group_book import Group, GroupBook
from venusrl.coordinator.mixing import GroupTask
from venusrl.coordinator.rollouts import GroupEpisodes, Rollouts
from venusrl.envs.environment import Environment, Task
from venusrl.envs.types import InfraFailure
from venusrl.policy.critical_groups import TurnRates
from venusrl.types import Failure, FailureKind, Finish, Progress, Trajectory


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
    # When its last member's turns ended, and when its last reward came (time.monotonic()):
    # what scoring added to the group's time lies between them.
    rolled_out_at: float = 0.0
    completed_at: float = 0.0
    # Attempts the platform failed that a replacement member played again: not trained on,
    # kept for the record (what an environment's bug did, as far as its episode went).
    replaced: list[Trajectory] = field(default_factory=list)

    @property
    def masked(self) -> int:
        return sum(t.reward is None for t in self.trajectories)

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]


@dataclass
class _GroupRun:
    """What the coordinator keeps of a group beside its books: the task and the trajectories."""

    env: type[Environment]
    task: Task
    results: list[Trajectory | None]  # per member, its last attempt
    opened_s: float  # time.monotonic()
    duration_s: float = 0.0  # from opening to the last member's end
    rolled_out_s: float = 0.0  # when the last member's turns ended (time.monotonic())
    infra_failures: int = 0
    env_failures: int = 0
    last_failure: Failure | None = None
    replaced: list[Trajectory] = field(default_factory=list)

    def result(self, group: Group[_GroupRun]) -> GroupResult:
        trajectories = [t for t in self.results if t is not None]
        return GroupResult(
            group.group_id,
            self.env.name,
            self.task,
            trajectories,
            group.started_version,
            self.infra_failures,
            self.env_failures,
            self.duration_s,
            self.rolled_out_s,
            self.opened_s + self.duration_s,
            self.replaced,
        )


@dataclass(frozen=True)
class CoordinatorStats:
    groups_started: int = 0
    groups_completed: int = 0
    groups_dropped: int = 0
    groups_uniform: int = 0  # of those dropped, the ones whose rewards all agreed
    infra_failures: int = 0
    env_failures: int = 0  # of the infra failures, those the environment's own code raised
    masked: int = 0
    tool_calls_seen: int = 0  # members' returned tool calls the ranking learned of


class Coordinator:
    def __init__(
        self,
        tasks: Iterator[GroupTask],
        rollouts: Rollouts,
        config: RolloutConfig,
        weight_version: Callable[[], int],
        informative: Callable[[Sequence[Trajectory]], bool] | None = None,
    ) -> None:
        """`tasks`: what each new group plays (`mixing.mixed_tasks`); `rollouts`: where the
        groups' episodes run; `informative`: whether a complete group's trajectories teach
        anything (None: every group with two scored members does), else it is dropped and
        another opens in its place (`rollout.dynamic_sampling`)."""
        self.tasks, self.rollouts = tasks, rollouts
        self.informative = informative
        self.config = config
        self.weight_version = weight_version
        bound = config.staleness_bound()
        # The ranking's decode speed and tool time: measured from the members' turns.
        self.book: GroupBook[_GroupRun] = GroupBook(
            bound, config.priorities, TurnRates(), weight_version(), config.time_limit_s
        )
        self._infra_failures = self._env_failures = self._masked = 0
        self._changed = asyncio.Event()  # a group completed or was dropped
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._launcher: asyncio.Task[None] | None = None
        # What stopped the launcher or a group's task (a task stream that ran dry, a bug): the
        # trainer's next wait raises it instead of waiting out `batch_timeout_s`.
        self._fatal: BaseException | None = None
        self._dropped_in_a_row = 0
        self._uniform_in_a_row = 0

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
            batch = self.book.take_batch(version)
            if batch is not None:
                break
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._changed.wait(), max(remaining, 0.001))
            except TimeoutError:
                raise TimeoutError(
                    f"no trainer batch within {self.config.batch_timeout_s} s: "
                    f"{len(self.book.ready)} of {self.config.batch_groups} groups complete"
                ) from None
        self._wake.set()  # the trainer is about to move on: more groups may start soon
        return [group.data.result(group) for group in batch]

    @property
    def running_groups(self) -> int:
        return len(self.book.open)

    @property
    def stats(self) -> CoordinatorStats:
        book = self.book
        return CoordinatorStats(
            book.groups_started,
            book.groups_completed,
            book.groups_dropped,
            book.groups_uniform,
            self._infra_failures,
            self._env_failures,
            self._masked,
            book.tool_calls_seen,
        )

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
            version = self.weight_version()
            opened = [
                self._open(next(self.tasks), version) for _ in range(self.book.startable(version))
            ]
            if opened:
                self._rerank()
            for group in opened:
                self._spawn(self._run_group(group))
            self._wake.clear()
            await self._wake.wait()

    def _open(self, work: GroupTask, version: int) -> Group[_GroupRun]:
        k = work.group_size
        run = _GroupRun(work.env, work.task, [None] * k, time.monotonic())
        # Named by the order groups start in, which the task stream fixes (not by when their
        # members happen to start): a trajectory's id seeds its sampling (`agent_loop`).
        gid = f"g{self.book.groups_started}"
        return self.book.start_group(gid, work.task.id, k, version, run, run.opened_s)

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._fatal is None:
            self._fatal = task.exception()
            self._changed.set()

    async def _run_group(self, group: Group[_GroupRun]) -> None:
        gid, run = group.group_id, group.data
        episodes: GroupEpisodes | None = None
        try:
            async with asyncio.timeout(self.config.group_timeout_s):
                episodes = await self.rollouts.open_group(
                    gid, run.env, run.task, self.book.priority(gid)
                )
                members = range(len(group.members))
                await asyncio.gather(*(self._run_member(group, episodes, i) for i in members))
            run.duration_s = time.monotonic() - run.opened_s
            self._masked += group.masked
            played = [t for t in run.results if t is not None]
            informative = self.informative is None or self.informative(played)
            if self.book.close(gid, informative):
                self._dropped_in_a_row = self._uniform_in_a_row = 0
            elif not informative and group.scored >= 2:
                self._dropped_in_a_row = 0  # its episodes played: no failure to count
                self._uniform(played)
            else:
                self._dropped(str(run.last_failure))
        except (TimeoutError, InfraFailure) as e:
            self.book.drop(gid)
            self._dropped(f"{type(e).__name__}: {e}")
        finally:
            if gid in self.book.open:  # cancelled (the run is closing) or a bug
                self.book.drop(gid)
            if episodes is not None:
                await episodes.close()
            self._rerank()
            self._wake.set()
            self._changed.set()

    def _dropped(self, failure: str | None) -> None:
        self._dropped_in_a_row += 1
        if self._dropped_in_a_row >= self.config.max_dropped_in_a_row and self._fatal is None:
            self._fatal = EpisodesFailing(
                f"{self._dropped_in_a_row} groups in a row were dropped, none completed: their"
                f" episodes fail. The last failure: {failure}"
            )
            self._changed.set()

    def _uniform(self, played: list[Trajectory]) -> None:
        self._uniform_in_a_row += 1
        if self._uniform_in_a_row >= self.config.max_uniform_in_a_row and self._fatal is None:
            rewards = sorted({t.reward for t in played if t.reward is not None})
            self._fatal = EpisodesFailing(
                f"{self._uniform_in_a_row} groups in a row had rewards that all agreed (the last:"
                f" {rewards}): rollout.dynamic_sampling drops them, so no batch fills. The tasks"
                " are too hard or too easy for this policy: start from a better one, give other"
                " tasks, or set rollout.dynamic_sampling=off"
            )
            self._changed.set()

    async def _run_member(
        self, group: Group[_GroupRun], episodes: GroupEpisodes, index: int
    ) -> None:
        gid, run = group.group_id, group.data
        for attempt in itertools.count():  # a member replaced after a failure plays again
            tid = f"{gid}-m{index}-a{attempt}"
            if attempt:
                self.book.restart_member(gid, index)
            traj = await episodes.play(tid, lambda p, age: self._progress(gid, index, p, age))
            for turn in turns_played(traj):
                self.book.rates.observe(*turn)
            ended = time.monotonic()
            if traj.reward_s is not None:
                run.rolled_out_s = max(run.rolled_out_s, ended - traj.reward_s)
                if traj.finish is not Finish.INFRA:
                    self.book.rates.observe_reward(traj.reward_s)
            else:
                run.rolled_out_s = max(run.rolled_out_s, ended)
            if traj.finish is Finish.INFRA:
                run.last_failure = traj.failure
                run.infra_failures += 1
                env_failed = traj.failed_with(FailureKind.ENVIRONMENT)
                run.env_failures += env_failed
                self._infra_failures += 1
                self._env_failures += env_failed
                if run.infra_failures <= self.config.max_infra_retries:
                    run.replaced.append(traj)
                    continue  # a replacement member runs the same task
            run.results[index] = traj
            scored = traj.finish is not Finish.INFRA
            self.book.member_finished(gid, index, scored, traj.progress())
            self._rerank()
            return

    def _progress(self, group_id: str, index: int, p: Progress, age_s: float) -> None:
        """A member's report, `age_s` old; one whose turns are over and whose reward is being
        scored apart makes its group nearer done: the groups are ranked again."""
        self.book.progress(group_id, index, p, time.monotonic() - age_s)
        if p.grading:
            self._rerank()

    def _rerank(self) -> None:
        self.rollouts.set_priorities(self.book.rank(self.weight_version(), time.monotonic()))


def turns_played(traj: Trajectory) -> Iterator[tuple[int, float, float | None]]:
    """What each turn the environment acted on cost (`TurnRates.observe`): the model's tokens,
    the seconds from the request to the last of them, and the environment's seconds acting on
    them where another turn followed (None for the last)."""
    ends = [*traj.turn_starts[1:], len(traj.token_ids)]
    for i, times in enumerate(traj.turn_times):
        tokens = sum(traj.mask[traj.turn_starts[i] : ends[i]])
        followed = i + 1 < len(traj.turn_starts)
        tool_s = times.acted - times.generated if followed else None
        yield tokens, times.generated - times.requested, tool_s
