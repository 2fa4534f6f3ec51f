"""Agent-level admission in the runtime.

- `TurnWindow` (rollout.admission=critical, ours): the KV window of `policy.kv_window`, turn by
  turn, with the simulator's books (`window_book`): a trajectory runs a turn only while it holds
  a place, places go by the group ranking, a member in a long tool call gives its place up.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from venusrl.coordinator.window_book import Go, WindowBook
from venusrl.policy.agent_admission import AimdAdmission, CacheSignal
from venusrl.policy.kv_window import CriticalWindow
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
class _Between:
    """What the runtime times of a trajectory between its turns."""

    leave: asyncio.TimerHandle | None = None  # its tool wait's end of membership
    tool_since: float | None = None  # when its tool call began (the loop's clock)


class TurnWindow:
    """The KV window of `policy.kv_window` over the run's engines, turn by turn: a turn runs only
    while its trajectory holds a place, places go by the group ranking (`set_ranking`), and each
    turn goes to the engine its place is on. The books and every decision are
    `window_book.WindowBook`'s, the simulator's too; this adapter times tool waits and holds each
    waiting turn until the book lets it go. A member the book moves to another engine has its
    next turn's context computed there (its KV stays behind: the engines share no memory here)."""

    def __init__(self, policy: CriticalWindow, capacities: Sequence[int]) -> None:
        """`capacities`: each engine's device KV, tokens."""
        self.book = WindowBook(policy, capacities)
        self.waiting: dict[str, asyncio.Future[int]] = {}  # turns waiting for a place
        self._between: dict[str, _Between] = {}  # trajectories not ended, by id

    # --- what the coordinator and the agent loop call ------------------------------------------

    def set_ranking(self, priority: Mapping[str, int]) -> None:
        """The coordinator's last ranking: each open group's priority, in rank order."""
        self._go(self.book.rerank(priority))

    def gate(self, engines: Sequence[Generate]) -> Generate:
        """One generate over `engines` (one per capacity, in order): each turn admitted by the
        window first, then sent to the engine its place is on. A request outside any episode
        goes to the first engine, ungated."""
        if len(engines) != len(self.book.capacities):
            raise ValueError(f"{len(engines)} engines for {len(self.book.capacities)} capacities")

        async def windowed(
            prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
        ) -> GenerationOutput:
            tid = meta.trajectory_id
            if tid is None or meta.group_id is None:
                return await engines[0](prompt_ids, params, meta)
            engine = await self.enter(tid, meta.group_id, len(prompt_ids))
            try:
                return await engines[engine](prompt_ids, params, meta)
            finally:
                self.turn_done(tid)

        return windowed

    async def enter(self, tid: str, group_id: str, context: int) -> int:
        """Wait until trajectory `tid` may run a turn reading `context` tokens; the engine it
        runs on. A turn cancelled while it waits leaves the window (its episode is ending)."""
        between = self._between.setdefault(tid, _Between())
        if between.leave is not None:
            between.leave.cancel()
            between.leave = None
        loop = asyncio.get_running_loop()
        if between.tool_since is not None:  # its tool call returned
            self.book.tool_returned(loop.time() - between.tool_since)
            between.tool_since = None
        future = self.waiting[tid] = loop.create_future()
        try:
            self._go(self.book.turn(tid, group_id, context))
            return await future
        finally:
            self.waiting.pop(tid, None)
            # Still waiting (or cancelled with the task that awaited it): the book holds it.
            if not future.done() or future.cancelled():
                self.end(tid)

    def turn_done(self, tid: str) -> None:
        """Its turn ended and its tool call begins: a wait longer than the book's
        `leave_after_s` (of the median call this window saw return) gives its place up."""
        between = self._between.get(tid)
        if between is None:
            return
        loop = asyncio.get_running_loop()
        between.tool_since = loop.time()
        seat = self.book.seats.get(tid)
        if seat is not None and seat.member:
            between.leave = loop.call_later(self.book.leave_after_s(), self.tool_wait_over, tid)

    def tool_wait_over(self, tid: str) -> None:
        """`tid`'s tool call has run `leave_after_s`: its place goes to a waiting turn."""
        between = self._between.get(tid)
        if between is not None:
            between.leave = None
        self._go(self.book.leave(tid))

    def end(self, tid: str) -> None:
        """The episode is over."""
        between = self._between.pop(tid, None)
        if between is not None and between.leave is not None:
            between.leave.cancel()
        waiting = self.waiting.pop(tid, None)
        if waiting is not None:
            waiting.cancel()
        self._go(self.book.end(tid))

    @property
    def load(self) -> int:
        return sum(self.book.load)

    @property
    def members(self) -> int:
        return sum(len(m) for m in self.book.members)

    def _go(self, gone: list[Go]) -> None:
        for go in gone:
            future = self.waiting.get(go.tid)
            if future is not None and not future.done():
                future.set_result(go.engine)
