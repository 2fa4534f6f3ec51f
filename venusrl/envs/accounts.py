"""A pool's accounts, the figures behind a cost claim: one record per sandbox, and integrals over
the pool's life (sandbox-seconds, the physical GB-seconds it held against what the node costs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from venusrl.envs.types import GiB


@dataclass
class SandboxRecord:
    """One sandbox's account: the figures behind a cost claim."""

    sandbox_id: str
    template: str
    priority: int
    requested_at: float
    admitted_at: float | None = None
    ready_at: float | None = None
    closed_at: float | None = None
    peak_bytes: int = 0
    byte_seconds: float = 0.0
    oom_kills: int = 0
    outcome: str = "waiting"  # running | closed | preempted | expired | crashed | failed

    @property
    def admission_wait_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.requested_at

    @property
    def create_latency_s(self) -> float | None:
        if self.ready_at is None or self.admitted_at is None:
            return None
        return self.ready_at - self.admitted_at


@dataclass(frozen=True)
class PoolStats:
    wall_s: float
    budget_bytes: int
    sandboxes_created: int
    sandboxes_running: int
    mean_concurrent: float  # time-averaged number of live sandboxes
    sandbox_seconds: float
    physical_gb_seconds: float  # integral of the pool cgroup's charge (zygotes included)
    node_gb_seconds: float  # budget x wall time: what the node costs whether used or not
    peak_physical_bytes: int
    mean_create_latency_s: float
    mean_admission_wait_s: float
    max_admission_wait_s: float
    preemptions: int
    oom_kills: int
    seccomp: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def merge(pools: Sequence[PoolStats]) -> PoolStats:
        """Several pools as one (the rollout workers of a Ray fleet): totals and integrals
        summed, peaks and the wall time their largest, means weighted by the sandboxes each pool
        created; seccomp only if every pool has it."""
        if not pools:
            raise ValueError("no pool statistics to merge")
        created = sum(p.sandboxes_created for p in pools)

        def weighted(mean: Callable[[PoolStats], float]) -> float:
            return sum(mean(p) * p.sandboxes_created for p in pools) / created if created else 0.0

        return PoolStats(
            wall_s=max(p.wall_s for p in pools),
            budget_bytes=sum(p.budget_bytes for p in pools),
            sandboxes_created=created,
            sandboxes_running=sum(p.sandboxes_running for p in pools),
            mean_concurrent=sum(p.mean_concurrent for p in pools),
            sandbox_seconds=sum(p.sandbox_seconds for p in pools),
            physical_gb_seconds=sum(p.physical_gb_seconds for p in pools),
            node_gb_seconds=sum(p.node_gb_seconds for p in pools),
            peak_physical_bytes=max(p.peak_physical_bytes for p in pools),
            mean_create_latency_s=weighted(lambda p: p.mean_create_latency_s),
            mean_admission_wait_s=weighted(lambda p: p.mean_admission_wait_s),
            max_admission_wait_s=max(p.max_admission_wait_s for p in pools),
            preemptions=sum(p.preemptions for p in pools),
            oom_kills=sum(p.oom_kills for p in pools),
            seccomp=all(p.seccomp for p in pools),
        )


class PoolAccounts:
    """The records of every sandbox the pool was asked for, and the integrals of its ticks."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.records: list[SandboxRecord] = []
        self.started = 0.0
        self.preemptions = 0
        self._physical_byte_seconds = 0.0
        self._peak_physical = 0
        self._live_seconds = 0.0

    def integrate(self, dt_s: float, live_sandboxes: int, physical_bytes: int | None) -> None:
        """`dt_s` seconds with `live_sandboxes` up and the pool's cgroup charged `physical_bytes`
        (None before the pool has a cgroup)."""
        self._live_seconds += live_sandboxes * dt_s
        if physical_bytes is not None:
            self._physical_byte_seconds += physical_bytes * dt_s
            self._peak_physical = max(self._peak_physical, physical_bytes)

    def stats(self, now: float, running: int, live_oom_kills: int, seccomp: bool) -> PoolStats:
        """`live_oom_kills`: those of the cgroups still up (closed records carry their own)."""
        wall = max(now - self.started, 1e-9)
        records = self.records
        waits = [r.admission_wait_s for r in records if r.admission_wait_s is not None]
        latencies = [r.create_latency_s for r in records if r.create_latency_s is not None]
        ooms = live_oom_kills + sum(r.oom_kills for r in records if r.closed_at is not None)
        return PoolStats(
            wall_s=wall,
            budget_bytes=self.budget_bytes,
            sandboxes_created=sum(r.ready_at is not None for r in records),
            sandboxes_running=running,
            mean_concurrent=self._live_seconds / wall,
            sandbox_seconds=self._live_seconds,
            physical_gb_seconds=self._physical_byte_seconds / GiB,
            node_gb_seconds=self.budget_bytes * wall / GiB,
            peak_physical_bytes=self._peak_physical,
            mean_create_latency_s=sum(latencies) / len(latencies) if latencies else 0.0,
            mean_admission_wait_s=sum(waits) / len(waits) if waits else 0.0,
            max_admission_wait_s=max(waits, default=0.0),
            preemptions=self.preemptions,
            oom_kills=ooms,
            seccomp=seccomp,
        )
