"""A pool's warm templates and groups: their files, their zygotes, and the process each sandbox
starts as.

With page sharing, a template's zygote runs the template's setup once, a group's zygote forks from
it and runs the task's setup, and a sandbox forks from its group's zygote (or the template's), so
they share those pages copy-on-write. Without it, each sandbox starts a cold interpreter of its
own that runs the setups itself: the baseline.

A template with an image (`TemplateSpec.image`) roots its sandboxes in the image: when the image
has a Python, the zygote is that interpreter inside the image, in the sandboxes' user namespace;
otherwise members fork from a host interpreter that ran no setup and enter the image themselves
(`run_python` then refuses). Either way every sandbox of the image overlays the same unpacked
layers, so their page cache is shared. Image sandboxes' ids inside are host ids
`IMAGE_ID_BASE` + id, which is how the layer cache owns its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from venusrl.envs.cgroups import Cgroup
from venusrl.envs.isolation import HIDDEN, SANDBOX_UID, WORKSPACE, IsolationConfig
from venusrl.envs.sandbox import check_path
from venusrl.envs.types import SandboxError, TemplateSpec
from venusrl.envs.zygote_handle import ONE_THREAD, Zygote, ZygoteError
from venusrl.images.store import Image, User
from venusrl.images.unpack import ID_COUNT

log = logging.getLogger(__name__)
ZYGOTE_PIDS = 64  # a zygote forks sandboxes; it runs nothing of the model's
IMAGE_ID_BASE = 1 << 20
# The modules an image's Python imports to be a zygote, copied into every image zygote's root.
INSIDE_MODULES = ("wire", "syscalls", "isolation", "member", "zygote")
_SKELETON_DIRS = ("proc", "dev", "tmp", "etc", HIDDEN.strip("/"))


@dataclass
class ImageRoot:
    """What an image template's sandboxes are made of."""

    image: Image
    user: User
    workspace: str
    layers: list[str]  # host paths, top first: the template's files, the skeleton, the image
    env: dict[str, str]
    python: str | None  # the image's interpreter, for the zygote; None: a host zygote


@dataclass
class Template:
    spec: TemplateSpec
    files_dir: str | None
    zygote: Zygote | None = None
    cgroup: Cgroup | None = None
    root: ImageRoot | None = None  # an image template
    zygote_entry: str | None = None  # the zygote's account in the pool's admission


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


def python_binds() -> list[str]:
    """The host paths a host-root sandbox needs to run this Python with its packages."""
    paths = {sys.base_prefix, sys.prefix, str(Path(sys.executable).resolve().parent.parent)}
    return sorted(p for p in paths if not p.startswith("/usr/"))


def sandbox_env(extra: Mapping[str, str]) -> dict[str, str]:
    """A host-root sandbox's environment."""
    path = [str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
    return {
        "PATH": ":".join(dict.fromkeys(path)),
        "HOME": WORKSPACE,
        "USER": "sandbox",
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # same-size edits within a second would run stale .pyc
        **extra,
    }


def image_env(image: Image, user: User, extra: Mapping[str, str]) -> dict[str, str]:
    """What Docker gives a container of `image`: its Env, HOME and HOSTNAME, then `extra`."""
    return {
        "HOSTNAME": "sandbox",
        "HOME": user.home,
        **image.environment(),
        "PYTHONDONTWRITEBYTECODE": "1",
        **ONE_THREAD,
        **extra,
    }


class WarmStarts:
    """The templates and open groups of one pool, under its runtime directory."""

    def __init__(
        self, runtime: Path, share_pages: bool, sandbox_uid: int, seccomp_bpf: bytes | None
    ) -> None:
        self.runtime = runtime
        self.share_pages = share_pages
        self.sandbox_uid = sandbox_uid
        self.seccomp_bpf = seccomp_bpf.hex() if seccomp_bpf else ""
        self.templates: dict[str, Template] = {}
        self.groups: dict[str, Group] = {}
        self._cleanups: set[asyncio.Future[object]] = set()
        # A bare host zygote the image zygotes are forked from (no interpreter to start each
        # time), in `launcher_cgroup` (the pool's: set by it), started with the first image.
        self.launcher_cgroup: Cgroup | None = None
        self._launcher: Zygote | None = None

    def make_dirs(self) -> None:
        # Never reuse a directory someone else made. Others may traverse it, not list or
        # write: sandboxes build their roots from paths under it once in their own user
        # namespace.
        self.runtime.mkdir(mode=0o711)
        os.chmod(self.runtime, 0o711)
        for sub in ("templates", "groups", "sandboxes"):
            (self.runtime / sub).mkdir(mode=0o711)
            os.chmod(self.runtime / sub, 0o711)
        self._write_inside_modules()
        self._write_skeleton()

    def _write_inside_modules(self) -> None:
        """A package tree of just the modules an image zygote imports, for its root."""
        here = Path(__file__).parent
        envs = self.runtime / "py" / "venusrl" / "envs"
        envs.mkdir(parents=True)
        for init in (envs.parent / "__init__.py", envs / "__init__.py"):
            init.write_text("")
        for name in INSIDE_MODULES:
            shutil.copyfile(here / f"{name}.py", envs / f"{name}.py")
        for root, dirs, files in os.walk(self.runtime / "py"):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o755)
            for name in files:
                os.chmod(os.path.join(root, name), 0o644)

    def _write_skeleton(self) -> None:
        """The top layer of every image root: real directories where the runtime mounts (over
        whatever an image has there, links included), and the sandbox's own hosts files."""
        skeleton = self.runtime / "skeleton"
        for name in _SKELETON_DIRS:
            (skeleton / name).mkdir(parents=True)
        (skeleton / "tmp").chmod(0o1777)
        (skeleton / "etc" / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
        (skeleton / "etc" / "hostname").write_text("sandbox\n")
        _chown_tree(skeleton, IMAGE_ID_BASE, IMAGE_ID_BASE)

    # --- templates ----------------------------------------------------------------------------

    def add_template(self, spec: TemplateSpec, image: Image | None = None) -> Template:
        if spec.name in self.templates:
            raise SandboxError(f"template {spec.name!r} is already prepared")
        if image is None:
            files_dir = self._write_files(
                self.runtime / "templates" / spec.name, spec.files, (self.sandbox_uid,) * 2
            )
            template = self.templates[spec.name] = Template(spec, files_dir)
            return template
        user = image.user(spec.user)
        workspace = spec.workdir or image.config.working_dir or "/"
        python = image.python_path()
        if python is None and spec.setup:
            raise SandboxError(
                f"template {spec.name!r}: image {image.ref} has no Python (none on its PATH),"
                " so its setup cannot run; leave setup empty and use exec"
            )
        host_ids = (IMAGE_ID_BASE + user.uid, IMAGE_ID_BASE + user.gid)
        where = self.runtime / "templates" / spec.name
        files_dir = self._write_files(where, spec.files, host_ids, workspace)
        skeleton = str(self.runtime / "skeleton")
        lowers = [*([files_dir] if files_dir else []), skeleton]
        lowers += [str(p) for p in reversed(image.layers)]
        env = image_env(image, user, spec.env)
        root = ImageRoot(image, user, workspace, lowers, env, python)
        template = self.templates[spec.name] = Template(spec, files_dir, root=root)
        return template

    async def start_template_zygote(self, t: Template, cgroup: Cgroup) -> None:
        """The template's warm interpreter, set up, in `cgroup`: the image's Python for an
        image that has one (a host one if that does not start, said in the log)."""
        cgroup.create()
        cgroup.limit(t.spec.declared_memory_bytes, ZYGOTE_PIDS, t.spec.cpus)
        t.cgroup = cgroup
        t.zygote = await self._new_zygote(
            t, cgroup, self.runtime / "templates" / f"{t.spec.name}.root"
        )
        await t.zygote.setup(t.spec.name, t.spec.setup, t.spec.setup_timeout_s)

    async def _new_zygote(self, t: Template, cgroup: Cgroup, root_dir: Path) -> Zygote:
        code = str(self.runtime / "py")
        if t.root is None or t.root.python is None:
            return await Zygote.start(cgroup.procs_files(), code)
        root_dir.mkdir(mode=0o755)
        try:
            launcher = await self.launcher()
            config = self._zygote_config(t, root_dir)
            timeout = t.spec.setup_timeout_s
            return await launcher.image(cgroup.procs_files(), config, timeout)
        except ZygoteError as e:
            if t.spec.setup:
                raise
            log.warning(
                "template %s: image %s: its Python %s does not run as a zygote, so its"
                " sandboxes start from this machine's (run_python refused): %s",
                t.spec.name,
                t.root.image.ref,
                t.root.python,
                e,
            )
            await asyncio.to_thread(cgroup.kill)
            t.root.python = None
            return await Zygote.start(cgroup.procs_files(), code)

    async def launcher(self) -> Zygote:
        if self._launcher is None:
            assert self.launcher_cgroup is not None
            self.launcher_cgroup.create()
            cgroup = self.launcher_cgroup.procs_files()
            self._launcher = await Zygote.start(cgroup, str(self.runtime / "py"))
        return self._launcher

    def _zygote_config(self, t: Template, root_dir: Path) -> dict[str, object]:
        assert t.root is not None and t.root.python is not None
        hidden = {f"layers/{i}": layer for i, layer in enumerate(t.root.layers)}
        groups = self.runtime / "templates" / f"{t.spec.name}.groups"
        groups.mkdir(mode=0o755, exist_ok=True)
        hidden |= {"py": str(self.runtime / "py"), "groups": str(groups)}
        return {
            "id_map": [0, IMAGE_ID_BASE, ID_COUNT],
            "root_dir": str(root_dir),
            "layers": t.root.layers,
            "hidden": hidden,
            "tmp_bytes": t.spec.tmp_bytes,
            "python": t.root.python,
            "env": t.root.env,
        }

    def forget(self, t: Template) -> None:
        """Let a template go (its zygote did not start, or no group uses it any more): its
        zygote, its cgroup and its directories, the last two in the background. The pool closes
        the zygote's account."""
        self.templates.pop(t.spec.name, None)
        if t.zygote is not None:
            t.zygote.close()
            t.zygote = None
        if t.cgroup is not None:
            self.in_background(t.cgroup.remove)
        base = self.runtime / "templates" / t.spec.name
        for path in (base, Path(f"{base}.groups"), Path(f"{base}.root")):
            self.in_background(functools.partial(shutil.rmtree, path, True))

    def member_priors(self) -> dict[str, int]:
        """A member's (and a group zygote's: the task's setup over its template's pages)
        expected memory per admission key, as its template declares it: what admission
        reserves until the pool has seen one finish."""
        return {
            f"{t.spec.estimates}:{kind}": t.spec.expected_memory_bytes
            for t in self.templates.values()
            if t.spec.expected_memory_bytes is not None
            for kind in ("member", "zygote")
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
        t = self.template(template)
        if t.root is None:
            where = self.runtime / "groups" / group_id
            files_dir = self._write_files(where, files, (self.sandbox_uid,) * 2)
        else:
            if setup and t.root.python is None:
                raise SandboxError(
                    f"image {t.root.image.ref} has no Python: a task's setup cannot run in it"
                )
            # Beside its template's: the image's zygote sees its own template's groups only.
            where = self.runtime / "templates" / f"{template}.groups" / group_id
            user = t.root.user
            ids = (IMAGE_ID_BASE + user.uid, IMAGE_ID_BASE + user.gid)
            files_dir = self._write_files(where, files, ids, t.root.workspace)
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

    def _config(
        self, t: Template, group: Group | None, sandbox_id: str, inside: bool
    ) -> IsolationConfig:
        """How a member starts: forked `inside` an image zygote (its paths are the zygote's
        root's), or from a host zygote (host paths)."""
        spec, group_files = t.spec, group.files_dir if group else None
        common = {
            "workspace_bytes": spec.workspace_bytes,
            "tmp_bytes": spec.tmp_bytes,
            "seccomp_bpf": self.seccomp_bpf,
        }
        if t.root is None:
            return IsolationConfig(
                root_dir=str(self.runtime / "sandboxes" / sandbox_id),
                id_map=(SANDBOX_UID, self.sandbox_uid, 1),
                uid=SANDBOX_UID,
                gid=SANDBOX_UID,
                lower_dirs=[d for d in (group_files, t.files_dir) if d],
                host_binds=["/usr", *python_binds()],
                env=sandbox_env(spec.env),
                passwd=f"root:x:0:0::/:/bin/false\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::"
                f"{WORKSPACE}:/bin/sh\n",
                group=f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n",
                **common,  # type: ignore[arg-type]
            )
        if inside:
            root_dir = f"{HIDDEN}/mnt"
            layers = [f"{HIDDEN}/layers/{i}" for i in range(len(t.root.layers))]
            if group_files:
                layers.insert(0, f"{HIDDEN}/groups/{group.group_id}")  # type: ignore[union-attr]
        else:
            root_dir = str(self.runtime / "sandboxes" / sandbox_id)
            layers = [*([group_files] if group_files else []), *t.root.layers]
        return IsolationConfig(
            root_dir=root_dir,
            id_map=(0, IMAGE_ID_BASE, ID_COUNT),
            uid=t.root.user.uid,
            gid=t.root.user.gid,
            enter_userns=not inside,
            image_layers=layers,
            workspace=t.root.workspace,
            env=t.root.env,
            **common,  # type: ignore[arg-type]
        )

    async def spawn(
        self, t: Template, group: Group | None, sandbox_id: str, cgroup: Cgroup
    ) -> tuple[socket.socket, Zygote | None]:
        """A sandbox's member process in `cgroup`: its socket, and the cold baseline's own
        interpreter (None with page sharing), which stays as its parent and dies with it."""
        root = self.runtime / "sandboxes" / sandbox_id
        root.mkdir()
        image_zygote = t.root is not None and t.root.python is not None
        python_ok = t.root is None or t.root.python is not None
        cfg = asdict(self._config(t, group, sandbox_id, inside=image_zygote))
        procs = cgroup.procs_files()
        if self.share_pages:
            zygote = group.zygote if group is not None and group.zygote else t.zygote
            assert zygote is not None
            return await zygote.spawn(cfg, procs, python_ok), None
        # The cold baseline: a fresh interpreter in the sandbox's own cgroup runs the setups,
        # then becomes the sandbox.
        zygote = await self._new_zygote(
            t, cgroup, self.runtime / "sandboxes" / f"{sandbox_id}.root"
        )
        try:
            await zygote.setup(t.spec.name, t.spec.setup, t.spec.setup_timeout_s)
            if group is not None and group.setup:
                await zygote.setup(group.group_id, group.setup, t.spec.setup_timeout_s)
            return await zygote.spawn(cfg, procs, python_ok), zygote
        except BaseException:  # cancelled included: the interpreter must not outlive the start
            zygote.close()
            raise

    def remove_sandbox_dir(self, sandbox_id: str) -> None:
        for name in (sandbox_id, f"{sandbox_id}.root"):
            with contextlib.suppress(OSError):
                (self.runtime / "sandboxes" / name).rmdir()

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
        if self._launcher is not None:
            self._launcher.close()
        await asyncio.gather(*self._cleanups, return_exceptions=True)

    def _write_files(
        self,
        where: Path,
        files: Mapping[str, bytes],
        owner: tuple[int, int],
        workspace: str = "",
    ) -> str | None:
        """Workspace files as a read-only overlay layer, owned by the sandbox's user so that
        copy-up keeps them writable inside. For an image root the layer is a whole root with
        the files under `workspace`."""
        if not files:
            return None
        # Checked before anything is written: a directory left half-written by a refused file
        # made every later prepare_template of that name fail with FileExistsError instead.
        for path, data in files.items():
            check_path(path)
            if not isinstance(data, bytes):
                raise SandboxError(f"file {path!r}: content must be bytes")
        where.mkdir(parents=True)
        base = where / workspace.strip("/")
        for path, data in files.items():
            target = base / path
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            except OSError as e:  # "a" and "a/b": one path is a file, the other needs a directory
                shutil.rmtree(where, ignore_errors=True)
                problem = f"cannot be written beside the others ({e.strerror})"
                raise SandboxError(f"file {path!r}: {problem}") from None
        if base != where:  # the directories above an image's workspace stay its root's
            _chown_tree(where, IMAGE_ID_BASE, IMAGE_ID_BASE)
        _chown_tree(base, *owner)
        return str(where)


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    for root, dirs, names in os.walk(top):
        for name in [*dirs, *names, ""]:
            os.lchown(os.path.join(root, name), uid, gid)
