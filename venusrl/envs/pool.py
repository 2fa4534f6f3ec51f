"""A node's sandbox pool: warm templates, admission by measured footprint, accounting.

The pool owns one memory cgroup whose limit is its budget, so going over budget is a real OOM,
never a number on a dashboard. Under it: one cgroup per template zygote, per group zygote and per
sandbox. Every `poll_interval_s` the admission loop reads each cgroup's charge (~15 us each), feeds
the pure admission policy (`venusrl.policy.sandbox_admission`) a snapshot, and carries out its
decision: admit waiting requests, or preempt the lowest-priority sandboxes (freeze, kill, report
`SandboxPreempted` to their callers) before the kernel picks an OOM victim at random.

The rooms it is built from: `admission` (what memory is committed to), `templates` (warm
templates, groups and their zygotes), `accounts` (the figures behind a cost claim) and `orphans`
(what crashed pools left).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from venusrl.envs import syscalls
from venusrl.envs.accounts import PoolAccounts, PoolStats, SandboxRecord
from venusrl.envs.admission import ZYGOTE_PRIORITY, Admission, Entry
from venusrl.envs.cgroups import Cgroup, detect_version
from venusrl.envs.config import SandboxConfig
from venusrl.envs.orphans import (
    CGROUP_BASE,
    RUNTIME_BASE,
    private_dir,
    reap_orphans,
    watch_process,
)
from venusrl.envs.sandbox import Sandbox
from venusrl.envs.templates import IMAGE_ID_BASE, Group, Template, WarmStarts
from venusrl.envs.types import (
    GiB,
    InfraFailure,
    SandboxError,
    SandboxExpired,
    SandboxPreempted,
    SandboxStartError,
    TemplateSpec,
)
from venusrl.envs.zygote_handle import ZygoteError
from venusrl.images.oci import ImageError
from venusrl.images.store import ImageStore
from venusrl.policy.sandbox_admission import AdmissionDecision, PeakEstimator

log = logging.getLogger(__name__)
FORK_STATE_BYTES = 64 << 20  # interpreter state a fork carries over, pickled
PYTHON_TEMPLATE = TemplateSpec(
    name="python",
    setup="import json, math, os, re, sys\nimport numpy\nimport numpy as np\n",
    declared_memory_bytes=512 << 20,
    expected_memory_bytes=64 << 20,
)
_pool_ids = itertools.count()
# Image templates made for a task's image and no longer used by any group: the newest few stay
# warm (SWE-smith's and R2E-Gym's tasks share an image per repository), the rest are dropped.
IDLE_IMAGE_TEMPLATES = 4


def image_store(cfg: SandboxConfig) -> ImageStore:
    """The machine's layer cache and registry access as `sandbox.*` gives them."""
    return ImageStore(
        Path(cfg.image_cache_dir),
        int(cfg.image_cache_gib * GiB),
        IMAGE_ID_BASE,
        Path(cfg.registry_auth_file) if cfg.registry_auth_file else None,
        tuple(cfg.insecure_registries),
    )


class SandboxGroup(list[Sandbox]):
    """The sandboxes of one group (one task), forked from one warm zygote that ran the task's
    setup. Members can be added one at a time, as admission allows (`add`); the zygote lives until
    the group is closed, or, for `create_group`, until its last member is closed."""

    def __init__(self, pool: SandboxPool, state: Group) -> None:
        super().__init__()
        self._pool = pool
        self._state = state

    async def add(self) -> Sandbox:
        """One more member (a replacement, or the next one admission lets in)."""
        if self._state.released:
            raise SandboxError(f"group {self._state.group_id} is closed")
        t = self._pool._warm.template(self._state.template)
        sb = await self._pool._create_member(t, self._state, self._state.priority)
        self.append(sb)
        return sb

    def set_priority(self, priority: int) -> None:
        """The group's members, waiting for admission or running, rank at `priority` from now
        on: higher ones are admitted first and preempted last (the coordinator re-ranked it)."""
        self._state.priority = priority  # its members and their waits read it from there

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
        images: ImageStore | None = None,
    ) -> None:
        if memory_budget_bytes < 64 << 20:
            raise ValueError(f"memory_budget_bytes must be >= 64 MiB, got {memory_budget_bytes}")
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
        self.share_pages = share_pages
        self.start_timeout_s = start_timeout_s
        self.poll_interval_s = poll_interval_s
        self.ttl_s = ttl_s
        self.seccomp = syscalls.seccomp_available() if seccomp is None else seccomp
        self.name = f"pool-{os.getpid()}-{next(_pool_ids)}"
        bpf = syscalls.compile_seccomp() if self.seccomp else None
        self._warm = WarmStarts(RUNTIME_BASE / self.name, share_pages, sandbox_uid, bpf)
        self._images = images
        self._preparing: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}  # on-demand template -> groups and sandboxes using it
        self._idle: OrderedDict[str, None] = OrderedDict()  # on-demand templates nobody uses
        self._accounts = PoolAccounts(memory_budget_bytes)
        self._admission = Admission(
            memory_budget_bytes,
            admission,
            safety_fraction,
            high_water_fraction,
            estimator,
            admission_timeout_s,
            self._accounts,
            self._warm.member_priors,
        )
        if not self.seccomp:
            log.warning(
                "sandboxes run without a seccomp filter (%s): install libseccomp2 for it",
                "disabled" if seccomp is False else "libseccomp not found",
            )
        self._expired: list[Sandbox] = []
        self._ids = itertools.count()
        self._loop_task: asyncio.Task[None] | None = None
        self._last_tick = 0.0
        self._closed = False
        self._cgroup: Cgroup | None = None

    @classmethod
    def from_config(cls, cfg: SandboxConfig, budget_bytes: int | None = None) -> SandboxPool:
        """The pool `sandbox.*` describes (`budget_bytes` instead of its memory budget: a
        node's share)."""
        budget = budget_bytes or int(cfg.memory_budget_gib * GiB)
        return cls(budget, cfg.admission, cfg.share_pages, images=image_store(cfg))

    @property
    def records(self) -> list[SandboxRecord]:
        """Every sandbox asked of the pool, in the order asked."""
        return self._accounts.records

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
        watch_process(version)
        self._cgroup = Cgroup(f"{CGROUP_BASE}/{self.name}", version)
        self._cgroup.create()
        self._cgroup.limit(self.budget_bytes, None, None)
        private_dir(RUNTIME_BASE)
        self._warm.make_dirs()
        self._warm.launcher_cgroup = self._cgroup.child("launcher")
        self._accounts.started = self._last_tick = time.monotonic()
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
        self._admission.fail_waiting(SandboxError("the pool was closed"))
        self._tick()  # final accounting
        for entry in list(self._admission.running.values()):
            if entry.sandbox is not None:
                entry.sandbox.disconnect()
            self._finish(entry, "closed")
        for group in list(self._warm.groups.values()):
            self._release_group(group)
        await self._warm.close()
        for t in self._warm.templates.values():
            if t.root is not None and self._images is not None:
                self._images.put(t.root.image.ref)
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.remove)
        shutil.rmtree(self._warm.runtime, ignore_errors=True)

    # --- templates and groups -----------------------------------------------------------------

    @property
    def images(self) -> ImageStore:
        if self._images is None:  # made on first use: most pools run no image
            self._images = image_store(SandboxConfig())
        return self._images

    async def prepare_template(self, spec: TemplateSpec) -> None:
        """Write the template's files; with page sharing, start its zygote and run its setup.
        A template with an image pulls it first (`SandboxStartError` when it cannot)."""
        self._check_open()
        image = None
        if spec.image is not None:
            try:
                image = await self.images.get(spec.image)
            except ImageError as e:
                raise SandboxStartError(f"template {spec.name!r}: {e}") from None
        try:
            template = self._warm.add_template(spec, image)
        except (SandboxError, ImageError) as e:
            if image is not None:
                self.images.put(image.ref)
            raise SandboxStartError(f"template {spec.name!r}: {e}") from None
        if not self.share_pages:
            return
        assert self._cgroup is not None
        # Numbered: a dropped template's cgroup may still be going when it is prepared again.
        cgroup = self._cgroup.child(f"t{next(self._ids)}-{spec.name}")
        entry = self._admission.new_entry(
            f"{spec.estimates}:template", ZYGOTE_PRIORITY, spec, cgroup, zygote=True
        )
        self._admission.running[entry.record.sandbox_id] = entry  # set-up cost, not admitted
        template.zygote_entry = entry.record.sandbox_id
        try:
            await self._warm.start_template_zygote(template, cgroup)
        except (ZygoteError, OSError) as e:
            self._finish(entry, "failed")
            template.cgroup = template.cgroup or cgroup
            self._warm.forget(template)
            if image is not None:
                self.images.put(image.ref)
            raise SandboxStartError(f"template {spec.name!r}: setup failed:\n{e}") from None
        self._admission.settle(entry)

    async def _ensure_template(self, template: str | TemplateSpec) -> str:
        """The template's name, prepared: the built-in python one, or one given whole (a
        task's own image) the first time it is asked for."""
        if isinstance(template, str):
            if template == PYTHON_TEMPLATE.name and template not in self._warm.templates:
                await self.prepare_template(PYTHON_TEMPLATE)
            return template
        name = template.name
        async with self._preparing.setdefault(name, asyncio.Lock()):
            known = self._warm.templates.get(name)
            if known is None:
                await self.prepare_template(template)
                self._users[name] = 0
            elif known.spec != template:
                raise SandboxError(f"template {name!r} is prepared with another spec")
        if name in self._users:
            self._users[name] += 1
            self._idle.pop(name, None)
        return name

    def _template_done(self, name: str) -> None:
        """A group or sandbox of an on-demand template is gone; past the idle few, the least
        recently used unused template is dropped with its zygote and its hold on the image."""
        if name not in self._users:
            return
        self._users[name] -= 1
        if self._users[name] > 0:
            return
        self._idle[name] = None
        while len(self._idle) > IDLE_IMAGE_TEMPLATES:
            oldest, _ = self._idle.popitem(last=False)
            self._drop_template(oldest)

    def _drop_template(self, name: str) -> None:
        t = self._warm.template(name)
        self._users.pop(name, None)
        self._preparing.pop(name, None)
        entry = self._admission.running.get(t.zygote_entry or "")
        if entry is not None:
            self._finish(entry, "closed")
        self._warm.forget(t)
        if t.root is not None:
            self.images.put(t.root.image.ref)

    async def _start_group_zygote(self, t: Template, group: Group) -> None:
        assert self._cgroup is not None
        cgroup = self._cgroup.child(f"{group.group_id}-zygote")
        key = f"{t.spec.estimates}:zygote"
        entry = self._admission.new_entry(key, ZYGOTE_PRIORITY, t.spec, cgroup, zygote=True)
        group.zygote_entry = entry.record.sandbox_id
        await self._admit(entry, group)
        try:
            await self._warm.start_group_zygote(t, group, cgroup)
        except (ZygoteError, OSError) as e:
            self._finish(entry, "failed")
            self._release_group(group)
            raise SandboxStartError(f"group setup failed:\n{e}") from None
        self._admission.settle(entry)

    def _release_group(self, group: Group) -> None:
        if group.released:
            return
        zygote = self._admission.running.get(group.zygote_entry or "")
        if zygote is not None:
            self._finish(zygote, "closed")
        self._warm.release_group(group)
        if not self._closed:
            self._template_done(group.template)

    # --- creating sandboxes -------------------------------------------------------------------

    async def create(
        self,
        template: str | TemplateSpec,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> Sandbox:
        """One sandbox of a prepared template (by name), or of one given whole, prepared the
        first time. `setup`/`files` add a task's own setup on top of the template's."""
        if setup or files:
            (sb,) = await self.create_group(template, 1, priority, setup, files)
            return sb
        name = await self._ensure_template(template)
        try:
            return await self._create_member(self._warm.template(name), None, priority)
        except BaseException:
            self._template_done(name)
            raise

    async def create_group(
        self,
        template: str | TemplateSpec,
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
        template: str | TemplateSpec,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> SandboxGroup:
        """A group with no member yet: runs the task's setup once (in the group's zygote, with
        page sharing; a task with no setup forks from the template's); members come with
        `SandboxGroup.add`. `template` as for `create`."""
        name = await self._ensure_template(template)
        t = self._warm.template(name)
        gid = f"g{next(self._ids)}"
        try:
            group = self._warm.add_group(gid, name, priority, setup or "", files or {})
        except BaseException:
            self._template_done(name)
            raise
        # A task without setup of its own (files are a layer, not interpreter state) needs no
        # zygote of its own: its members fork from the template's.
        if self.share_pages and group.setup:
            await self._start_group_zygote(t, group)
        return SandboxGroup(self, group)

    async def _create_member(self, t: Template, group: Group | None, priority: int) -> Sandbox:
        assert self._cgroup is not None
        sid = f"sb{next(self._ids)}"
        cgroup = self._cgroup.child(sid)
        key = f"{t.spec.estimates}:{'member' if self.share_pages else 'cold'}"
        entry = self._admission.new_entry(key, priority, t.spec, cgroup, record_id=sid)
        await self._admit(entry, group)
        if group is not None:
            entry.group = group
            group.members += 1
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

    async def _spawn(self, t: Template, group: Group | None, entry: Entry) -> Sandbox:
        sid, cgroup = entry.record.sandbox_id, entry.cgroup
        sock, entry.private_zygote = await self._warm.spawn(t, group, sid, cgroup)
        sb = await Sandbox.connect(self, sid, t.spec.name, cgroup, sock, self.start_timeout_s)
        sb.image = t.root.image.config if t.root is not None else None
        return sb

    async def fresh_sandbox(self, sibling: Sandbox) -> Sandbox:
        entry = self._admission.running.get(sibling.id)
        if entry is None:
            raise SandboxError(f"sandbox {sibling.id} is not running")
        t = self._warm.template(sibling.template)
        if entry.group is None:
            self._users[t.spec.name] = self._users.get(t.spec.name, 0) + (
                t.spec.name in self._users
            )
        return await self._create_member(t, entry.group, entry.priority)

    async def fork_sandbox(self, parent: Sandbox) -> Sandbox:
        entry = self._admission.running.get(parent.id)
        if entry is None or not parent.alive:
            raise SandboxError(f"sandbox {parent.id} is not running")
        t = self._warm.template(parent.template)
        header, blobs = await parent.export_state(2 * t.spec.workspace_bytes + FORK_STATE_BYTES)
        child = await self._create_member(t, entry.group, entry.priority)
        try:
            await child.import_state(header, blobs)
        except BaseException:
            await child.close()
            raise
        child.dropped_state = list(header.get("dropped", []))
        return child

    # --- admission ----------------------------------------------------------------------------

    async def _admit(self, entry: Entry, group: Group | None = None) -> None:
        self._check_open()
        try:
            await self._admission.wait(entry, group)
        except BaseException:
            if entry.record.sandbox_id in self._admission.running:
                self._finish(entry, "failed")  # admitted meanwhile, but nobody will use it
            raise

    async def _admission_loop(self) -> None:
        while True:
            try:
                self._tick()
                expired, self._expired = self._expired, []
                for sb in expired:
                    await self.kill_sandbox(sb, SandboxExpired(f"sandbox {sb.id} outlived its TTL"))
                await self._apply(self._admission.decide())
            except Exception:  # one bad round (a cgroup that would not die) must not stop admission
                log.exception("sandbox pool %s: admission round failed", self.name)
            await asyncio.sleep(self.poll_interval_s)

    def _tick(self) -> None:
        """Measure every cgroup and integrate the accounts."""
        now = time.monotonic()
        dt = now - self._last_tick
        self._last_tick = now
        live = self._admission.measure(dt)
        physical = self._cgroup.memory_bytes() if self._cgroup is not None else None
        self._accounts.integrate(dt, live, physical)
        if self.ttl_s is not None:
            self._expired.extend(self._admission.expired(now, self.ttl_s))

    async def _apply(self, decision: AdmissionDecision) -> None:
        for sid in decision.preempt:
            entry = self._admission.running.get(sid)
            if entry is None or entry.is_zygote:
                continue
            if entry.sandbox is None:  # still starting: its creator sees SandboxPreempted
                self._accounts.preemptions += 1
                entry.record.outcome = "preempted"
                await asyncio.to_thread(entry.cgroup.kill)
                continue
            await self.preempt(entry.sandbox, "the pool's memory ran high")
        self._admission.admit(decision.admit)

    # --- ending sandboxes ---------------------------------------------------------------------

    async def preempt(self, sb: Sandbox, why: str) -> None:
        """Take a running sandbox down as the pool does under memory pressure: its caller sees
        `SandboxPreempted` (fault injection uses this to preempt on purpose)."""
        self._accounts.preemptions += 1
        error = SandboxPreempted(f"sandbox {sb.id} was preempted: {why}")
        await self.kill_sandbox(sb, error, "preempted")

    async def kill_sandbox(
        self, sb: Sandbox, error: InfraFailure, outcome: str = "crashed"
    ) -> None:
        """Take a sandbox down now (preemption, TTL, unresponsive); its callers see `error`."""
        entry = self._admission.running.get(sb.id)
        # Its user may never call close(): release what we can now.
        sb.disconnect(error)
        if entry is None:
            return
        entry.record.outcome = "expired" if isinstance(error, SandboxExpired) else outcome
        await asyncio.to_thread(entry.cgroup.kill)
        self._finish(entry, outcome)

    async def release_sandbox(self, sb: Sandbox) -> None:
        sb.disconnect()
        entry = self._admission.running.get(sb.id)
        if entry is not None:
            await asyncio.to_thread(entry.cgroup.kill)
            self._finish(entry, "closed")
        await asyncio.to_thread(sb.cgroup.remove)
        self._warm.remove_sandbox_dir(sb.id)

    def _finish(self, entry: Entry, outcome: str) -> None:
        """Close the account of a sandbox or zygote that no longer holds memory."""
        if not self._admission.close_account(entry, outcome):
            return
        if entry.private_zygote is not None:
            entry.private_zygote.close()
            entry.private_zygote = None
        group = entry.group
        if group is not None and not entry.is_zygote:
            group.members -= 1
            if group.members == 0 and group.release_when_empty:
                self._release_group(group)
        elif not entry.is_zygote and not self._closed:
            self._template_done(entry.record.template)  # a sandbox of its own

    # --- reading ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._cgroup is None:
            raise SandboxError("the pool is not running (use `async with SandboxPool(...)`)")

    def sandboxes_running(self) -> int:
        return self._admission.sandboxes_running()

    def template_memory_bytes(self, template: str) -> int:
        """What the template's zygote is charged: its interpreter and setup, and the page cache
        its start first read (every sandbox of the template shares both)."""
        t = self._warm.template(template)
        return t.cgroup.memory_bytes() if t.cgroup is not None else 0

    def room_bytes(self) -> int:
        """Memory the pool could still admit into: its budget less what its sandboxes and
        zygotes hold and what waiting requests declare (what a cluster places groups by)."""
        return self._admission.room_bytes()

    def sandboxes(self) -> list[Sandbox]:
        """The live sandboxes, oldest first."""
        return [e.sandbox for e in self._admission.running.values() if e.sandbox is not None]

    def stats(self) -> PoolStats:
        self._tick()
        live_ooms = sum(e.cgroup.oom_kills() for e in self._admission.running.values())
        if self._cgroup is not None:
            live_ooms += self._cgroup.oom_kills()
        running = self.sandboxes_running()
        return self._accounts.stats(time.monotonic(), running, live_ooms, self.seccomp)
