"""A node's sandbox pool: warm templates, admission by measured footprint, accounting.

The pool owns one memory cgroup whose limit is its budget, so going over budget is a real OOM,
never a number on a dashboard. Under it: one cgroup per template zygote, per group zygote and per
sandbox. Every `poll_interval_s` the admission loop reads each cgroup's charge (~15 us each), feeds
the pure admission policy (`venusrl.policy.sandbox_admission`) a snapshot, and carries out its
decision: admit waiting requests, or preempt the lowest-priority sandboxes (freeze, kill, report
`SandboxPreempted` to their callers) before the kernel picks an OOM victim at random.

With `share_pages` (the default), a group's K sandboxes fork from one zygote that ran the
template's setup and then the group's own setup, so they share its pages copy-on-write. Without it,
every sandbox starts its own interpreter and runs the setups itself: the cold baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from venusrl.envs import isolation
from venusrl.envs.cgroups import Cgroup, detect_version
from venusrl.envs.sandbox import Sandbox, check_path
from venusrl.envs.types import (
    AdmissionTimeout,
    GiB,
    InfraFailure,
    SandboxError,
    SandboxExpired,
    SandboxPreempted,
    SandboxStartError,
    TemplateSpec,
)
from venusrl.envs.zygote import Zygote, ZygoteError
from venusrl.policy.sandbox_admission import (
    FootprintAdmission,
    PeakEstimator,
    PendingSandbox,
    PoolSnapshot,
    QuotaAdmission,
    RunningSandbox,
)

log = logging.getLogger(__name__)
CGROUP_BASE = "venusrl"
FORK_STATE_BYTES = 64 << 20  # interpreter state a fork carries over, pickled
RUNTIME_BASE = Path("/tmp/venusrl-sandboxes")
ZYGOTE_PRIORITY = 1 << 30  # zygotes are never preemption victims while a sandbox is left
PYTHON_TEMPLATE = TemplateSpec(
    name="python",
    setup="import json, math, os, re, sys\nimport numpy\nimport numpy as np\n",
    declared_memory_bytes=512 << 20,
    expected_memory_bytes=64 << 20,
)
_pool_ids = itertools.count()


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


@dataclass
class _Template:
    spec: TemplateSpec
    files_dir: str | None
    zygote: Zygote | None = None
    cgroup: Cgroup | None = None


@dataclass
class _Group:
    group_id: str
    template: str
    setup: str
    files_dir: str | None
    priority: int
    members: int = 0
    zygote: Zygote | None = None
    cgroup: Cgroup | None = None
    release_when_empty: bool = False  # set once no member will be added any more
    released: bool = False


@dataclass
class _Entry:
    """Something the pool's memory is committed to: a sandbox or a zygote."""

    key: str  # the estimator's template key
    priority: int
    seq: int
    declared_bytes: int
    cgroup: Cgroup
    record: SandboxRecord
    is_zygote: bool = False
    settled: bool = False  # a zygote whose setup is done: its footprint no longer grows
    footprint: int = 0
    sandbox: Sandbox | None = None
    group: _Group | None = None
    private_zygote: Zygote | None = None  # the cold baseline's own interpreter


@dataclass
class _Pending:
    request_id: str
    key: str
    priority: int
    arrival: int
    declared_bytes: int
    admitted: asyncio.Future[None]


class SandboxGroup(list[Sandbox]):
    """The sandboxes of one group (one task), forked from one warm zygote that ran the task's
    setup. Members can be added one at a time, as admission allows (`add`); the zygote lives until
    the group is closed, or, for `create_group`, until its last member is closed."""

    def __init__(self, pool: SandboxPool, state: _Group) -> None:
        super().__init__()
        self._pool = pool
        self._state = state

    async def add(self) -> Sandbox:
        """One more member (a replacement, or the next one admission lets in)."""
        if self._state.released:
            raise SandboxError(f"group {self._state.group_id} is closed")
        t = self._pool._template(self._state.template)
        sb = await self._pool._create_member(t, self._state, self._state.priority)
        self.append(sb)
        return sb

    async def close(self) -> None:
        self._state.release_when_empty = True
        await asyncio.gather(*(sb.close() for sb in self))
        if self._state.members == 0:
            self._pool._release_group(self._state)


class SandboxPool:
    def __init__(
        self,
        memory_budget_bytes: int,
        admission: Literal["footprint", "quota"] = "footprint",
        share_pages: bool = True,
        safety_fraction: float = 0.9,
        high_water_fraction: float = 0.95,
        admission_timeout_s: float = 300.0,
        start_timeout_s: float = 60.0,
        poll_interval_s: float = 0.02,
        ttl_s: float | None = None,
        estimator: PeakEstimator | None = None,
        sandbox_uid: int = 60_999,
        seccomp: bool | None = None,
    ) -> None:
        if memory_budget_bytes < 64 << 20:
            raise ValueError(f"memory_budget_bytes must be >= 64 MiB, got {memory_budget_bytes}")
        if admission not in ("footprint", "quota"):
            raise ValueError(f"admission must be 'footprint' or 'quota', got {admission!r}")
        for name, value in (
            ("admission_timeout_s", admission_timeout_s),
            ("start_timeout_s", start_timeout_s),
            ("poll_interval_s", poll_interval_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.budget_bytes = memory_budget_bytes
        self.admission = admission
        self.share_pages = share_pages
        self.policy: FootprintAdmission | QuotaAdmission = (
            FootprintAdmission(safety_fraction, high_water_fraction)
            if admission == "footprint"
            else QuotaAdmission()
        )
        # Reserve for the typical sandbox (p90 of recent peaks + 20 %) from the first finished
        # one on; rare spikes go to the headroom above `safety_fraction`, and to high-water
        # preemption when several coincide or the first estimate was low.
        self.estimator = estimator or PeakEstimator(min_samples=1, quantile=0.9)
        self.admission_timeout_s = admission_timeout_s
        self.start_timeout_s = start_timeout_s
        self.poll_interval_s = poll_interval_s
        self.ttl_s = ttl_s
        self.sandbox_uid = sandbox_uid
        self.seccomp = isolation.seccomp_available() if seccomp is None else seccomp
        if not self.seccomp:
            log.warning(
                "sandboxes run without a seccomp filter (%s): install libseccomp2 for it",
                "disabled" if seccomp is False else "libseccomp not found",
            )
        self.name = f"pool-{os.getpid()}-{next(_pool_ids)}"
        self.records: list[SandboxRecord] = []
        self._templates: dict[str, _Template] = {}
        self._running: dict[str, _Entry] = {}
        self._pending: list[_Pending] = []
        self._pending_entries: dict[str, _Entry] = {}
        self._groups: dict[str, _Group] = {}
        self._cleanups: set[asyncio.Future[object]] = set()
        self._expired: list[Sandbox] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._loop_task: asyncio.Task[None] | None = None
        self._started = 0.0
        self._last_tick = 0.0
        self._physical_byte_seconds = 0.0
        self._peak_physical = 0
        self._live_seconds = 0.0
        self._preemptions = 0
        self._closed = False
        self._cgroup: Cgroup | None = None
        self._runtime = RUNTIME_BASE / self.name

    # --- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if os.geteuid() != 0:
            raise PermissionError(
                "the local sandbox backend needs root (namespaces, cgroups, mounts)"
            )
        version = detect_version()
        reap_orphans(version)
        self._cgroup = Cgroup(f"{CGROUP_BASE}/{self.name}", version)
        self._cgroup.create()
        self._cgroup.limit(self.budget_bytes, None, None)
        _private_dir(RUNTIME_BASE)
        self._runtime.mkdir(mode=0o700)  # never reuse a directory someone else made
        for sub in ("templates", "groups", "sandboxes"):
            (self._runtime / sub).mkdir()
        self._started = self._last_tick = time.monotonic()
        self._loop_task = asyncio.create_task(self._admission_loop())

    async def close(self) -> None:
        """Kill every sandbox and zygote, remove every cgroup and directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        for p in self._pending:
            if not p.admitted.done():
                p.admitted.set_exception(SandboxError("the pool was closed"))
                p.admitted.exception()  # its waiter may be gone already: nothing to log
        self._pending.clear()
        self._tick()  # final accounting
        for entry in list(self._running.values()):
            if entry.sandbox is not None:
                entry.sandbox._shutdown_channel()
            self._finish(entry, "closed")
        for group in list(self._groups.values()):
            self._release_group(group)
        for t in self._templates.values():
            if t.zygote is not None:
                t.zygote.close()
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.remove)
        shutil.rmtree(self._runtime, ignore_errors=True)

    # --- templates ----------------------------------------------------------------------------

    async def prepare_template(self, spec: TemplateSpec) -> None:
        """Write the template's files; with page sharing, start its zygote and run its setup."""
        self._check_open()
        if spec.name in self._templates:
            raise SandboxError(f"template {spec.name!r} is already prepared")
        files_dir = self._write_files(self._runtime / "templates" / spec.name, spec.files)
        template = _Template(spec, files_dir)
        self._templates[spec.name] = template
        if not self.share_pages:
            return
        assert self._cgroup is not None
        cgroup = self._cgroup.child(f"t-{spec.name}")
        entry = self._new_entry(f"{spec.name}:template", ZYGOTE_PRIORITY, spec, cgroup, zygote=True)
        self._running[entry.record.sandbox_id] = entry  # set-up cost, outside admission
        try:
            cgroup.create()
            cgroup.limit(spec.declared_memory_bytes, 64, spec.cpus)
            template.zygote = await Zygote.start(cgroup.procs_files())
            template.cgroup = cgroup
            await template.zygote.setup(spec.name, spec.setup, spec.setup_timeout_s)
        except (ZygoteError, OSError) as e:
            del self._templates[spec.name]
            self._finish(entry, "failed")
            if template.zygote is not None:
                template.zygote.close()
            await asyncio.to_thread(cgroup.remove)
            if files_dir:
                shutil.rmtree(files_dir, ignore_errors=True)
            raise SandboxStartError(f"template {spec.name!r}: setup failed:\n{e}") from None
        self._settle(entry)

    def _template(self, name: str) -> _Template:
        if name not in self._templates:
            known = ", ".join(sorted(self._templates)) or "none"
            raise SandboxError(f"unknown template {name!r} (prepared: {known})")
        return self._templates[name]

    # --- creating sandboxes -------------------------------------------------------------------

    async def create(
        self,
        template: str,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> Sandbox:
        """One sandbox. `setup`/`files` add a task's own setup on top of the template's."""
        if setup or files:
            (sb,) = await self.create_group(template, 1, priority, setup, files)
            return sb
        await self._ensure_template(template)
        return await self._create_member(self._template(template), None, priority)

    async def create_group(
        self,
        template: str,
        k: int,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> SandboxGroup:
        """K sibling sandboxes for one task: with page sharing, one zygote runs the task's setup
        and the K members fork from it. If a member cannot start, the others are closed."""
        if not isinstance(k, int) or k < 1:
            raise SandboxError(f"k must be a positive integer, got {k!r}")
        group = await self.open_group(template, priority, setup, files)
        results = await asyncio.gather(*(group.add() for _ in range(k)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await group.close()
            raise errors[0]
        group._state.release_when_empty = True
        return group

    async def open_group(
        self,
        template: str,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> SandboxGroup:
        """A group with no member yet: runs the task's setup once (in the group's zygote, with
        page sharing); members come with `SandboxGroup.add`."""
        await self._ensure_template(template)
        t = self._template(template)
        gid = f"g{next(self._ids)}"
        files_dir = self._write_files(self._runtime / "groups" / gid, files or {})
        group = _Group(gid, template, setup or "", files_dir, priority)
        self._groups[gid] = group
        if self.share_pages:
            await self._start_group_zygote(t, group)
        return SandboxGroup(self, group)

    async def _ensure_template(self, name: str) -> None:
        if name == PYTHON_TEMPLATE.name and name not in self._templates:
            await self.prepare_template(PYTHON_TEMPLATE)

    async def _start_group_zygote(self, t: _Template, group: _Group) -> None:
        assert self._cgroup is not None and t.zygote is not None
        cgroup = self._cgroup.child(f"{group.group_id}-zygote")
        entry = self._new_entry(
            f"{t.spec.name}:zygote", ZYGOTE_PRIORITY, t.spec, cgroup, zygote=True
        )
        await self._admit(entry, group.priority)
        try:
            cgroup.create()
            cgroup.limit(t.spec.declared_memory_bytes, 64, t.spec.cpus)
            group.zygote = await t.zygote.fork(cgroup.procs_files())
            group.cgroup = cgroup
            await group.zygote.setup(group.group_id, group.setup, t.spec.setup_timeout_s)
        except (ZygoteError, OSError) as e:
            self._finish(entry, "failed")
            self._release_group(group)
            raise SandboxStartError(f"group setup failed:\n{e}") from None
        self._settle(entry)
        entry.group = group

    async def _create_member(
        self, t: _Template, group: _Group | None, priority: int, sid: str | None = None
    ) -> Sandbox:
        assert self._cgroup is not None
        sid = sid or f"sb{next(self._ids)}"
        cgroup = self._cgroup.child(sid)
        key = f"{t.spec.name}:{'member' if self.share_pages else 'cold'}"
        entry = self._new_entry(key, priority, t.spec, cgroup, record_id=sid)
        await self._admit(entry, priority)
        if group is not None:
            group.members += 1
            entry.group = group
        try:
            if group is not None and group.released:
                raise SandboxError(f"group {group.group_id} was closed")
            cgroup.create()
            cgroup.limit(t.spec.declared_memory_bytes, t.spec.max_pids, t.spec.cpus)
            sb = await asyncio.wait_for(self._spawn(t, group, entry), self.start_timeout_s)
        except BaseException as e:  # cancelled included: nothing of it may stay reserved
            preempted = entry.record.outcome == "preempted"
            self._finish(entry, "preempted" if preempted else "failed")
            with contextlib.suppress(Exception):
                await asyncio.to_thread(cgroup.remove)
            if preempted:
                raise SandboxPreempted(f"sandbox {sid} was preempted while starting") from None
            if isinstance(e, SandboxError | asyncio.CancelledError) or not isinstance(e, Exception):
                raise
            raise SandboxStartError(f"sandbox {sid} ({t.spec.name}) did not start: {e}") from None
        entry.sandbox = sb
        entry.record.ready_at = time.monotonic()
        entry.record.outcome = "running"
        return sb

    async def _spawn(self, t: _Template, group: _Group | None, entry: _Entry) -> Sandbox:
        sid, cgroup = entry.record.sandbox_id, entry.cgroup
        root = self._runtime / "sandboxes" / sid
        root.mkdir()
        lower = [d for d in (group.files_dir if group else None, t.files_dir) if d]
        cfg = isolation.IsolationConfig(
            cgroup_procs=cgroup.procs_files(),
            root_dir=str(root),
            host_uid=self.sandbox_uid,
            lower_dirs=lower,
            workspace_bytes=t.spec.workspace_bytes,
            tmp_bytes=t.spec.tmp_bytes,
            env=dict(t.spec.env),
            seccomp=self.seccomp,
        )
        if self.share_pages:
            zygote = group.zygote if group is not None else t.zygote
            assert zygote is not None
            sock = await zygote.spawn(asdict(cfg))
        else:
            # The cold baseline: a fresh interpreter in the sandbox's own cgroup runs the setups,
            # then becomes the sandbox. It stays as the sandbox's parent and dies with it.
            zygote = entry.private_zygote = await Zygote.start(cgroup.procs_files())
            await zygote.setup(t.spec.name, t.spec.setup, t.spec.setup_timeout_s)
            if group is not None and group.setup:
                await zygote.setup(group.group_id, group.setup, t.spec.setup_timeout_s)
            sock = await zygote.spawn(asdict(cfg))
        sb = Sandbox(self, sid, t.spec.name, entry.priority, cgroup, sock)
        await sb._connect(self.start_timeout_s)
        return sb

    async def _fork(self, parent: Sandbox) -> Sandbox:
        entry = self._running.get(parent.id)
        if entry is None or not parent.alive:
            raise SandboxError(f"sandbox {parent.id} is not running")
        t = self._template(parent.template)
        header, blobs = await parent.export_state(2 * t.spec.workspace_bytes + FORK_STATE_BYTES)
        child = await self._create_member(t, entry.group, parent.priority)
        try:
            await child.import_state(header, blobs)
        except BaseException:
            await child.close()
            raise
        child.dropped_state = list(header.get("dropped", []))  # type: ignore[attr-defined]
        return child

    # --- admission ----------------------------------------------------------------------------

    def _new_entry(
        self,
        key: str,
        priority: int,
        spec: TemplateSpec,
        cgroup: Cgroup,
        zygote: bool = False,
        record_id: str | None = None,
    ) -> _Entry:
        sid = record_id or cgroup.rel.rsplit("/", 1)[-1]
        record = SandboxRecord(sid, spec.name, priority, time.monotonic())
        if not zygote:
            self.records.append(record)
        declared = spec.declared_memory_bytes
        return _Entry(key, priority, next(self._seq), declared, cgroup, record, is_zygote=zygote)

    async def _admit(self, entry: _Entry, priority: int) -> None:
        """Wait until the policy admits this entry (bounded by `admission_timeout_s`)."""
        self._check_open()
        need = self._peaks().get(entry.key, entry.declared_bytes)
        limit = self.budget_bytes * getattr(self.policy, "safety_fraction", 1.0)
        if need > limit:
            raise SandboxError(
                f"a {entry.key} sandbox reserves {need / GiB:.2f} GiB, more than this pool can "
                f"ever admit ({limit / GiB:.2f} GiB); lower the template's declared memory or "
                "raise the budget"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pending = _Pending(
            entry.record.sandbox_id, entry.key, priority, entry.seq, entry.declared_bytes, fut
        )
        self._pending.append(pending)
        self._pending_entries[pending.request_id] = entry
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.admission_timeout_s)
        except BaseException as e:  # timed out, or the caller gave up
            if pending in self._pending:
                self._pending.remove(pending)
                self._pending_entries.pop(pending.request_id, None)
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                self._finish(entry, "failed")  # admitted meanwhile, but nobody will use it
            if not isinstance(e, TimeoutError):
                raise
            entry.record.outcome = "failed"
            raise AdmissionTimeout(
                f"no room for a {entry.key} sandbox within {self.admission_timeout_s} s "
                f"(budget {self.budget_bytes / GiB:.2f} GiB, {len(self._running)} running)"
            ) from None

    def _settle(self, entry: _Entry) -> None:
        """A zygote finished its setup: it will not grow, and its size teaches the estimator."""
        fp = entry.cgroup.memory_bytes()
        if entry.key.endswith(":zygote"):
            self.estimator.observe_finished(entry.key, fp)
        entry.settled = True
        entry.footprint = fp

    async def _admission_loop(self) -> None:
        while True:
            try:
                self._tick()
                expired, self._expired = self._expired, []
                for sb in expired:
                    await self._kill(sb, SandboxExpired(f"sandbox {sb.id} outlived its TTL"))
                await self._apply(self._decide())
            except Exception:  # one bad round (a cgroup that would not die) must not stop admission
                log.exception("sandbox pool %s: admission round failed", self.name)
            await asyncio.sleep(self.poll_interval_s)

    def _tick(self) -> None:
        """Measure every cgroup and integrate the accounts."""
        now = time.monotonic()
        dt = now - self._last_tick
        self._last_tick = now
        for entry in self._running.values():
            entry.footprint = entry.cgroup.memory_bytes()
            rec = entry.record
            rec.peak_bytes = max(rec.peak_bytes, entry.footprint)
            rec.byte_seconds += entry.footprint * dt
            if not entry.is_zygote:
                self._live_seconds += dt
        if self._cgroup is not None:
            physical = self._cgroup.memory_bytes()
            self._physical_byte_seconds += physical * dt
            self._peak_physical = max(self._peak_physical, physical)
        if self.ttl_s is not None:
            for entry in list(self._running.values()):
                sb, ready = entry.sandbox, entry.record.ready_at
                if sb is not None and ready is not None and now - ready > self.ttl_s:
                    self._expired.append(sb)

    def _decide(self) -> Any:
        running = []
        for entry in self._running.values():
            if entry.is_zygote and self.admission == "quota":
                continue  # the baseline counts sandboxes by their declarations, nothing else
            key, declared = entry.key, entry.declared_bytes
            if entry.settled:  # reserve what it measures, no growth
                key, declared = f"settled:{entry.record.sandbox_id}", entry.footprint
            running.append(
                RunningSandbox(
                    entry.record.sandbox_id,
                    key,
                    entry.priority,
                    entry.seq,
                    entry.footprint,
                    declared,
                )
            )
        pending = [
            PendingSandbox(p.request_id, p.key, p.priority, p.arrival, p.declared_bytes)
            for p in self._pending
        ]
        snap = PoolSnapshot(running, pending, self.budget_bytes, self._peaks())
        return self.policy.decide(snap)

    def _peaks(self) -> dict[str, int]:
        """Predicted peak per template key: learned online, else the template's prior."""
        priors = {
            f"{t.spec.name}:member": t.spec.expected_memory_bytes
            for t in self._templates.values()
            if t.spec.expected_memory_bytes is not None
        }
        return {**priors, **self.estimator.predictions()}

    async def _apply(self, decision: Any) -> None:
        for sid in decision.preempt:
            entry = self._running.get(sid)
            if entry is None or entry.is_zygote:
                continue
            if entry.sandbox is None:  # still starting: its creator sees SandboxPreempted
                self._preemptions += 1
                entry.record.outcome = "preempted"
                await asyncio.to_thread(entry.cgroup.kill)
                continue
            await self.preempt(entry.sandbox, "the pool's memory ran high")
        admitted = set(decision.admit)
        now = time.monotonic()
        for p in [p for p in self._pending if p.request_id in admitted]:
            self._pending.remove(p)
            entry = self._pending_entries.pop(p.request_id)
            entry.record.admitted_at = now
            self._running[p.request_id] = entry
            if not p.admitted.done():
                p.admitted.set_result(None)

    # --- ending sandboxes ---------------------------------------------------------------------

    async def preempt(self, sb: Sandbox, why: str) -> None:
        """Take a running sandbox down as the pool does under memory pressure: its caller sees
        `SandboxPreempted` (fault injection uses this to preempt on purpose)."""
        self._preemptions += 1
        await self._kill(sb, SandboxPreempted(f"sandbox {sb.id} was preempted: {why}"), "preempted")

    async def _kill(self, sb: Sandbox, error: InfraFailure, outcome: str = "crashed") -> None:
        """Take a sandbox down now (preemption, TTL, unresponsive); its caller sees `error`."""
        entry = self._running.get(sb.id)
        if entry is not None:
            entry.record.outcome = "expired" if isinstance(error, SandboxExpired) else outcome
        sb._fail(error)
        if entry is None:
            return
        await asyncio.to_thread(entry.cgroup.kill)
        self._finish(entry, outcome)
        sb._shutdown_channel()  # the owner may never call close(): release what we can now

    async def _release(self, sb: Sandbox) -> None:
        sb._shutdown_channel()
        entry = self._running.get(sb.id)
        if entry is not None:
            await asyncio.to_thread(entry.cgroup.kill)
            self._finish(entry, "closed")
        await asyncio.to_thread(sb.cgroup.remove)
        with contextlib.suppress(OSError):
            (self._runtime / "sandboxes" / sb.id).rmdir()

    def _finish(self, entry: _Entry, outcome: str) -> None:
        """Close the account of a sandbox or zygote that no longer holds memory."""
        rec = entry.record
        if self._running.pop(rec.sandbox_id, None) is None and rec.closed_at is not None:
            return
        rec.closed_at = time.monotonic()
        rec.outcome = outcome if rec.outcome not in ("preempted", "expired") else rec.outcome
        rec.peak_bytes = max(rec.peak_bytes, entry.cgroup.peak_memory_bytes())
        rec.oom_kills = entry.cgroup.oom_kills()
        if not entry.is_zygote and rec.ready_at is not None:
            # Preempted and crashed sandboxes teach too: their peak is at least what they reached.
            self.estimator.observe_finished(entry.key, rec.peak_bytes)
        if entry.private_zygote is not None:
            entry.private_zygote.close()
            entry.private_zygote = None
        group = entry.group
        if group is not None and not entry.is_zygote:
            group.members -= 1
            if group.members == 0 and group.release_when_empty:
                self._release_group(group)

    def _release_group(self, group: _Group) -> None:
        if group.released:
            return
        group.released = True
        self._groups.pop(group.group_id, None)
        if group.zygote is not None:
            group.zygote.close()
            group.zygote = None
        if group.cgroup is not None:
            zygote_entry = self._running.get(group.cgroup.rel.rsplit("/", 1)[-1])
            if zygote_entry is not None:
                self._finish(zygote_entry, "closed")
            self._in_background(group.cgroup.remove)
        if group.files_dir:
            self._in_background(functools.partial(shutil.rmtree, group.files_dir, True))

    def _in_background(self, cleanup: Callable[[], object]) -> None:
        """Blocking cleanup (killing, rmdir retries) off the event loop; `close` waits for it."""
        task = asyncio.ensure_future(asyncio.to_thread(cleanup))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    # --- helpers ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._cgroup is None:
            raise SandboxError("the pool is not running (use `async with SandboxPool(...)`)")

    def _write_files(self, where: Path, files: Mapping[str, bytes]) -> str | None:
        """Workspace files as a read-only overlay layer, owned by the sandbox user so that
        copy-up keeps them writable inside."""
        if not files:
            return None
        # Checked before anything is written: a directory left half-written by a refused file
        # made every later prepare_template of that name fail with FileExistsError instead.
        for path, data in files.items():
            check_path(path)
            if not isinstance(data, bytes):
                raise SandboxError(f"file {path!r}: content must be bytes")
        where.mkdir(parents=True)
        for path, data in files.items():
            target = where / path
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            except OSError as e:  # "a" and "a/b": one path is a file, the other needs a directory
                shutil.rmtree(where, ignore_errors=True)
                problem = f"cannot be written beside the others ({e.strerror})"
                raise SandboxError(f"file {path!r}: {problem}") from None
        for root, dirs, names in os.walk(where):
            for name in dirs + names + [""]:
                os.lchown(os.path.join(root, name), self.sandbox_uid, self.sandbox_uid)
        return str(where)

    def sandboxes_running(self) -> int:
        return sum(not e.is_zygote for e in self._running.values())

    def room_bytes(self) -> int:
        """Memory the pool could still admit into: its budget less what its sandboxes and
        zygotes hold and what waiting requests declare (what a cluster places groups by)."""
        held = sum(e.footprint for e in self._running.values())
        return self.budget_bytes - held - sum(p.declared_bytes for p in self._pending)

    def sandboxes(self) -> list[Sandbox]:
        """The live sandboxes, oldest first."""
        return [e.sandbox for e in self._running.values() if e.sandbox is not None]

    def stats(self) -> PoolStats:
        self._tick()
        wall = max(time.monotonic() - self._started, 1e-9)
        records = self.records
        waits = [r.admission_wait_s for r in records if r.admission_wait_s is not None]
        latencies = [r.create_latency_s for r in records if r.create_latency_s is not None]
        ooms = sum(e.cgroup.oom_kills() for e in self._running.values()) + sum(
            r.oom_kills for r in records if r.closed_at is not None
        )
        if self._cgroup is not None:
            ooms += self._cgroup.oom_kills()
        return PoolStats(
            wall_s=wall,
            budget_bytes=self.budget_bytes,
            sandboxes_created=sum(r.ready_at is not None for r in records),
            sandboxes_running=self.sandboxes_running(),
            mean_concurrent=self._live_seconds / wall,
            sandbox_seconds=self._live_seconds,
            physical_gb_seconds=self._physical_byte_seconds / GiB,
            node_gb_seconds=self.budget_bytes * wall / GiB,
            peak_physical_bytes=self._peak_physical,
            mean_create_latency_s=sum(latencies) / len(latencies) if latencies else 0.0,
            mean_admission_wait_s=sum(waits) / len(waits) if waits else 0.0,
            max_admission_wait_s=max(waits, default=0.0),
            preemptions=self._preemptions,
            oom_kills=ooms,
            seccomp=self.seccomp,
        )


def _private_dir(path: Path) -> None:
    """Root's own directory, not a symlink, writable by nobody else: the pool creates, chowns
    and removes files under it as root, so nobody else may plant anything there."""
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise PermissionError(
            f"{path} must be a directory owned by root and writable only by it; remove it"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_pool_names(names: Iterator[str]) -> list[str]:
    dead = []
    for name in names:
        parts = name.split("-")
        is_pool = len(parts) == 3 and parts[0] == "pool" and parts[1].isdigit()
        if is_pool and not _pid_alive(int(parts[1])):
            dead.append(name)
    return dead


def reap_orphans(version: int) -> list[str]:
    """Kill and remove what pools of crashed processes left behind: cgroups, directories."""
    base = Cgroup(CGROUP_BASE, version)
    reaped = []
    if base.exists():
        names = (d.name for d in base.dirs()[0].iterdir() if d.is_dir())
        for name in _dead_pool_names(names):
            try:
                base.child(name).remove()
            except (RuntimeError, OSError) as e:  # a process stuck in the kernel: not our run's
                log.warning("could not reap the cgroup of dead pool %s: %s", name, e)
                continue
            reaped.append(name)
    if RUNTIME_BASE.exists():
        for name in _dead_pool_names(d.name for d in RUNTIME_BASE.iterdir()):
            shutil.rmtree(RUNTIME_BASE / name, ignore_errors=True)
            reaped.append(name)
    return sorted(set(reaped))
