"""The books of a run's GRPO groups: which may open, how far each member is, which groups are
complete, their priorities, and which complete groups make the trainer's next batch.

Kept by the coordinator in training and by the simulator on virtual time (`sim.executor`), so a
simulated run starts, ranks and batches groups as training does. Pure: told what happened (a group
opened, a member took a turn or finished), it answers with the decisions of `policy.staleness`
and `policy.critical_groups`; it reads no clock and runs nothing. Each group carries its keeper's
`data` (the coordinator's task and trajectories, the simulator's plans).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from venusrl.policy.critical_groups import (
    BEST_EFFORT,
    CoordinatorSnapshot,
    CriticalGroups,
    FifoGroups,
    GroupView,
    LengthPredictor,
    MemberView,
    TurnRates,
)
from venusrl.policy.staleness import StalenessBound
from venusrl.types import Progress

T = TypeVar("T")


@dataclass(eq=False)
class Group(Generic[T]):
    """A group from its opening until the trainer takes it."""

    group_id: str
    prompt_id: str
    arrival: int  # groups opened before it: the ranking's age
    started_version: int  # the weight version when it opened: the staleness bound's
    members: list[MemberView]  # the ranking's view of each, turn by turn
    data: T
    cut_at: float  # when the harness's time limit cuts its members (inf: no limit)
    scored: int = 0  # members finished with a reward
    masked: int = 0  # members given up on: the platform failed them past their retries
    # The ranking's view, at the weight version it was built for: a re-ranking follows every
    # member that finishes, over every open group, and most views have not changed since.
    view: tuple[int, GroupView] | None = None

    @property
    def finished(self) -> bool:
        return self.scored + self.masked == len(self.members)


class GroupBook(Generic[T]):
    """The groups of one run, from opening to the trainer's batch; `data`: what each carries."""

    def __init__(
        self,
        bound: StalenessBound,
        priorities: Literal["critical", "fifo"],
        rates: TurnRates | None = None,
        start_version: int = 0,
        time_limit_s: float = math.inf,
    ) -> None:
        """`rates`: the decode speed and tool time the ranking assumes, as their keeper observes
        turns into them; `start_version`: the weight version the run starts at (a resumed one
        trained batches before); `time_limit_s`: the harness's limit on an episode, from its
        start (the ranking runs a group that would run into it among the critical ones)."""
        if not time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
        self.bound, self.time_limit_s = bound, time_limit_s
        self.policy = CriticalGroups() if priorities == "critical" else FifoGroups()
        self.rates = rates or TurnRates()
        self.lengths = LengthPredictor()
        self.open: dict[str, Group[T]] = {}
        self.ready: list[Group[T]] = []  # complete, in completion order
        self.priorities: dict[str, int] = {}  # open group id -> priority, from the last ranking
        self.order: tuple[str, ...] = ()  # open group ids, most critical first (the last ranking)
        self.groups_started = self.groups_completed = self.groups_dropped = 0
        self.groups_uniform = 0  # of those dropped, the ones whose rewards all agreed
        self.tool_calls_seen = 0  # members' returned tool calls the ranking learned of
        # The bound numbers groups from version 0: a resumed run's trained batches count.
        self._groups_before = start_version * bound.batch_groups
        self._newest_trained = 0  # groups opened up to the latest that a batch took

    # --- groups ---------------------------------------------------------------------------------

    def startable(self, version: int) -> int:
        """How many groups may open now (`StalenessBound.startable`). A dropped group gives its
        place in a batch back: with max_staleness=0 the batch could otherwise never fill. A group
        still open though one opened after it was trained is overtaken."""
        placed = self._groups_before + self.groups_started - self.groups_dropped
        overtaken = 0
        if self.bound.release_overtaken:  # else the bound counts every started group
            overtaken = sum(g.arrival < self._newest_trained for g in self.open.values())
        return self.bound.startable(placed, version, overtaken)

    def start_group(
        self, group_id: str, prompt_id: str, size: int, version: int, data: T, now: float = 0.0
    ) -> Group[T]:
        """A group of `size` members opens at weight `version` and time `now` (its members'
        time limit counts from then); call `rank` once the groups that open together have."""
        if not self.startable(version):
            raise ValueError(f"group {group_id}: the staleness bound lets no group open now")
        if group_id in self.open:
            raise ValueError(f"group {group_id} is open already")
        members = [MemberView(False)] * size
        cut_at = now + self.time_limit_s
        group = Group(group_id, prompt_id, self.groups_started, version, members, data, cut_at)
        self.groups_started += 1
        self.open[group_id] = group
        return group

    def progress(self, group_id: str, index: int, p: Progress, now: float | None = None) -> None:
        """A member's report (`Progress`, at time `now`): after a model turn, its tool call
        starts; after the call returns, the seconds it took count toward its group's tool time;
        once its turns are over and its reward is scored apart, only that reward is left.
        Re-ranking waits for the next member to finish, so a report costs no sort."""
        group = self.open.get(group_id)
        if group is None:  # dropped (it timed out) while the member's report was on its way
            return
        m = group.members[index]
        if (p.turns, p.tool_calls, p.grading) < (m.turns, m.tool_calls, m.reward_since is not None):
            return  # an older report, relayed after a newer one
        self.tool_calls_seen += max(p.tool_calls - m.tool_calls, 0)
        if p.grading:  # a report repeated while it is graded keeps when its reward began
            since = m.reward_since if m.reward_since is not None else now
            graded = MemberView(False, p.tokens, p.turns, tool_s=p.tool_s,
                                tool_calls=p.tool_calls, reward_since=since)  # fmt: skip
            self._set(group, index, graded)
            return
        since = None
        if p.in_tool:  # a report repeated during one call keeps when the call started
            since = m.tool_since if m.waiting_on_tool and m.turns == p.turns else now
        self._set(group, index, MemberView(False, p.tokens, p.turns, p.in_tool, p.tool_s,
                                           p.tool_calls, since))  # fmt: skip

    def restart_member(self, group_id: str, index: int) -> None:
        """A replacement attempt of a member starts: the failed attempt's reports are not its
        progress (nor its tool call in progress)."""
        group = self.open.get(group_id)
        if group is not None:
            self._set(group, index, MemberView(False))

    def member_finished(self, group_id: str, index: int, scored: bool, final: Progress) -> bool:
        """A member's episode ended for good, `scored` (its length teaches the predictor) or
        masked, `final` its whole episode's progress. True when it was the group's last: `close`
        the group."""
        group = self._group(group_id)
        if group.members[index].done:
            raise ValueError(f"group {group_id}: member {index} finished already")
        if scored:
            self.lengths.observe(group.prompt_id, final.tokens, final.turns)
            group.scored += 1
        else:
            group.masked += 1
        # Its tool calls still tell the group's tool time per call (the ranking's estimate for
        # the members still running), whether or not its reports while it ran came through.
        self.tool_calls_seen += max(final.tool_calls - group.members[index].tool_calls, 0)
        self._set(group, index, MemberView(True, final.tokens, final.turns, tool_s=final.tool_s,
                                           tool_calls=final.tool_calls))  # fmt: skip
        return group.finished

    def close(self, group_id: str, informative: bool = True) -> bool:
        """Every member finished: the group waits for the trainer (True), or with fewer than two
        scored members it teaches nothing and is dropped (False); so is one whose rewards all
        agree (`informative` False: dynamic sampling), counted in `groups_uniform` too."""
        group = self._group(group_id)
        if not group.finished:
            raise ValueError(f"group {group_id}: closed with members still running")
        del self.open[group_id]
        self.priorities.pop(group_id, None)
        if group.scored < 2 or not informative:
            self.groups_dropped += 1
            self.groups_uniform += group.scored >= 2
            return False
        self.ready.append(group)
        self.groups_completed += 1
        return True

    def drop(self, group_id: str) -> None:
        """The group ends unfinished (it timed out, its sandboxes could not be had)."""
        if self.open.pop(group_id, None) is None:
            raise KeyError(f"group {group_id} is not open")
        self.priorities.pop(group_id, None)
        self.groups_dropped += 1

    def take_batch(self, version: int) -> list[Group[T]] | None:
        """The trainer's batch at `version` (`StalenessBound.batch`: every group the bound makes
        due, then others in the order they completed), or None to wait for more groups."""
        running = [g.started_version for g in self.open.values()]
        picked = self.bound.batch([g.started_version for g in self.ready], running, version)
        if picked is None:
            return None
        batch = [self.ready[i] for i in picked]
        self._newest_trained = max(self._newest_trained, *(g.arrival + 1 for g in batch))
        taken = set(picked)
        self.ready = [g for i, g in enumerate(self.ready) if i not in taken]
        return batch

    # --- priorities -----------------------------------------------------------------------------

    def rank(self, version: int, now: float = 0.0) -> dict[str, int]:
        """Every open group's priority at `version`, by the group policy (critical or fifo)."""
        decided = self.policy.decide(self.snapshot(version, now))
        self.priorities, self.order = dict(decided.priority), decided.order
        return self.priorities

    def priority(self, group_id: str) -> int:
        return self.priorities.get(group_id, BEST_EFFORT)

    def snapshot(self, version: int, now: float = 0.0) -> CoordinatorSnapshot:
        """What the group policy ranks on."""
        groups = []
        for g in self.open.values():
            if g.view is None or g.view[0] != version:
                due = self.bound.due(g.started_version, version)
                view = GroupView(
                    g.group_id, g.prompt_id, g.arrival, tuple(g.members), due, g.cut_at
                )
                g.view = (version, view)
            groups.append(g.view[1])
        return CoordinatorSnapshot(
            groups,
            self.bound.batch_groups,
            len(self.ready),
            self.lengths.predictions([g.prompt_id for g in groups]),
            self.rates.decode_tokens_per_s,
            self.rates.tool_s_per_turn,
            now,
            self.rates.reward_s,
        )

    def check(self) -> None:
        """The books balance: every group started is open, completed or dropped; an open group's
        finished members are its scored and masked ones; a complete group has two scored."""
        closed = self.groups_completed + self.groups_dropped
        assert self.groups_started == len(self.open) + closed, (self.groups_started, closed)
        for g in self.open.values():
            assert sum(m.done for m in g.members) == g.scored + g.masked, g.group_id
        assert all(g.finished and g.scored >= 2 for g in self.ready)
        assert self.priorities.keys() <= self.open.keys()

    def _group(self, group_id: str) -> Group[T]:
        group = self.open.get(group_id)
        if group is None:
            raise KeyError(f"group {group_id} is not open")
        return group

    @staticmethod
    def _set(group: Group[T], index: int, member: MemberView) -> None:
        group.members[index] = member
        group.view = None
