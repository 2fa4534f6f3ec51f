"""Criticality-ordered KV-budget admission (`venus`): which agents run, and on which engine.

Pure policy (DESIGN.md contract 1; "KV window" there). Concur (`agent_admission`) showed that
long-lived agents must be admitted by what the cache holds, not all at once: past some
concurrency their KV no longer fits between turns and is computed again. Concur bounds the
*number* of active agents per engine with a congestion window and resumes paused agents oldest
first. Ours bounds the *KV* they hold and lets the group ranking (`critical_groups`) decide who
is inside, so the agents whose groups unlock the next batch never wait for a place.

Per engine, with device KV capacity C tokens, each member counts its context c (what its next
turn reads); the engine's load L is the sum over its members, H the part of it held by members
of critical (HIGH) groups:

- **Budget.** An agent joins an engine only if L + c <= fill * C. The rest of the device holds
  the members' growth within a turn and the prefix cache.
- **The head.** The agents of the `head` most critical groups may fill an engine up to keep * C:
  the ranking puts first, of the groups the next batch needs, those with the longest paths left
  (`critical_groups`), and the batch waits for the last of them. Every group it needs is critical,
  so a waiting critical agent displaces no critical member; without this the head's agents waited
  for a place to free like any other (the slowest groups' last members waited ~800 s of their
  ~2,700 on swe-long, BENCHMARKS.md).
- **Keep.** At a turn boundary a member goes on unless the members ranked above it, with it,
  hold more than keep * C (the window shrank under it: its turns grew), or a more critical agent
  waits and has no place on any engine while this one's would fit it. A member that yields
  pauses; its KV goes to the host tier by retention, and it resumes by rank.
- **Tool waits leave.** A member whose tool call has run `leave_after_calls` times the median
  tool call (`leave_after_s`; the median of the calls the window saw return, `TurnRates`) gives
  its place up: a call that long is in the tail, whatever the tools' speed, and likely to run
  long again. Its KV stays on the device until the engine needs the pages, then goes to the
  host tier; it asks for a place again when its tool returns. Leaving earlier costs more than
  it frees: every short call that leaves moves its KV out and back (swe-long, three seeds:
  leaving at once 0.82x the speed of leaving after 5 s; after 2 s or 10 s 0.986x; BENCHMARKS.md).
- **Fast lanes.** Decode is bound by the KV a step reads, so a batch holding less KV runs each of
  its members faster. While KV is short (the members and the agents waiting for a place count
  more than the engines' budgets: `lanes`), on an engine with critical members, best-effort
  members may hold at most `lane` of the budget; a critical agent goes where critical agents
  already are while the lane has room and the engine stays at or below the mean load with it
  (packing them: a lane loaded above the mean is no fast lane; math-python's light engines
  packed all critical agents on one and lost 11 %), else to an engine without critical members,
  else the least loaded.
- **New agents** go to the engine with the fewest members (then the least loaded): every
  member's context grows to about the same, so a new agent's share of an engine's work to come is
  one member's, whatever the members hold now.
- **Rebalance.** At a turn boundary a member moves to the engine with the least of its device
  KV counted when that engine's share, with the member, stays `rebalance` of a device below the
  home's without it; its KV moves with it over the host link (`migrate`). A share, not tokens,
  so that the margin means the same on every device (400K tokens is half an H200's KV for
  Qwen3-4B, all of an H100's: there a margin in tokens would never move anyone).
- **Order.** Waiting agents are admitted by `admission_key`: critical groups first, then those
  already started (their KV exists) before new ones, then by the group ranking, then member.

The constants are ours, chosen on swe-long seeds 0-2 (BENCHMARKS.md) and held for every
scenario: fill 0.85 and keep 0.97 as Concur's low and high water marks; leave after 12 median
tool calls (5 s on swe-long, whose median call is 0.41 s), so that only the long tail of tool
calls leaves; a lane of 0.3:
with the ranking's spares (`critical_groups`) the critical groups once new weights are out are
the ones that complete the batch, and the lane keeps their engines light; only while KV is short,
since where every agent has room (swe-short) the lane starved best-effort work the next batch
soon needed (4 % lost with the spares, 7 % without; BENCHMARKS.md); a rebalance margin of half
a device's KV (383K tokens on swe-long), so that a member moves only off an engine far heavier
than the lightest (100K tokens, a few members' contexts, spent 3.5 % of the GPU on copies
against 2.3 % with 400K and was 2-3.5 % slower there, 1 % faster on search-long's seed 0); a
head of 8 groups, an eighth of swe-long's batch (16 gave the same step on seed 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from venusrl.policy.critical_groups import critical


@dataclass(frozen=True)
class EngineLoad:
    """One engine as the window sees it."""

    capacity: int  # device KV, tokens
    load: int  # tokens its members count
    critical: int  # of them, members of HIGH groups
    members: int = 0  # agents holding a place

    def share(self, more: int = 0) -> float:
        """Its device KV counted, with `more` tokens (fewer where negative), as a share."""
        return (self.load + more) / self.capacity


@dataclass(frozen=True)
class Agent:
    """A trajectory asking for a place, or a member at a turn boundary."""

    context: int  # tokens its next turn reads
    priority: int  # its group's (HIGH or BEST_EFFORT)
    home: int | None = None  # the engine holding its KV (None: not started)
    counted: int = 0  # tokens it counts now, as a member of `home` (0: not a member)
    rank: int | None = None  # its group's place in the ranking (0: the most critical)

    @property
    def critical(self) -> bool:
        return critical(self.priority)


class GroupRanks:
    """Each group's place in the coordinator's last ranking (0: the most critical); a group it
    has not ranked yet (opened since) comes after every ranked one."""

    def __init__(self, order: Iterable[str] = ()) -> None:
        self._places = {gid: i for i, gid in enumerate(order)}

    def __call__(self, group_id: str) -> int:
        return self._places.get(group_id, len(self._places))


def admission_key(priority: int, started: bool, group_rank: int, member: int) -> tuple[int, ...]:
    """The order waiting agents take places in (smallest first)."""
    return (-priority, not started, group_rank, member)


@dataclass(frozen=True)
class CriticalWindow:
    fill: float = 0.85
    keep: float = 0.97
    leave_after_calls: float = 12.0
    lane: float = 0.3
    rebalance: float = 0.5  # of a device's KV
    migrate: bool = True
    head: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.fill <= self.keep <= 1:
            raise ValueError(f"need 0 < fill <= keep <= 1, got {self.fill}, {self.keep}")
        if not 0 < self.lane <= 1:
            raise ValueError(f"lane must be in (0, 1], got {self.lane}")
        if self.leave_after_calls < 0 or self.rebalance < 0 or self.head < 0:
            raise ValueError("leave_after_calls, rebalance and head must be >= 0")

    def lanes(self, engines: Sequence[EngineLoad], waiting: int) -> CriticalWindow:
        """The window to decide with now: this one while the members' KV and the contexts of
        the agents waiting for a place (`waiting` tokens) are more than the engines' budgets
        hold, else the same without a lane. A lane makes critical members decode faster by
        keeping best-effort agents off their engines; when every agent has room, best-effort
        work kept out is work the next batch waits for (swe-short lost 4 % to it)."""
        if self.lane >= 1:
            return self
        demand = sum(e.load for e in engines) + waiting
        return self if demand > sum(self.budget(e) for e in engines) else self._laneless

    @cached_property
    def _laneless(self) -> CriticalWindow:
        return replace(self, lane=1.0)

    def leave_after_s(self, median_tool_s: float) -> float:
        """How long a member may wait on a tool and keep its place, when the median tool call
        is `median_tool_s`."""
        return self.leave_after_calls * median_tool_s

    def budget(self, e: EngineLoad) -> int:
        return int(self.fill * e.capacity)

    def heads(self, a: Agent) -> bool:
        """Is `a` of one of the `head` most critical groups (the batch's longest paths)?"""
        return a.critical and a.rank is not None and a.rank < self.head

    def fits(self, e: EngineLoad, a: Agent) -> bool:
        """Is there room for `a` on `e` (its own count there, as a member, already freed)? An
        engine with no member takes any agent: it runs alone, as far as the device holds. The
        head's agents may fill it up to `keep`."""
        load = e.load - a.counted
        if load == 0:
            return True
        room = int(self.keep * e.capacity) if self.heads(a) else self.budget(e)
        if load + a.context > room:
            return False
        lane = self.lane * self.budget(e)
        return a.critical or not e.critical or load + a.context <= lane

    def _lane_room(self, e: EngineLoad, a: Agent, own: int) -> bool:
        """Does critical `a` fit in `e`'s lane beside its other critical members?"""
        return e.critical - own + a.context <= self.lane * self.budget(e)

    def place(self, engines: Sequence[EngineLoad], a: Agent) -> int | None:
        """The engine `a` runs on (None: none has room). Its home while it fits there (a
        critical agent: within the lane); else, with migration or for a new agent, the best
        engine with room: for a critical agent one whose critical members it joins within the
        lane and the mean load, then one without critical members, the least loaded first; for
        a new best-effort agent the one with the fewest members, for a started one the least
        loaded."""
        home = a.home
        own = a.counted if a.critical else 0
        if home is not None:
            if self.fits(engines[home], a) and (
                not a.critical or not self.migrate or self._lane_room(engines[home], a, own)
            ):
                return home
            if not self.migrate:
                return None
        best: int | None = None
        best_key: tuple[int, ...] = ()
        fair = (sum(e.load for e in engines) - a.counted + a.context) / len(engines)
        for i, e in enumerate(engines):
            if not self.fits(e, a):
                continue
            if a.critical:
                mine = own if i == home else 0
                others = e.critical - mine
                packs = (
                    others > 0
                    and self._lane_room(e, a, mine)
                    and e.load - (a.counted if i == home else 0) + a.context <= fair
                )
                key: tuple[int, ...] = (not packs, others > 0, e.load)
            elif home is None:
                key = (e.members, e.load)
            else:
                key = (e.load,)
            if best is None or key < best_key:
                best, best_key = i, key
        return best

    def yields(
        self, engines: Sequence[EngineLoad], ahead: int, a: Agent, rival: Agent | None
    ) -> bool:
        """Does member `a`, at a turn boundary on its home engine, give its place up? `ahead`:
        tokens the members ranked above it count; `rival`: the most critical waiting agent (None
        also where none outranks `a`: only one that does can take its place)."""
        assert a.home is not None, "only a member yields"
        e = engines[a.home]
        if ahead + a.context > self.keep * e.capacity:
            return True
        if (
            not a.critical
            and e.critical
            and e.load - a.counted + a.context > self.lane * self.budget(e)
        ):
            return True
        if rival is None or rival.priority <= a.priority:
            return False
        if self.place(engines, rival) is not None:  # it has a place without a's
            return False
        if rival.home is not None and not self.migrate and rival.home != a.home:
            return False
        room = int(self.keep * e.capacity) if self.heads(rival) else self.budget(e)
        return ahead + rival.context <= room

    def lighter(self, engines: Sequence[EngineLoad], a: Agent) -> int | None:
        """An engine `a` would decode faster on, or None: the one with the least of its device KV
        counted, if its share with `a` stays `rebalance` below the home's without it."""
        if not self.migrate or a.home is None:
            return None
        i = min(range(len(engines)), key=lambda j: engines[j].share())
        if engines[i].share(a.context) + self.rebalance < engines[a.home].share(-a.counted):
            return i
        return None
