"""The KV window's books (`policy.kv_window.CriticalWindow`), one for the simulator and for
`venusrl train`: per engine its members and the KV they count, the agents waiting for a place,
and the group ranking they are ordered by.

Every decision is the policy's; the book keeps what it decides on and says what it decided:
which turns run now and on which engine (another than the one holding a member's KV: it moves).
The two adapters are thin: the simulator's (`sim/kv_windows.py`) and the runtime's
(`coordinator/admission.py`) say what happened (a turn asks to run, a tool call returned, a
member's tool wait ran long, an episode ended, the ranking changed) and carry the decisions out
on their engines, so the policy the simulator credits is the one the runtime runs, decision for
decision (tests/sim/test_kv_window_parity.py).

Ties between agents of one group go by arrival: the order in which they first asked for a
place. An agent has started once it holds a home engine: from its first place on, its KV exists.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from venusrl.policy.critical_groups import BEST_EFFORT, TurnRates, critical
from venusrl.policy.kv_window import Agent, CriticalWindow, EngineLoad, GroupRanks, admission_key


@dataclass(eq=False)
class Seat:
    """One trajectory as the window sees it."""

    tid: str
    group_id: str
    seq: int  # arrival: the last tie-break
    context: int = 0  # tokens its next turn reads
    home: int | None = None  # the engine holding its KV (None: not started)
    member: bool = False  # holds a place on `home`
    counted: int = 0  # tokens its place counts
    ready: bool = False  # waiting for a place


@dataclass(frozen=True)
class Go:
    """A turn that runs now, on `engine`."""

    tid: str
    engine: int
    resumed: bool = False  # it waited for its place after it had started


class WindowBook:
    def __init__(self, policy: CriticalWindow, capacities: Sequence[int]) -> None:
        """`capacities`: each engine's device KV, tokens."""
        if not capacities or min(capacities) <= 0:
            raise ValueError(f"every engine needs device KV, got capacities {list(capacities)}")
        self.policy, self.capacities = policy, list(capacities)
        self.seats: dict[str, Seat] = {}  # trajectories not ended, by id
        self.members: list[set[Seat]] = [set() for _ in capacities]
        self.load = [0] * len(capacities)
        self.critical_load = [0] * len(capacities)
        self.ready: dict[str, list[Seat]] = {}  # agents waiting for a place, by group
        self.waiting = 0  # tokens of their contexts
        self.priorities: Mapping[str, int] = {}
        self.rank = GroupRanks()
        self.critical_groups: list[str] = []  # in the ranking's order
        self.turns = 0  # turns let run
        self.pauses = 0  # members that gave their place up at a turn boundary
        self.waits = 0  # turns that waited for a place
        self.migrations = 0  # members that moved to another engine
        self.rates = TurnRates()  # the tool calls seen to return, for `leave_after_s`
        self._seq = itertools.count()

    # --- events --------------------------------------------------------------------------------

    def rerank(self, priorities: Mapping[str, int]) -> list[Go]:
        """The coordinator's ranking: each open group's priority, in rank order. The book
        reads it as it is (a group closed since counts as best-effort), and counts the members'
        critical shares again where the critical groups changed."""
        self.priorities, self.rank = priorities, GroupRanks(priorities)
        groups = [gid for gid, p in priorities.items() if critical(p)]
        if groups != self.critical_groups:
            self.critical_groups, counted = groups, set(groups)
            for i, members in enumerate(self.members):
                self.critical_load[i] = sum(m.counted for m in members if m.group_id in counted)
        return self.admit()

    def turn(self, tid: str, group_id: str, context: int) -> list[Go]:
        """`tid` has a turn to run, reading `context` tokens: a member goes on unless it yields
        (perhaps on a lighter engine); others wait for a place."""
        seat = self.seats.get(tid)
        if seat is None:
            seat = self.seats[tid] = Seat(tid, group_id, next(self._seq))
        if seat.ready:
            raise ValueError(f"trajectory {tid} asked for a turn while its last one waits")
        seat.context = context
        if seat.member:
            assert seat.home is not None
            home = seat.home
            self._count(seat, context)
            loads = self.loads()
            policy = self.policy.lanes(loads, self.waiting)
            me = self._agent(seat)
            mine = self._key(seat)
            ahead = sum(
                m.counted for m in self.members[home] if m is not seat and self._key(m) < mine
            )
            rival = self._rival(me.priority)
            if not policy.yields(loads, ahead, me, None if rival is None else self._agent(rival)):
                lighter = policy.lighter(loads, me)
                self.turns += 1
                if lighter is None:
                    return [Go(tid, home)]
                self._leave(seat)
                self._join(seat, lighter)
                return [Go(tid, lighter)]
            self._leave(seat)
            self.pauses += 1
        seat.ready = True
        self.ready.setdefault(group_id, []).append(seat)
        self.waiting += context
        gone = self.admit()
        self.waits += seat.ready
        return gone

    def tool_returned(self, tool_s: float) -> None:
        """A member's tool call returned after `tool_s` (from its turn's end to its next turn)."""
        self.rates.observe(0, 0.0, tool_s)

    def leave_after_s(self) -> float:
        """How long a member may wait on a tool and keep its place, now."""
        return self.policy.leave_after_s(self.rates.tool_s_per_turn)

    def leave(self, tid: str) -> list[Go]:
        """Member `tid`'s tool wait ran past `leave_after_s`: it gives its place up, and waiting
        agents come in. Nothing happens where it holds no place."""
        seat = self.seats.get(tid)
        if seat is None or not seat.member:
            return []
        self._leave(seat)
        return self.admit()

    def end(self, tid: str) -> list[Go]:
        """`tid`'s turns are over (or its episode was cancelled): its place goes, and waiting
        agents come in."""
        seat = self.seats.pop(tid, None)
        if seat is not None:
            self._leave(seat)
            if seat.ready:
                seat.ready = False
                self.waiting -= seat.context
                ready = self.ready[seat.group_id]
                ready.remove(seat)
                if not ready:
                    del self.ready[seat.group_id]
        return self.admit()

    def admit(self) -> list[Go]:
        """Waiting agents take places in `admission_key` order, where the policy places them.

        An agent with no place refuses every later one of its kind with as large a context
        until the loads change: a place depends on the context (the larger, the fewer engines
        fit), on whether the agent is critical and of the head and, without migration, on its
        home. Asking the policy only once per kind keeps a long queue from costing a walk per
        turn."""
        gone: list[Go] = []
        loads = self.loads()
        policy = self.policy.lanes(loads, self.waiting)
        refused: dict[tuple[bool, bool, int | None], int] = {}  # kind -> the smallest refused
        for started, gid in self._walk():
            ready = self.ready.get(gid)
            if not ready:
                continue
            group = Agent(0, self.priority(gid), rank=self.rank(gid))
            for seat in sorted(ready, key=lambda s: s.seq):
                home = seat.home
                if (home is not None) != started:
                    continue
                kind = (group.critical, policy.heads(group), None if policy.migrate else home)
                if seat.context >= refused.get(kind, seat.context + 1):
                    continue
                i = policy.place(loads, self._agent(seat, group))
                if i is None:
                    refused[kind] = seat.context
                    continue
                ready.remove(seat)
                seat.ready = False
                self.waiting -= seat.context
                self._join(seat, i)
                gone.append(Go(seat.tid, i, home is not None))
                self.turns += 1
                loads, refused = self.loads(), {}
                policy = self.policy.lanes(loads, self.waiting)
            if not ready:
                del self.ready[gid]
        return gone

    def counters(self) -> dict[str, int]:
        """What the window did since it started, as the step line names it."""
        return {
            "window_turns": self.turns,
            "window_pauses": self.pauses,
            "window_waits": self.waits,
            "window_migrations": self.migrations,
        }

    # --- what the policy sees ------------------------------------------------------------------

    def priority(self, group_id: str) -> int:
        return self.priorities.get(group_id, BEST_EFFORT)

    def loads(self) -> list[EngineLoad]:
        return [
            EngineLoad(capacity, self.load[i], self.critical_load[i], len(self.members[i]))
            for i, capacity in enumerate(self.capacities)
        ]

    def _key(self, s: Seat) -> tuple[int, ...]:
        gid = s.group_id
        return admission_key(self.priority(gid), s.home is not None, self.rank(gid), s.seq)

    def _agent(self, s: Seat, group: Agent | None = None) -> Agent:
        """`s` as the policy sees it; `group`: its group's priority and rank, if known."""
        if group is None:
            gid = s.group_id
            group = Agent(0, self.priority(gid), rank=self.rank(gid))
        return Agent(s.context, group.priority, s.home, s.counted, group.rank)

    def _walk(self) -> Iterable[tuple[bool, str]]:
        """(started, group) of the groups with waiting agents, in `admission_key` order:
        critical groups first; in each tier, started agents before new ones; then by rank."""
        priority, rank = self.priority, self.rank
        keys = [
            (admission_key(priority(gid), started, rank(gid), 0), started, gid)
            for gid in self.ready
            for started in (True, False)
        ]
        for _, started, gid in sorted(keys):
            yield started, gid

    def _rival(self, above: int) -> Seat | None:
        """The most critical waiting agent of a priority over `above` (None: none), whom a member
        of that priority may make way for. Ranks each group once (its members share all of the
        key but whether they started and their arrival), and only the critical groups where
        only their agents can outrank: the other groups may be hundreds, waiting behind them."""
        priority, rank = self.priority, self.rank
        groups = self.critical_groups if critical(above + 1) else self.ready
        best: Seat | None = None
        best_key: tuple[int, ...] = ()
        for gid in groups:
            ready, p = self.ready.get(gid), priority(gid)
            if not ready or p <= above:
                continue
            s = min(ready, key=lambda a: (a.home is None, a.seq))
            key = admission_key(p, s.home is not None, rank(gid), s.seq)
            if best is None or key < best_key:
                best, best_key = s, key
        return best

    def _count(self, s: Seat, tokens: int) -> None:
        assert s.home is not None
        i, change = s.home, tokens - s.counted
        self.load[i] += change
        if critical(self.priority(s.group_id)):
            self.critical_load[i] += change
        s.counted = tokens

    def _leave(self, s: Seat) -> None:
        if not s.member:
            return
        self._count(s, 0)
        s.member = False
        assert s.home is not None
        self.members[s.home].discard(s)

    def _join(self, s: Seat, engine: int) -> None:
        if s.home is not None and s.home != engine:
            self.migrations += 1
        s.home, s.member = engine, True
        self.members[engine].add(s)
        self._count(s, s.context)
