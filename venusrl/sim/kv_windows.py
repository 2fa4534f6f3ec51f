"""The simulator's side of the KV window (`policy.kv_window.CriticalWindow`): per engine its
members and the KV they count, the agents waiting for a place, and moving a member's KV when it
changes engine. Every decision is the policy's; this keeps the books it decides on.

A member's KV moves over the host link: its device part is copied to host memory and adopted by
the other engine's host tier, from which its next turn loads it (`SimKV.move`). The simulator
lets it move between any two engines at PCIe cost: engines on one node share host memory; across
nodes the copy goes over the NIC, which RDMA runs at about PCIe speed (400 Gb/s per GPU, ~50 GB/s,
against PCIe 5 x16's ~55 GB/s), its best case: BENCHMARKS.md says so beside the figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from venusrl.policy.critical_groups import TurnRates, critical
from venusrl.policy.kv_window import Agent, CriticalWindow, EngineLoad, GroupRanks, admission_key
from venusrl.sim.engine import SimEngine


class Member(Protocol):
    """A simulated trajectory as the window sees it (`executor.SimTrajectory`)."""

    tid: str
    index: int
    context: int
    engine: SimEngine | None
    member: bool
    counted: int

    @property
    def group_id(self) -> str: ...


M = TypeVar("M", bound=Member)


class Ranking(Protocol):
    """The coordinator's current ranking (`GroupBook`)."""

    order: tuple[str, ...]
    priorities: dict[str, int]

    def priority(self, group_id: str) -> int: ...


class KvWindows(Generic[M]):
    def __init__(
        self,
        policy: CriticalWindow,
        engines: list[SimEngine],
        ranking: Ranking,
        submit: Callable[[M, bool], None],
    ) -> None:
        """`submit(agent, resumed)`: its turn goes to its engine."""
        self.policy, self.engines, self.ranking, self.submit = policy, engines, ranking, submit
        self.members: list[set[M]] = [set() for _ in engines]
        self.load = [0] * len(engines)
        self.critical_load = [0] * len(engines)
        self.ready: dict[str, list[M]] = {}  # agents waiting for a place, by group
        self.waiting = 0  # tokens of their contexts
        self.rank = GroupRanks()
        self.critical_groups: list[str] = []  # in the ranking's order
        self.pauses = self.migrations = 0
        self.rates = TurnRates()  # the tool calls seen to return, for `leave_after_s`

    # --- what the policy sees ------------------------------------------------------------------

    def reranked(self) -> None:
        """The ranking changed: members' critical shares are counted again if the critical
        groups changed."""
        self.rank = GroupRanks(self.ranking.order)
        groups = [gid for gid, p in self.ranking.priorities.items() if critical(p)]
        if groups == self.critical_groups:
            return
        self.critical_groups, counted = groups, set(groups)
        for i, members in enumerate(self.members):
            self.critical_load[i] = sum(m.counted for m in members if m.group_id in counted)

    def _critical(self, t: M) -> bool:
        return critical(self.ranking.priority(t.group_id))

    def key(self, t: M) -> tuple[int, ...]:
        gid = t.group_id
        return admission_key(
            self.ranking.priority(gid), t.engine is not None, self.rank(gid), t.index
        )

    def agent(self, t: M, group: Agent | None = None) -> Agent:
        """`t` as the policy sees it; `group`: its group's priority and rank, if known."""
        if group is None:
            gid = t.group_id
            group = Agent(0, self.ranking.priority(gid), rank=self.rank(gid))
        home = t.engine.index if t.engine is not None else None
        return Agent(t.context, group.priority, home, t.counted, group.rank)

    def loads(self) -> list[EngineLoad]:
        return [
            EngineLoad(
                e.capacity * e.page_size,
                self.load[i],
                self.critical_load[i],
                len(self.members[i]),
            )
            for i, e in enumerate(self.engines)
        ]

    # --- events --------------------------------------------------------------------------------

    def turn(self, t: M) -> None:
        """`t` has a turn to run: a member goes on unless it yields (perhaps on a lighter
        engine); others wait for a place."""
        if t.member:
            assert t.engine is not None
            self._count(t, t.context)
            loads = self.loads()
            policy = self.policy.lanes(loads, self.waiting)
            me = self.agent(t)
            i = t.engine.index
            mine = self.key(t)
            ahead = sum(m.counted for m in self.members[i] if m is not t and self.key(m) < mine)
            rival = self._rival(me.priority)
            rival_agent = self.agent(rival) if rival is not None else None
            if not policy.yields(loads, ahead, me, rival_agent):
                lighter = policy.lighter(loads, me)
                if lighter is not None:
                    self.leave(t)
                    self._join(t, self.engines[lighter])
                self.submit(t, False)
                return
            self.leave(t)
            self.pauses += 1
        self.ready.setdefault(t.group_id, []).append(t)
        self.waiting += t.context
        self.admit()

    def leave_after_s(self) -> float:
        """How long a member may wait on a tool and keep its place, now."""
        return self.policy.leave_after_s(self.rates.tool_s_per_turn)

    def tool_returned(self, tool_s: float) -> None:
        """A member's tool call returned after `tool_s` (as the runtime's window measures it:
        from its turn's end to its next turn)."""
        self.rates.observe(0, 0.0, tool_s)

    def leave(self, t: M) -> None:
        """`t` gives its place up (a tool wait, a pause, its end)."""
        if not t.member:
            return
        assert t.engine is not None
        self._count(t, 0)
        t.member = False
        self.members[t.engine.index].discard(t)

    def admit(self) -> None:
        """Waiting agents take places in `admission_key` order, where the policy places them.

        An agent with no place refuses every later one of its kind with as large a context
        until the loads change: a place depends on the context (the larger, the fewer engines
        fit), on whether the agent is critical and of the head and, without migration, on its
        home. Asking the policy only once per kind keeps a long queue from costing a walk per
        turn."""
        loads = self.loads()
        policy = self.policy.lanes(loads, self.waiting)
        refused: dict[tuple[bool, bool, int | None], int] = {}  # kind -> the smallest refused
        for started, gid in self._walk():
            ready = self.ready.get(gid)
            if not ready:
                continue
            group = Agent(0, self.ranking.priority(gid), rank=self.rank(gid))
            for t in sorted(ready, key=lambda a: a.index):
                if (t.engine is not None) != started:
                    continue
                home = t.engine.index if t.engine is not None else None
                kind = (group.critical, policy.heads(group), None if policy.migrate else home)
                if t.context >= refused.get(kind, t.context + 1):
                    continue
                a = self.agent(t, group)
                i = policy.place(loads, a)
                if i is None:
                    refused[kind] = a.context
                    continue
                ready.remove(t)
                self.waiting -= t.context
                resumed = t.engine is not None
                self._join(t, self.engines[i])
                self.submit(t, resumed)
                loads, refused = self.loads(), {}
                policy = self.policy.lanes(loads, self.waiting)
            if not ready:
                del self.ready[gid]

    # --- the books -----------------------------------------------------------------------------

    def _walk(self) -> Iterable[tuple[bool, str]]:
        """(started, group) of the groups with waiting agents, in `admission_key` order:
        critical groups first; in each tier, started agents before new ones; then by rank."""
        priority, rank = self.ranking.priority, self.rank
        keys = [
            (admission_key(priority(gid), started, rank(gid), 0), started, gid)
            for gid in self.ready
            for started in (True, False)
        ]
        for _, started, gid in sorted(keys):
            yield started, gid

    def _rival(self, above: int) -> M | None:
        """The most critical waiting agent of a priority over `above` (None: none), whom a member
        of that priority may make way for. Ranks each group once (its members share all of
        `key` but whether they started and their index), and only the critical groups where
        only their agents can outrank: the other groups may be hundreds, waiting behind them."""
        priority, rank = self.ranking.priority, self.rank
        groups = self.critical_groups if critical(above + 1) else self.ready
        best: M | None = None
        best_key: tuple[int, ...] = ()
        for gid in groups:
            ready, p = self.ready.get(gid), priority(gid)
            if not ready or p <= above:
                continue
            t = min(ready, key=lambda a: (a.engine is None, a.index))
            key = admission_key(p, t.engine is not None, rank(gid), t.index)
            if best is None or key < best_key:
                best, best_key = t, key
        return best

    def _count(self, t: M, tokens: int) -> None:
        assert t.engine is not None
        i, change = t.engine.index, tokens - t.counted
        self.load[i] += change
        if self._critical(t):
            self.critical_load[i] += change
        t.counted = tokens

    def _join(self, t: M, e: SimEngine) -> None:
        if t.engine is not e:
            if t.engine is not None:
                self.migrations += 1
                t.engine.kv.move(t.tid, e.kv)
                t.engine.trajectories -= 1
            e.trajectories += 1
            t.engine = e
        t.member = True
        self.members[e.index].add(t)
        self._count(t, t.context)
