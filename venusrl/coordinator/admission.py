"""Agent-level admission in the runtime: an episode starts only while the engine runs fewer
episodes than its window, and the window follows the engine's cache (`policy.agent_admission`).

Without it, every member of every open group runs at once; when their KV is more than the engine
holds, the cache thrashes (KV of trajectories waiting on a tool is evicted, and computed again or
loaded back when they return). The window bounds that concurrency: each control period it grows
while the cache is healthy and shrinks when it thrashes. The simulator runs the same policy
(`venusrl.sim`, `SimPolicy.admission`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from venusrl.policy.agent_admission import AimdAdmission, CacheSignal


class AdmissionWindow:
    def __init__(self, policy: AimdAdmission, signal: Callable[[], Awaitable[CacheSignal]]) -> None:
        """`signal`: what the engine's cache did since it was last called."""
        self.policy, self.signal = policy, signal
        self.window = policy.initial_window
        self.active = 0
        self.waiting = 0  # episodes held back, for the run's metrics
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Held for an episode's whole length; waits while the window is full."""
        async with self._changed:
            self.waiting += 1
            try:
                await self._changed.wait_for(lambda: self.policy.admits(self.active, self.window))
            finally:
                self.waiting -= 1
            self.active += 1
        try:
            yield
        finally:
            async with self._changed:
                self.active -= 1
                self._changed.notify_all()

    async def control(self) -> None:
        """The control loop: one window update a period, until cancelled."""
        while True:
            await asyncio.sleep(self.policy.period_s)
            signal = await self.signal()
            async with self._changed:
                self.window = self.policy.next_window(self.window, signal, self.active)
                self._changed.notify_all()
