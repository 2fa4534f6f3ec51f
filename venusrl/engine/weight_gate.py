"""Generation and weight updates of a served engine that cannot tag tokens with the weight
version that sampled them (vLLM, SGLang): they never overlap, so every token of a request was
sampled under the one version the gate held while it ran.

An update waits for the requests in flight (one turn each, not whole episodes) and holds new
ones back until it is done; a waiting update goes before requests that arrive after it, so a
steady stream of turns cannot starve it. The price is the update's wait for the slowest turn in
flight; our own engine needs no gate (it records the version per token, `Engine.update_weights`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class WeightGate:
    def __init__(self, version: int) -> None:
        self.version = version
        self._running = 0  # requests in flight
        self._updating = False  # an update is waiting or running
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[int]:
        """Around one request: yields the version every token it samples is sampled with."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._running += 1
        try:
            yield self.version
        finally:
            async with self._changed:
                self._running -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def updating(self, version: int) -> AsyncIterator[None]:
        """Around one weight update: the body runs with no request in flight; the gate holds
        `version` after it, or the old one if it raised."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)  # one update at a time
            self._updating = True
        try:
            async with self._changed:  # cancelled here, the gate opens again all the same
                await self._changed.wait_for(lambda: self._running == 0)
            yield
            self.version = version
        finally:
            async with self._changed:
                self._updating = False
                self._changed.notify_all()
