"""What a pool's memory is committed to, and the admission of new sandboxes into it.

Every sandbox and zygote that holds memory is an entry with a cgroup of its own; a request waits
until the pure policy (`venusrl.policy.sandbox_admission`), given a snapshot of the entries'
measured footprints, the predicted peaks and the priorities, admits it. A group's members rank
with the group's current priority, waiting or running: the coordinator re-ranks open groups.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from venusrl.envs.accounts import PoolAccounts, SandboxRecord
from venusrl.envs.cgroups import Cgroup
from venusrl.envs.sandbox import Sandbox
from venusrl.envs.templates import Group
from venusrl.envs.types import AdmissionTimeout, GiB, SandboxError, TemplateSpec
from venusrl.envs.zygote_handle import Zygote
from venusrl.policy.sandbox_admission import (
    AdmissionDecision,
    FootprintAdmission,
    PeakEstimator,
    PendingSandbox,
    PoolSnapshot,
    QuotaAdmission,
    RunningSandbox,
)

ZYGOTE_PRIORITY = 1 << 30  # zygotes are never preemption victims while a sandbox is left


@dataclass
class Entry:
    """Something the pool's memory is committed to: a sandbox or a zygote."""

    key: str  # the estimator's template key
    own_priority: int  # a zygote's or a single sandbox's; a member ranks as its group (`priority`)
    seq: int
    declared_bytes: int
    cgroup: Cgroup
    record: SandboxRecord
    is_zygote: bool = False
    settled: bool = False  # a zygote whose setup is done: its footprint no longer grows
    footprint: int = 0
    sandbox: Sandbox | None = None
    group: Group | None = None  # a member's group, from its admission on
    private_zygote: Zygote | None = None  # the cold baseline's own interpreter

    @property
    def priority(self) -> int:
        """Its rank while it runs: a member's is its group's, which the coordinator re-ranks
        (the group holds it; nothing copies it)."""
        if self.group is not None and not self.is_zygote:
            return self.group.priority
        return self.own_priority


@dataclass(eq=False)
class _Pending:
    entry: Entry
    admitted: asyncio.Future[None]
    group: Group | None  # the group it is for (a member's or a zygote's): it waits at its rank

    @property
    def priority(self) -> int:
        return self.entry.priority if self.group is None else self.group.priority


class Admission:
    """The pool's running entries and waiting requests, and the policy that admits them."""

    def __init__(
        self,
        budget_bytes: int,
        kind: Literal["footprint", "quota"],
        safety_fraction: float,
        high_water_fraction: float,
        estimator: PeakEstimator | None,
        timeout_s: float,
        accounts: PoolAccounts,
        priors: Callable[[], Mapping[str, int]],
    ) -> None:
        """`priors`: the predicted peak per template key until the estimator has learned one."""
        if kind not in ("footprint", "quota"):
            raise ValueError(f"admission must be 'footprint' or 'quota', got {kind!r}")
        self.budget_bytes = budget_bytes
        self.kind = kind
        self.policy: FootprintAdmission | QuotaAdmission = (
            FootprintAdmission(safety_fraction, high_water_fraction)
            if kind == "footprint"
            else QuotaAdmission()
        )
        # Reserve for the typical sandbox (p90 of recent peaks + 20 %) from the first finished
        # one on; rare spikes go to the headroom above `safety_fraction`, and to high-water
        # preemption when several coincide or the first estimate was low.
        self.estimator = estimator or PeakEstimator(min_samples=1, quantile=0.9)
        self.timeout_s = timeout_s
        self.accounts = accounts
        self.priors = priors
        self.running: dict[str, Entry] = {}
        self.pending: list[_Pending] = []
        self._seq = itertools.count()

    def new_entry(
        self,
        key: str,
        priority: int,
        spec: TemplateSpec,
        cgroup: Cgroup,
        zygote: bool = False,
        record_id: str | None = None,
    ) -> Entry:
        sid = record_id or cgroup.rel.rsplit("/", 1)[-1]
        record = SandboxRecord(sid, spec.name, priority, time.monotonic())
        if not zygote:
            self.accounts.records.append(record)
        declared = spec.declared_memory_bytes
        return Entry(key, priority, next(self._seq), declared, cgroup, record, is_zygote=zygote)

    async def wait(self, entry: Entry, group: Group | None = None) -> None:
        """Wait until the policy admits this entry (bounded by the admission timeout); an entry
        for `group` (a member, or the group's zygote) waits at the group's priority as it is
        re-ranked."""
        need = self.peaks().get(entry.key, entry.declared_bytes)
        limit = self.budget_bytes * getattr(self.policy, "safety_fraction", 1.0)
        if need > limit:
            raise SandboxError(
                f"a {entry.key} sandbox reserves {need / GiB:.2f} GiB, more than this pool can "
                f"ever admit ({limit / GiB:.2f} GiB); lower the template's declared memory or "
                "raise the budget"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pending = _Pending(entry, fut, group)
        self.pending.append(pending)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except BaseException as e:  # timed out, or the caller gave up
            if pending in self.pending:
                self.pending.remove(pending)
            # else admitted meanwhile: the entry is running, and the pool closes it
            if not isinstance(e, TimeoutError):
                raise
            entry.record.outcome = "failed"
            raise AdmissionTimeout(
                f"no room for a {entry.key} sandbox within {self.timeout_s} s "
                f"(budget {self.budget_bytes / GiB:.2f} GiB, {len(self.running)} running)"
            ) from None

    def admit(self, request_ids: Iterable[str]) -> list[Entry]:
        """Move the admitted requests to the running entries, and wake their waiters."""
        admitted, now, out = set(request_ids), time.monotonic(), []
        for p in [p for p in self.pending if p.entry.record.sandbox_id in admitted]:
            self.pending.remove(p)
            p.entry.record.admitted_at = now
            self.running[p.entry.record.sandbox_id] = p.entry
            out.append(p.entry)
            if not p.admitted.done():
                p.admitted.set_result(None)
        return out

    def fail_waiting(self, error: Exception) -> None:
        for p in self.pending:
            if not p.admitted.done():
                p.admitted.set_exception(error)
                p.admitted.exception()  # its waiter may be gone already: nothing to log
        self.pending.clear()

    # --- measuring and deciding ---------------------------------------------------------------

    def settle(self, entry: Entry) -> None:
        """A zygote finished its setup: it will not grow, and its size teaches the estimator."""
        fp = entry.cgroup.memory_bytes()
        if entry.key.endswith(":zygote"):
            self.estimator.observe_finished(entry.key, fp)
        entry.settled = True
        entry.footprint = fp

    def measure(self, dt_s: float) -> int:
        """Read every entry's cgroup and integrate its record; the number of live sandboxes."""
        live = 0
        for entry in self.running.values():
            entry.footprint = entry.cgroup.memory_bytes()
            rec = entry.record
            rec.peak_bytes = max(rec.peak_bytes, entry.footprint)
            rec.byte_seconds += entry.footprint * dt_s
            live += not entry.is_zygote
        return live

    def expired(self, now: float, ttl_s: float) -> list[Sandbox]:
        return [
            e.sandbox
            for e in self.running.values()
            if e.sandbox is not None
            and e.record.ready_at is not None
            and now - e.record.ready_at > ttl_s
        ]

    def decide(self) -> AdmissionDecision:
        running = []
        for entry in self.running.values():
            if entry.is_zygote and self.kind == "quota":
                continue  # the baseline counts sandboxes by their declarations, nothing else
            key, declared = entry.key, entry.declared_bytes
            if entry.settled:  # reserve what it measures, no growth
                key, declared = f"settled:{entry.record.sandbox_id}", entry.footprint
            sid = entry.record.sandbox_id
            running.append(
                RunningSandbox(sid, key, entry.priority, entry.seq, entry.footprint, declared)
            )
        pending = [
            PendingSandbox(
                p.entry.record.sandbox_id,
                p.entry.key,
                p.priority,
                p.entry.seq,
                p.entry.declared_bytes,
            )
            for p in self.pending
        ]
        return self.policy.decide(PoolSnapshot(running, pending, self.budget_bytes, self.peaks()))

    def peaks(self) -> dict[str, int]:
        """Predicted peak per template key: learned online, else the template's prior."""
        return {**self.priors(), **self.estimator.predictions()}

    # --- closing accounts ---------------------------------------------------------------------

    def close_account(self, entry: Entry, outcome: str) -> bool:
        """Close the account of an entry that no longer holds memory; False if it was closed."""
        rec = entry.record
        if self.running.pop(rec.sandbox_id, None) is None and rec.closed_at is not None:
            return False
        rec.closed_at = time.monotonic()
        rec.outcome = outcome if rec.outcome not in ("preempted", "expired") else rec.outcome
        rec.peak_bytes = max(rec.peak_bytes, entry.cgroup.peak_memory_bytes())
        rec.oom_kills = entry.cgroup.oom_kills()
        if not entry.is_zygote and rec.ready_at is not None:
            # Preempted and crashed sandboxes teach too: their peak is at least what they reached.
            self.estimator.observe_finished(entry.key, rec.peak_bytes)
        return True

    def sandboxes_running(self) -> int:
        return sum(not e.is_zygote for e in self.running.values())

    def room_bytes(self) -> int:
        """Memory the pool could still admit into: its budget less what its sandboxes and
        zygotes hold and what waiting requests declare (what a cluster places groups by)."""
        held = sum(e.footprint for e in self.running.values())
        return self.budget_bytes - held - sum(p.entry.declared_bytes for p in self.pending)
