"""A pool's warm templates and groups: their files, their zygotes, and the process each sandbox
starts as.

With page sharing, a template's zygote runs the template's setup once, a group's zygote forks from
it and runs the task's setup, and a sandbox forks from its group's zygote (or the template's), so
they share those pages copy-on-write. Without it, each sandbox starts a cold interpreter of its
own that runs the setups itself: the baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from venusrl.envs import isolation
from venusrl.envs.cgroups import Cgroup
from venusrl.envs.sandbox import check_path
from venusrl.envs.types import SandboxError, TemplateSpec
from venusrl.envs.zygote import Zygote

ZYGOTE_PIDS = 64  # a zygote forks sandboxes; it runs nothing of the model's


@dataclass
class Template:
    spec: TemplateSpec
    files_dir: str | None
    zygote: Zygote | None = None
    cgroup: Cgroup | None = None


@dataclass
class Group:
    group_id: str
    template: str
    setup: str
    files_dir: str | None
    priority: int
    members: int = 0
    zygote: Zygote | None = None
    cgroup: Cgroup | None = None
    zygote_entry: str | None = None  # the zygote's account in the pool's admission
    release_when_empty: bool = False  # set once no member will be added any more
    released: bool = False


class WarmStarts:
    """The templates and open groups of one pool, under its runtime directory."""

    def __init__(self, runtime: Path, share_pages: bool, sandbox_uid: int, seccomp: bool) -> None:
        self.runtime = runtime
        self.share_pages = share_pages
        self.sandbox_uid = sandbox_uid
        self.seccomp = seccomp
        self.templates: dict[str, Template] = {}
        self.groups: dict[str, Group] = {}
        self._cleanups: set[asyncio.Future[object]] = set()

    def make_dirs(self) -> None:
        self.runtime.mkdir(mode=0o700)  # never reuse a directory someone else made
        for sub in ("templates", "groups", "sandboxes"):
            (self.runtime / sub).mkdir()

    # --- templates ----------------------------------------------------------------------------

    def add_template(self, spec: TemplateSpec) -> Template:
        if spec.name in self.templates:
            raise SandboxError(f"template {spec.name!r} is already prepared")
        files_dir = self._write_files(self.runtime / "templates" / spec.name, spec.files)
        template = self.templates[spec.name] = Template(spec, files_dir)
        return template

    async def start_template_zygote(self, t: Template, cgroup: Cgroup) -> None:
        """The template's warm interpreter, set up, in `cgroup`."""
        cgroup.create()
        cgroup.limit(t.spec.declared_memory_bytes, ZYGOTE_PIDS, t.spec.cpus)
        t.zygote = await Zygote.start(cgroup.procs_files())
        t.cgroup = cgroup
        await t.zygote.setup(t.spec.name, t.spec.setup, t.spec.setup_timeout_s)

    async def drop_template(self, t: Template, cgroup: Cgroup) -> None:
        """Undo a template whose zygote did not start, so that it can be prepared again."""
        del self.templates[t.spec.name]
        if t.zygote is not None:
            t.zygote.close()
        await asyncio.to_thread(cgroup.remove)
        if t.files_dir:
            shutil.rmtree(t.files_dir, ignore_errors=True)

    def member_priors(self) -> dict[str, int]:
        """A member's expected memory per admission key, as its template declares it: what
        admission reserves until the pool has seen one finish."""
        return {
            f"{t.spec.name}:member": t.spec.expected_memory_bytes
            for t in self.templates.values()
            if t.spec.expected_memory_bytes is not None
        }

    def template(self, name: str) -> Template:
        if name not in self.templates:
            known = ", ".join(sorted(self.templates)) or "none"
            raise SandboxError(f"unknown template {name!r} (prepared: {known})")
        return self.templates[name]

    # --- groups -------------------------------------------------------------------------------

    def add_group(
        self, group_id: str, template: str, priority: int, setup: str, files: Mapping[str, bytes]
    ) -> Group:
        files_dir = self._write_files(self.runtime / "groups" / group_id, files)
        group = self.groups[group_id] = Group(group_id, template, setup, files_dir, priority)
        return group

    async def start_group_zygote(self, t: Template, group: Group, cgroup: Cgroup) -> None:
        """The group's zygote, forked from the template's, with the task's setup run in it."""
        assert t.zygote is not None
        cgroup.create()
        cgroup.limit(t.spec.declared_memory_bytes, ZYGOTE_PIDS, t.spec.cpus)
        group.zygote = await t.zygote.fork(cgroup.procs_files())
        group.cgroup = cgroup
        await group.zygote.setup(group.group_id, group.setup, t.spec.setup_timeout_s)

    def release_group(self, group: Group) -> None:
        """The group's zygote, cgroup and files go (the pool closed the zygote's account)."""
        if group.released:
            return
        group.released = True
        self.groups.pop(group.group_id, None)
        if group.zygote is not None:
            group.zygote.close()
            group.zygote = None
        if group.cgroup is not None:
            self.in_background(group.cgroup.remove)
        if group.files_dir:
            self.in_background(functools.partial(shutil.rmtree, group.files_dir, True))

    # --- sandboxes ----------------------------------------------------------------------------

    async def spawn(
        self, t: Template, group: Group | None, sandbox_id: str, cgroup: Cgroup
    ) -> tuple[socket.socket, Zygote | None]:
        """A sandbox's member process in `cgroup`: its socket, and the cold baseline's own
        interpreter (None with page sharing), which stays as its parent and dies with it."""
        root = self.runtime / "sandboxes" / sandbox_id
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
            return await zygote.spawn(asdict(cfg)), None
        # The cold baseline: a fresh interpreter in the sandbox's own cgroup runs the setups,
        # then becomes the sandbox.
        zygote = await Zygote.start(cgroup.procs_files())
        try:
            await zygote.setup(t.spec.name, t.spec.setup, t.spec.setup_timeout_s)
            if group is not None and group.setup:
                await zygote.setup(group.group_id, group.setup, t.spec.setup_timeout_s)
            return await zygote.spawn(asdict(cfg)), zygote
        except BaseException:  # cancelled included: the interpreter must not outlive the start
            zygote.close()
            raise

    def remove_sandbox_dir(self, sandbox_id: str) -> None:
        with contextlib.suppress(OSError):
            (self.runtime / "sandboxes" / sandbox_id).rmdir()

    # --- cleanup ------------------------------------------------------------------------------

    def in_background(self, cleanup: Callable[[], object]) -> None:
        """Blocking cleanup (killing, rmdir retries) off the event loop; `close` waits for it."""
        task = asyncio.ensure_future(asyncio.to_thread(cleanup))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def close(self) -> None:
        """After the pool released every group: the templates' zygotes, the pending cleanups."""
        for t in self.templates.values():
            if t.zygote is not None:
                t.zygote.close()
        await asyncio.gather(*self._cleanups, return_exceptions=True)

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
