"""Whose idle KV leaves the device first, and whether it is dropped or moved to host memory.

Pure policy (DESIGN.md contract 1). When an engine needs device pages, it evicts idle KV: that of
trajectories waiting on a tool, and of finished ones. The policy orders the candidates and says,
for each, whether to drop it (it is computed again if needed: a re-prefill) or offload it to the
host tier (it is loaded back over PCIe: seconds cheaper at long context, WORKLOADS.md).

`LruRetention` is what a plain radix cache does (SGLang-like): least recently used first, always
dropped. A trajectory that waits seconds on a tool looks cold to it, so its whole context is
prefilled again when the observation returns.

`TrajectoryRetention` knows why the KV is idle (DESIGN.md, "Trajectory-aware radix cache"):
KV nobody will read again goes first, then best-effort work's, then KV whose retention pin (the
expected tool latency) has expired, and last the KV of high-priority trajectories still within
their pin. Pinned KV of a live trajectory is offloaded, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from venusrl.policy.critical_groups import critical


class IdleKV(NamedTuple):  # built for eviction candidates at every eviction: a cheap record
    key: str  # the trajectories it belongs to
    tokens: int
    priority: int  # the owner's, sent with its latest request
    last_use: float  # when it was last read or written (any increasing measure)
    pin_deadline: float | None  # while the owner waits on a tool: when the wait should be over
    finished: bool  # the owner's episode is over: no one reads this KV again


class RetentionPolicy(Protocol):
    def rank(self, entry: IdleKV, now: float) -> tuple[int, float]:
        """Sort key: the smallest leaves the device first."""
        ...

    def offload(self, entry: IdleKV, now: float) -> bool:
        """Move it to host memory (True) or drop it (False)?"""
        ...

    def reserved(self, entry: IdleKV, now: float) -> bool:
        """Is it off limits to best-effort work (which then runs in leftover capacity only)?"""
        ...


def eviction_key(policy: RetentionPolicy, entry: IdleKV, now: float) -> tuple[Any, float]:
    """The policy's rank, ties broken by last use: the order the engine's radix tree and the
    simulator evict in, the smallest first."""
    return (policy.rank(entry, now), entry.last_use)


def eviction_order(policy: RetentionPolicy, idle: Sequence[IdleKV], now: float) -> list[IdleKV]:
    """Candidates, the first to leave the device first."""
    return sorted(idle, key=lambda e: eviction_key(policy, e, now))


class LruRetention:
    def rank(self, entry: IdleKV, now: float) -> tuple[int, float]:
        return (0, entry.last_use)

    def offload(self, entry: IdleKV, now: float) -> bool:
        return False

    def reserved(self, entry: IdleKV, now: float) -> bool:
        return False


class TrajectoryRetention:
    def rank(self, entry: IdleKV, now: float) -> tuple[int, float]:
        if entry.finished:
            return (0, entry.last_use)
        pinned = entry.pin_deadline is not None and entry.pin_deadline > now
        if not critical(entry.priority):
            return (1 if not pinned else 2, entry.last_use)
        if not pinned:
            return (3, entry.last_use)
        return (4, -(entry.pin_deadline or 0.0))  # the owner due back last leaves first

    def offload(self, entry: IdleKV, now: float) -> bool:
        return not entry.finished

    def reserved(self, entry: IdleKV, now: float) -> bool:
        """High-priority KV within its pin: the KV the pin exists to keep."""
        return self.rank(entry, now)[0] == 4
