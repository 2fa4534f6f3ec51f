"""The simulator's adapter of the KV window (`coordinator.window_book.WindowBook`, the book
`venusrl train` keeps too): it tells the book what the simulated trajectories do and carries its
decisions out on the simulated engines.

A member's KV moves over the host link: its device part is copied to host memory and adopted by
the other engine's host tier, from which its next turn loads it (`SimKV.move`). The simulator
lets it move between any two engines at PCIe cost: engines on one node share host memory; across
nodes the copy goes over the NIC, which RDMA runs at about PCIe speed (400 Gb/s per GPU, ~50 GB/s,
against PCIe 5 x16's ~55 GB/s), its best case: BENCHMARKS.md says so beside the figures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

from venusrl.coordinator.window_book import Go, WindowBook
from venusrl.policy.kv_window import CriticalWindow
from venusrl.sim.engine import SimEngine


class Member(Protocol):
    """A simulated trajectory as the window sees it (`executor.SimTrajectory`)."""

    tid: str
    context: int  # tokens its next turn reads
    engine: SimEngine | None  # where its KV is (None: not started)

    @property
    def group_id(self) -> str: ...


M = TypeVar("M", bound=Member)


class KvWindows(Generic[M]):
    def __init__(
        self, policy: CriticalWindow, engines: list[SimEngine], submit: Callable[[M, bool], None]
    ) -> None:
        """`submit(agent, resumed)`: its turn goes to its engine."""
        self.engines, self.submit = engines, submit
        self.book = WindowBook(policy, [e.capacity * e.page_size for e in engines])
        self.asking: dict[str, M] = {}  # trajectories the book holds, by id

    def reranked(self, priorities: Mapping[str, int]) -> None:
        self._go(self.book.rerank(priorities))

    def turn(self, t: M) -> None:
        """`t` has a turn to run."""
        self.asking[t.tid] = t
        self._go(self.book.turn(t.tid, t.group_id, t.context))

    def tool_returned(self, tool_s: float) -> None:
        self.book.tool_returned(tool_s)

    def leave_after_s(self) -> float:
        return self.book.leave_after_s()

    def tool_wait_over(self, t: M) -> None:
        """`t` has waited `leave_after_s` on its tool: its place goes."""
        self._go(self.book.leave(t.tid))

    def end(self, t: M) -> None:
        """`t`'s turns are over."""
        self.asking.pop(t.tid, None)
        self._go(self.book.end(t.tid))

    def _go(self, gone: list[Go]) -> None:
        for go in gone:
            t, engine = self.asking[go.tid], self.engines[go.engine]
            if t.engine is not engine:
                if t.engine is not None:
                    t.engine.kv.move(t.tid, engine.kv)
                    t.engine.trajectories -= 1
                engine.trajectories += 1
                t.engine = engine
            self.submit(t, go.resumed)
