"""Agent-level admission in the runtime, on the in-process engine.

- `TurnWindow` (rollout.admission=critical, ours): the KV window of `policy.kv_window`, turn by
  turn: a trajectory runs a turn only while it holds a place, places go by the group ranking, a
  member in a long tool call gives its place up.
- `AdmissionWindow` (rollout.admission=aimd): an episode starts only while the engine runs fewer
  episodes than its window, and the window follows the engine's cache
  (`policy.agent_admission`).

Without it, every member of every open group runs at once; when their KV is more than the engine
holds, the cache thrashes (KV of trajectories waiting on a tool is evicted, and computed again or
loaded back when they return). The window bounds that concurrency: each control period it grows
while the cache is healthy and shrinks when it thrashes. The simulator runs the same policy
(`venusrl.sim`, `SimPolicy.admission`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from venusrl.policy.agent_admission import AimdAdmission, CacheSignal
from venusrl.policy.critical_groups import BEST_EFFORT, TurnRates, critical
from venusrl.policy.kv_window import (
    Agent,
    CriticalWindow,
    EngineLoad,
    GroupRanks,
    admission_key,
)
from venusrl.types import Generate, GenerationOutput, SamplingParams, TurnMeta


class AdmissionWindow:
    def __init__(self, policy: AimdAdmission, signal: Callable[[], Awaitable[CacheSignal]]) -> None:
        """`signal`: what the engine's cache did since it was last called."""
        self.policy, self.signal = policy, signal
        self.window = policy.initial_window
        self.active = 0
        self.waiting = 0  # episodes held back, for the run's metrics
        self.waits = 0  # episodes that were held back, since the start
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """Held for an episode's length; waits while the window is full. It gives the call
        that lets the slot go before the block ends (an episode whose turns are over, waiting
        for its reward): once, whoever calls it."""
        async with self._changed:
            self.waits += not self.policy.admits(self.active, self.window)
            self.waiting += 1
            try:
                await self._changed.wait_for(lambda: self.policy.admits(self.active, self.window))
            finally:
                self.waiting -= 1
            self.active += 1
        held = True

        async def release() -> None:
            nonlocal held
            if held:
                held = False
                self.active -= 1  # at once: a release cancelled while it waits for the lock
                async with self._changed:  # still lets the slot go
                    self._changed.notify_all()

        try:
            yield release
        finally:
            await release()

    async def control(self) -> None:
        """The control loop: one window update a period, until cancelled."""
        while True:
            await asyncio.sleep(self.policy.period_s)
            signal = await self.signal()
            async with self._changed:
                self.window = self.policy.next_window(self.window, signal, self.active)
                self._changed.notify_all()


@dataclass
class _Agent:
    tid: str
    group_id: str
    seq: int  # arrival order: the last tie-break
    context: int = 0  # tokens its next turn reads
    started: bool = False  # it has run a turn (its KV exists)
    member: bool = False  # holds a place
    counted: int = 0  # tokens its place counts
    leave: asyncio.TimerHandle | None = None  # its tool wait's end of membership
    tool_since: float | None = None  # when its tool call began (the loop's clock)


class TurnWindow:
    """The KV window of `policy.kv_window` on the in-process engine, turn by turn: a turn runs
    only while its trajectory holds a place, and places go by the group ranking
    (`set_ranking`). The simulator keeps the same books for many engines (`sim.kv_windows`);
    here there is one engine, so nothing migrates."""

    def __init__(self, policy: CriticalWindow, capacity_tokens: int) -> None:
        """`capacity_tokens`: the engine's device KV."""
        self.policy, self.capacity = policy, capacity_tokens
        self.agents: dict[str, _Agent] = {}  # trajectories not ended, by id
        self.waiting: dict[str, asyncio.Future[None]] = {}  # for a place
        self.priority: Mapping[str, int] = {}
        self.rank = GroupRanks()
        self.pauses = 0  # members that gave their place up at a turn boundary
        self.waits = 0  # turns that waited for a place
        self.rates = TurnRates()  # the tool calls seen to return, for `leave_after_s`
        self._seq = itertools.count()

    # --- what the coordinator and the agent loop call ------------------------------------------

    def set_ranking(self, priority: Mapping[str, int]) -> None:
        """The coordinator's last ranking: each open group's priority, in rank order."""
        self.priority = priority
        self.rank = GroupRanks(priority)
        self._admit()

    def gate(self, generate: Generate) -> Generate:
        """`generate`, each turn admitted by the window first."""

        async def windowed(
            prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
        ) -> GenerationOutput:
            tid = meta.trajectory_id
            if tid is None or meta.group_id is None:
                return await generate(prompt_ids, params, meta)
            await self.enter(tid, meta.group_id, len(prompt_ids))
            try:
                return await generate(prompt_ids, params, meta)
            finally:
                self.turn_done(tid)

        return windowed

    async def enter(self, tid: str, group_id: str, context: int) -> None:
        """Wait until trajectory `tid` may run a turn reading `context` tokens."""
        a = self.agents.get(tid)
        if a is None:
            a = self.agents[tid] = _Agent(tid, group_id, next(self._seq))
        if a.leave is not None:
            a.leave.cancel()
            a.leave = None
        if a.tool_since is not None:  # its tool call returned
            self.rates.observe(0, 0.0, asyncio.get_running_loop().time() - a.tool_since)
            a.tool_since = None
        a.context = context
        if a.member:
            a.counted = context
            if not self._yields(a):
                return
            self._leave(a)
            self.pauses += 1
        future = self.waiting[tid] = asyncio.get_running_loop().create_future()
        try:
            self._admit()
            if not future.done():
                self.waits += 1
            await future
        finally:
            self.waiting.pop(tid, None)
            if not future.done():  # cancelled while waiting
                future.cancel()

    def turn_done(self, tid: str) -> None:
        """Its turn ended and its tool call begins: a wait longer than the policy's
        `leave_after_s` (of the median call this window saw return) gives its place up."""
        a = self.agents.get(tid)
        if a is None:
            return
        loop = asyncio.get_running_loop()
        a.tool_since = loop.time()
        if not a.member:
            return
        a.started = True

        def leave() -> None:
            a.leave = None
            self._leave(a)
            self._admit()

        a.leave = loop.call_later(self.policy.leave_after_s(self.rates.tool_s_per_turn), leave)

    def end(self, tid: str) -> None:
        """The episode is over."""
        a = self.agents.pop(tid, None)
        if a is not None:
            if a.leave is not None:
                a.leave.cancel()
            self._leave(a)
            self._admit()

    @property
    def load(self) -> int:
        return sum(a.counted for a in self.agents.values())

    @property
    def members(self) -> int:
        return sum(a.member for a in self.agents.values())

    # --- the books -----------------------------------------------------------------------------

    def _key(self, a: _Agent) -> tuple[int, ...]:
        return (*admission_key(self._priority(a), a.started, self.rank(a.group_id), 0), a.seq)

    def _priority(self, a: _Agent) -> int:
        return self.priority.get(a.group_id, BEST_EFFORT)

    def _engine(self) -> EngineLoad:
        load = critical_load = members = 0
        for a in self.agents.values():  # one pass: asked at every turn
            load += a.counted
            critical_load += a.counted if critical(self._priority(a)) else 0
            members += a.member
        return EngineLoad(self.capacity, load, critical_load, members)

    def _as_agent(self, a: _Agent) -> Agent:
        started = 0 if a.started else None
        return Agent(a.context, self._priority(a), started, a.counted, self.rank(a.group_id))

    def _yields(self, a: _Agent) -> bool:
        mine = self._key(a)
        ahead = sum(b.counted for b in self.agents.values() if b.member and self._key(b) < mine)
        waiting = (self.agents[t] for t in self.waiting)
        rival = min(waiting, key=self._key, default=None)
        rival_agent = self._as_agent(rival) if rival is not None else None
        return self.policy.yields([self._engine()], ahead, self._as_agent(a), rival_agent)

    def _leave(self, a: _Agent) -> None:
        a.member, a.counted = False, 0

    def _admit(self) -> None:
        """Waiting trajectories take places in `admission_key` order while they fit."""
        for a in sorted((self.agents[t] for t in self.waiting), key=self._key):
            future = self.waiting[a.tid]
            if future.done():
                continue
            if self.policy.place([self._engine()], self._as_agent(a)) == 0:
                a.member, a.counted = True, a.context
                future.set_result(None)
