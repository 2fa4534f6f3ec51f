"""What the simulator's run (`sim/executor.py`) and its engines (`sim/engine.py`, `sim/kv.py`)
share: the virtual clock, the run's configuration, the counters engines add to, and a turn's
request as an engine holds it. A leaf: the engines are given these at construction instead of
reaching through the run, so that the run imports the engines and nothing imports the run.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, get_args

from venusrl.policy.engine_schedule import RequestView
from venusrl.types import WeightUpdate


@dataclass(frozen=True)
class SimConfig:
    steps: int = 4  # trainer steps to run
    warmup_steps: int = 1  # left out of the mean step time (the pipeline is filling)
    page_size: int = 64
    token_budget: int = 8192  # tokens per engine iteration (chunked prefill)
    max_running: int = 256
    max_infra_retries: int = 2
    max_merged_iterations: int = 512  # iterations of one repeated plan in one event, at most
    # Every iteration asks the scheduler (slow; the figures are the same, a test checks it).
    decide_every_iteration: bool = False
    waiting_head: int = 64  # waiting requests shown to the scheduler (the engine shows a head too)
    # Device-to-host copies run on a side stream beside the compute, as the engine's CUDA path
    # does (`engine/tier_copies.py`): an iteration waits only for copies longer than itself.
    overlap_copies: bool = True
    # How engines take new weights (`engine.weight_update`): "keep" loads them between two
    # iterations, requests in flight keeping their KV, and so do trajectories between turns;
    # "flush" then drops every KV no running request holds (vLLM's `reset_prefix_cache`,
    # SGLang's `flush_cache` after a weight update); "drain" first runs the requests in flight
    # to the end of their turn, admitting none, as engines that cannot update mid-request do.
    weight_update: WeightUpdate = "keep"

    def __post_init__(self) -> None:
        modes = get_args(WeightUpdate)
        if self.weight_update not in modes:
            raise ValueError(
                f"weight_update must be one of {', '.join(modes)}, got {self.weight_update!r}"
            )


class Clock:
    """Virtual time: callbacks run in the order of their times (ties in the order scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(t, self.now), next(self._seq), fn))

    def run(self, until: Callable[[], bool]) -> None:
        while self._queue and not until():
            self.now, _, fn = heapq.heappop(self._queue)
            fn()


@dataclass
class Counters:
    # Named as `Engine.counters` names the same totals, so a simulated run and a real one read
    # alike; `reprefill_tokens` is the sum over causes, `evictions` the simulator's own.
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    reprefill_tokens: int = 0
    reprefill_evicted_tokens: int = 0
    reprefill_preempted_tokens: int = 0
    offloaded_bytes: float = 0.0
    loaded_bytes: float = 0.0
    preemptions: int = 0
    evictions: int = 0  # radix-tree nodes that left the device (offloaded or dropped)
    # Turns after a tool call, and their seconds from arrival to first token, summed (as the
    # engine counts them, `Engine.counters`).
    tool_returns: int = 0
    tool_return_wait_s: float = 0.0
    iterations: int = 0
    decisions: int = 0
    moves_dropped: int = 0  # KV of a member moving engines that the other host tier had no room for


class TrajectoryRecord(Protocol):
    """What an engine reads and writes of the trajectory a request belongs to."""

    tid: str
    context: int  # tokens of its record so far: the engine adds what it samples when it lets go
    generated: int  # tokens sampled, all turns
    expected_cached: int  # tokens of its context the engine cached when it last let go of it


@dataclass(eq=False)
class SimRequest:
    """One turn's request, as the engine holds it: the trajectory's record so far as its prompt,
    the action to sample; `done` is called when the action is sampled."""

    rid: str
    traj: TrajectoryRecord
    arrival: int
    priority: int  # sent with the request, as the coordinator does: fixed from then on
    action_tokens: int  # tokens of the action to sample
    done: Callable[[], None] = field(repr=False)
    decode_left: int = field(init=False)  # tokens of the action still to sample
    recorded: int = 0  # tokens sampled and added to the trajectory's record (when it lets go)
    computed: int = 0  # tokens of the context with KV on the device for this request
    prefill_left: int = 0
    cached: int = 0  # of `computed`, the whole pages handed to the radix tree
    segments: list[int] = field(default_factory=list)  # its tree nodes, in tokens, root first
    resumed: bool = False  # it ran before and was preempted: KV it lost is a preemption's
    # When it arrived, for a turn after a tool call, until its first token is sampled.
    tool_returned_at: float | None = None
    lost_until: int = 0  # its prefill below this recomputes KV that was lost (a re-prefill)
    # Admission control reads where its context was found (not for a turn resumed after the
    # control paused its trajectory: what that lost is the pause's cost, not congestion).
    in_cache_signal: bool = True
    # The scheduler's view of it while it runs, updated in place at every decision (building
    # one for every running request at every decision was a tenth of the simulator's time).
    view: RequestView = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.decode_left = self.action_tokens
        self.view = RequestView(self.rid, self.priority, self.arrival, 0, 0, 0, 0)
