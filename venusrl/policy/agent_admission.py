"""Agent-level admission control: how many trajectories may be active on one engine at a time.

The Concur-like baseline (Chen et al., "CONCUR: High-Throughput Agentic Batch Inference of LLM via
Congestion-Based Concurrency Control", 2026). Long-lived agents accumulate KV; past some
concurrency the cache thrashes (an agent's KV is evicted between its turns and computed again when
it returns) well before memory is formally full. Concur bounds the number of active agents with a
congestion window driven by cache signals, like TCP: each control period the window grows by a
constant while the cache is healthy and shrinks by a factor when it thrashes. A new trajectory
starts only while the engine it is routed to has fewer active trajectories than its window; the
others wait. It knows nothing of groups or trainer batches.

Pure policy (DESIGN.md contract 1): the window is state the caller keeps; `next_window` maps the
current window and the period's signals to the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheSignal:
    """What one engine's KV cache did during the last control period."""

    occupancy: float  # device KV in use / capacity, at the end of the period
    reprefill_tokens: int  # tokens computed again because their KV had been evicted


@dataclass(frozen=True)
class AimdAdmission:
    initial_window: int = 8
    min_window: int = 1
    max_window: int = 4096
    increase: int = 1  # trajectories added per healthy period
    decrease: float = 0.5  # factor applied when the cache thrashes
    high_water: float = 0.95  # occupancy above which the cache counts as congested
    period_s: float = 5.0  # control period (about one agent turn: model turn plus tool call)

    def __post_init__(self) -> None:
        if not 1 <= self.min_window <= self.initial_window <= self.max_window:
            raise ValueError("need 1 <= min_window <= initial_window <= max_window")
        if not 0 < self.decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {self.decrease}")
        if self.increase < 1 or self.period_s <= 0:
            raise ValueError("increase must be >= 1 and period_s > 0")

    def next_window(self, window: int, signal: CacheSignal) -> int:
        if signal.reprefill_tokens > 0 or signal.occupancy > self.high_water:
            return max(self.min_window, math.floor(window * self.decrease))
        return min(self.max_window, window + self.increase)

    def admits(self, active: int, window: int) -> bool:
        return active < window
