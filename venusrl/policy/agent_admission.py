"""Agent-level admission control: how many trajectories may be active on one engine at a time.

The Concur baseline (Chen et al., "CONCUR: High-Throughput Agentic Batch Inference of LLM via
Congestion-Based Concurrency Control", arXiv:2601.22705, 2026). Long-lived agents accumulate KV;
past some concurrency the cache thrashes (an agent's KV is evicted between its turns and computed
again when it returns) well before memory is formally full. Concur bounds the number of active
agents with a congestion window driven by cache signals, like TCP.

- `ConcurAdmission` is the paper's controller: each control period, the window grows by a constant
  while the KV cache is underused, shrinks by a factor when it thrashes (the share of returning
  context found in cache falls) or is nearly full, and holds in between; an agent over the window
  is paused at its next turn boundary and resumed when there is room (never mid-generation).
- `AimdAdmission` is our first Concur-like window (the runtime's `rollout.admission=aimd`): it
  only paces the start of new trajectories and halves on any re-prefill, so on long
  trajectories everything is admitted before the cache fills.

Ours bounds the KV the agents hold rather than their number, and chooses them by the group
ranking: `kv_window.CriticalWindow`.

Pure policy (DESIGN.md contract 1): the window is state the caller keeps; `next_window` maps the
current window, the period's signals and the agents active to the next window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True)
class CacheSignal:
    """What one engine's KV cache did during the last control period."""

    # Device KV of the trajectories admitted (running or between turns; not finished, not
    # paused: theirs is only cached) / capacity, at the end of the period.
    occupancy: float
    reprefill_tokens: int  # tokens computed again because their KV had been evicted
    # Tokens of context that returning turns had cached when they last ran (found again on the
    # device or host, or lost: `reprefill_tokens` of them); turns resumed after a pause are
    # left out (what they lost is the pause's cost, not congestion).
    reusable_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of reusable context found in cache (1 when nothing was reusable)."""
        if self.reusable_tokens <= 0:
            return 1.0
        return max(0.0, 1.0 - self.reprefill_tokens / self.reusable_tokens)


class AgentAdmission(Protocol):
    @property
    def initial_window(self) -> int: ...

    @property
    def period_s(self) -> float:
        """The control period."""
        ...

    @property
    def pauses(self) -> bool:
        """Are active agents over the window paused at their next turn boundary?"""
        ...

    def next_window(self, window: int, signal: CacheSignal, active: int) -> int: ...

    def admits(self, active: int, window: int) -> bool: ...


@dataclass(frozen=True)
class _Window:
    """What both windows share: the bounds, the AIMD step sizes, the congestion mark, the period
    and the admission rule (an agent runs while fewer than W do)."""

    initial_window: int = 8
    min_window: int = 1
    max_window: int = 4096
    increase: int = 1  # agents added per healthy period
    decrease: float = 0.5  # factor applied when the cache thrashes
    high_water: float = 0.95  # device KV occupancy above which the cache counts as congested
    period_s: float = 5.0  # control period (about one agent turn: model turn plus tool call)

    def __post_init__(self) -> None:
        if not 1 <= self.min_window <= self.initial_window <= self.max_window:
            raise ValueError("need 1 <= min_window <= initial_window <= max_window")
        if not 0 < self.decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {self.decrease}")
        if self.increase < 1 or self.period_s <= 0:
            raise ValueError("increase must be >= 1 and period_s > 0")
        if not 0 < self.high_water <= 1:
            raise ValueError(f"high_water must be in (0, 1], got {self.high_water}")

    def admits(self, active: int, window: int) -> bool:
        return active < window


@dataclass(frozen=True)
class ConcurAdmission(_Window):
    """The paper's controller, per engine; W the window, A the agents active, U the occupancy,
    H the hit rate of the period (`CacheSignal`):

        W' = max(min_window, floor(beta * min(W, A)))   if H < hit_floor or U > high_water
        W' = min(max_window, W + alpha)                  if U < low_water and A >= W
        W' = W                                           otherwise

    The paper describes AIMD on KV utilization and hit rate (linear exploration while
    underutilized, multiplicative reduction on thrashing, holding near saturation) without
    publishing its constants; these are ours: alpha = 1 agent and beta = 1/2 a period, as TCP's
    AIMD; a period of 5 s, about one agent turn (model turn plus tool call, WORKLOADS.md);
    low/high water 0.85/0.95 of device KV, a band wide enough for one turn's growth of the
    active agents; a hit floor of 0.95 (a healthy agent cache finds all of a returning turn's
    context). The window only grows while it binds (A >= W) and shrinks from what is in use
    (min(W, A)), as TCP validates its congestion window (RFC 7661): an idle window neither runs
    away nor takes periods to come down."""

    low_water: float = 0.85
    hit_floor: float = 0.95
    pauses: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.low_water <= self.high_water or not 0 <= self.hit_floor <= 1:
            raise ValueError(
                "need 0 < low_water <= high_water and hit_floor in [0, 1], got "
                f"{self.low_water}, {self.high_water}, {self.hit_floor}"
            )

    def next_window(self, window: int, signal: CacheSignal, active: int) -> int:
        if signal.hit_rate < self.hit_floor or signal.occupancy > self.high_water:
            return max(self.min_window, math.floor(min(window, active) * self.decrease))
        if signal.occupancy < self.low_water and active >= window:
            return min(self.max_window, window + self.increase)
        return window


@dataclass(frozen=True)
class AimdAdmission(_Window):
    """A start window: each period W' = max(min_window, floor(W / 2)) if any evicted KV was
    computed again or occupancy > high_water, else W + increase; a trajectory starts only while
    fewer than W run on its engine, and runs to its end once started."""

    pauses: ClassVar[bool] = False

    def next_window(self, window: int, signal: CacheSignal, active: int) -> int:
        if signal.reprefill_tokens > 0 or signal.occupancy > self.high_water:
            return max(self.min_window, math.floor(window * self.decrease))
        return min(self.max_window, window + self.increase)
