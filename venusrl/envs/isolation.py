"""Turn a freshly forked process into the init of an isolated sandbox.

Called in a child a zygote just forked. The sequence, and why each step is there (MEASURED.md, and
the environment-service and image issues):

1. join the sandbox's cgroups first (through files the pool opened), so every page it touches
   from now on is charged to it;
2. a user namespace of its own, unless the zygote is in one already: the host's root becomes
   root of a namespace that maps only the sandbox's ids (a range of unprivileged host ids), so
   nothing it does afterwards has any power over the host, and its mounts need no host
   privilege;
3. new mount, pid, net, ipc, uts and cgroup namespaces, owned by that user namespace; fork so
   the child is pid 1 of the new pid namespace (when it exits the kernel kills everything left
   in the sandbox); the parent exits;
4. build the root on a tmpfs and pivot into it. A host root: read-only binds of /usr and the
   Python installation only (the host's /etc, /root, /home and the project are never mounted),
   a private writable /workspace (an overlay of the template's files on a size-limited tmpfs).
   An image root: an overlay of the image's layers with a private, size-limited upper, so the
   whole image is writable and no write reaches a sibling or the layer cache. Both get a
   size-limited /tmp, a fresh /proc that shows only the sandbox's pids and a tiny /dev;
5. no network: the new net namespace has only a loopback that stays down;
6. become the sandbox's user, drop every capability (bounding set included), lock the securebits
   so that exec as uid 0 gains none, set no_new_privs and load the seccomp deny-list.

This module also runs on an image's own Python (Python 3.8 syntax, standard library only).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from venusrl.envs.syscalls import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    PR_SET_SECUREBITS,
    SECBITS_LOCKED_NOROOT,
    clear_capabilities,
    drop_bounding_set,
    last_cap,
    load_seccomp,
    mount,
    move_mount_fd,
    open_tree_clone,
    pivot_root,
    prctl,
    umount,
    unshare,
)

SANDBOX_UID = 1000  # the uid code in a host-root sandbox runs as
WORKSPACE = "/workspace"  # a host-root sandbox's working directory
HIDDEN = "/.venusrl"  # in an image zygote's root: the layers, the runtime's code, members' roots
# Mount flags a remount must repeat: a mount from a more privileged namespace keeps them locked.
_LOCKED = (
    (MS_NOSUID, 2),
    (MS_NODEV, 4),
    (MS_NOEXEC, 8),
    (1024, 1024),
    (2048, 2048),
    (1 << 21, 4096),
)
# No tty: a sandbox that could open the run's terminal could type into its shell (TIOCSTI).
_DEVICES = ("null", "zero", "full", "random", "urandom")


@dataclass(frozen=True)
class IsolationConfig:
    """Everything `enter` needs; built by the pool, sent through the zygote as JSON."""

    root_dir: str  # an empty directory to build the sandbox's root on
    id_map: tuple[int, int, int]  # (first id inside, first host id, count) of the user namespace
    uid: int  # the sandbox's user and group, inside
    gid: int
    enter_userns: bool = True  # False: the zygote is in the sandboxes' user namespace already
    image_layers: list[str] = field(default_factory=list)  # an image root's lowers, top first
    lower_dirs: list[str] = field(default_factory=list)  # a host root's workspace layers
    workspace: str = WORKSPACE  # where relative paths and commands start
    workspace_bytes: int = 256 << 20  # the host root's /workspace, an image root's upper
    tmp_bytes: int = 64 << 20
    ro_binds: list[str] = field(default_factory=list)  # a host root: extra host paths
    host_binds: list[str] = field(default_factory=list)  # a host root: /usr, the Python
    env: dict[str, str] = field(default_factory=dict)
    passwd: str = ""  # a host root's /etc/passwd and /etc/group
    group: str = ""
    seccomp_bpf: str = ""  # hex of a compiled filter; "" for none


# --- the user namespace ------------------------------------------------------------------------


def enter_user_namespace(inside: int, host: int, count: int) -> None:
    """Move this process (the host's root) into a new user namespace where ids inside..+count
    are host ids host..+count, with every capability over what the namespace owns and none
    over the host. A range needs CAP_SETUID in the parent namespace, which the process itself
    loses by entering: a helper that stays outside writes the map."""
    os.setgroups([])
    me = os.getpid()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        code = 1
        try:
            os.close(go_w)
            os.close(done_r)
            if os.read(go_r, 1) == b"y":
                id_map = f"{inside} {host} {count}"
                for name, text in (("uid_map", id_map), ("setgroups", "deny"), ("gid_map", id_map)):
                    with open(f"/proc/{me}/{name}", "w") as f:
                        f.write(text)
                os.write(done_w, b"y")
                code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(done_w)
    try:
        unshare(CLONE_NEWUSER)
    except BaseException:
        os.write(go_w, b"n")
        raise
    os.write(go_w, b"y")
    written = os.read(done_r, 1) == b"y"
    for fd in (go_w, done_r):
        os.close(fd)
    with contextlib.suppress(ChildProcessError):  # a zygote's children are reaped by the kernel
        os.waitpid(helper, 0)
    if not written:
        raise OSError(f"could not write the user namespace's id map ({inside} {host} {count})")


def _build_ids(cfg: IsolationConfig) -> tuple[int, int]:
    """Who builds the root: the namespace's root where it maps one, else the sandbox's user."""
    inside, _, count = cfg.id_map
    if inside == 0 and count > 0:
        return 0, 0
    return cfg.uid, cfg.gid


# --- mounting ----------------------------------------------------------------------------------


def bind_ro(src: str, dst: str) -> None:
    mount(src, dst, None, MS_BIND | MS_REC)
    _read_only(dst)


def _read_only(dst: str) -> None:
    flags = os.statvfs(dst).f_flag
    locked = 0
    for ms_flag, st_flag in _LOCKED:
        if flags & st_flag:
            locked |= ms_flag
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)


def _mkdirs(root: str, path: str) -> str:
    dst = root + path
    os.makedirs(dst, exist_ok=True)
    return dst


def _touch(path: str) -> None:
    with open(path, "a"):
        pass


def overlay(
    target: str, lowers: Sequence[str | int], scratch: str, upper: str | None = None
) -> None:
    """An overlay of `lowers` (top first: paths, or detached trees `clone_trees` made) at
    `target`, with `upper` (a directory on the same filesystem as `scratch`, which holds its
    work directory) or read-only without. The layers are named by short names in `scratch`:
    mount(2) cuts its options at a page, ~43 long cache paths."""
    links = f"{scratch}/l"
    os.mkdir(links)
    for i, layer in enumerate(lowers):
        if isinstance(layer, int):
            os.mkdir(f"{links}/{i}")
            move_mount_fd(layer, f"{links}/{i}")
            os.close(layer)
        else:
            os.symlink(layer, f"{links}/{i}")
    opts = "lowerdir=" + ":".join(str(i) for i in range(len(lowers)))
    if upper is not None:
        os.mkdir(f"{scratch}/w")
        opts += f",upperdir={upper},workdir={scratch}/w"
    here = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.chdir(links)
        mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, opts + ",userxattr")
    finally:
        os.fchdir(here)
        os.close(here)
    for i, layer in enumerate(lowers):  # the overlay holds its own references to its layers
        if isinstance(layer, int):
            umount(f"{links}/{i}")
            os.rmdir(f"{links}/{i}")
        else:
            os.unlink(f"{links}/{i}")
    os.rmdir(links)


def mount_dev(dev: str, shm_bytes: int) -> None:
    """A tiny /dev: the harmless character devices bound from the host, links, a private shm."""
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "size=64k,mode=755")
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _touch(f"{dev}/{name}")
            mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ):
        os.symlink(target, f"{dev}/{name}")
    shm = _mkdirs(dev, "/shm")
    mount("tmpfs", shm, "tmpfs", MS_NOSUID | MS_NODEV, f"size={shm_bytes},mode=1777")


def pivot_into(root: str) -> None:
    """Make `root` this mount namespace's root and detach the old one."""
    os.chdir(root)
    pivot_root(".", ".")  # the old root stays stacked under the new one until detached
    umount(".")
    os.chdir("/")


_HOST_TOPS = ("bin", "sbin", "lib", "lib64", "lib32", "libx32")
_HOST_ETC = ("ld.so.cache", "alternatives", "localtime")


def clone_trees(paths: list[str]) -> list[int]:
    """Detached copies of the trees at `paths`, made while this process is the host's root in
    the host's mount namespace: from its own user namespace it could not reach a cache under a
    directory closed to others (/root/.cache), nor bind a mount of another namespace."""
    return [open_tree_clone(path) for path in paths]


def open_host_sources(cfg: IsolationConfig) -> dict[str, int | str]:
    """What a host root binds, cloned while this process is still the host's root and in the
    host's mount namespace: from its own namespaces it could neither reach the host's
    root-owned directories (a Python under /root) nor bind a mount of another namespace. Path
    -> a detached mount tree (`open_tree_clone`), or a link's target for a top directory that
    is a link."""
    sources: dict[str, int | str] = {}
    paths = [f"/{top}" for top in _HOST_TOPS] + [*cfg.host_binds, *cfg.ro_binds]
    paths += [f"/etc/{name}" for name in _HOST_ETC]
    for path in paths:
        if path in sources or not os.path.lexists(path):
            continue
        if path.count("/") == 1 and os.path.islink(path):
            sources[path] = os.readlink(path)
        elif path.startswith("/etc/") or os.path.isdir(path):
            sources[path] = open_tree_clone(path)
    return sources


def _host_root(cfg: IsolationConfig, sources: dict[str, int | str]) -> None:
    root = cfg.root_dir
    uid, gid = _build_ids(cfg)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    # /tmp first: a Python installation under /tmp (a venv in a temporary checkout) is bound
    # below it next, and must not be hidden by it.
    tmp = _mkdirs(root, "/tmp")
    mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg.tmp_bytes},mode=1777")
    etc = _mkdirs(root, "/etc")
    for path, source in sources.items():
        if isinstance(source, str):
            os.symlink(source, root + path)
            continue
        dst = root + path
        if stat.S_ISDIR(os.fstat(source).st_mode):
            os.makedirs(dst, exist_ok=True)
        else:
            _touch(dst)
        move_mount_fd(source, dst)
        os.close(source)
        _read_only(dst)
    for name, text in (
        ("passwd", cfg.passwd),
        ("group", cfg.group),
        ("hosts", "127.0.0.1 localhost sandbox\n"),
        ("hostname", "sandbox\n"),
    ):
        with open(f"{etc}/{name}", "w") as f:
            f.write(text)
    mount_dev(_mkdirs(root, "/dev"), cfg.tmp_bytes)
    mount("proc", _mkdirs(root, "/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    workspace = _mkdirs(root, cfg.workspace)
    ws_opts = f"size={cfg.workspace_bytes},mode=755,uid={uid},gid={gid}"
    if not cfg.lower_dirs:
        mount("tmpfs", workspace, "tmpfs", MS_NOSUID | MS_NODEV, ws_opts)
    else:
        # Copy-on-write files: the template's files are the lower layers, writes land in a
        # size-limited tmpfs of the sandbox's own.
        data = _mkdirs(root, "/.wsdata")
        mount("tmpfs", data, "tmpfs", MS_NOSUID | MS_NODEV, ws_opts)
        os.mkdir(f"{data}/upper")
        overlay(workspace, cfg.lower_dirs, data, upper=f"{data}/upper")
        umount(data)  # the overlay keeps its own reference; nothing inside can reach it
        os.rmdir(data)
    pivot_into(root)
    mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _image_root(cfg: IsolationConfig, trees: list[int]) -> None:
    """The image's layers under a private upper: the whole tree writable, copy-on-write.

    The image's names are not followed before the pivot: a link in it would resolve against
    this process's root, not the image's. The mountpoints are the skeleton layer's (the top
    lower: real directories over whatever the image has there); everything deeper is made
    after the pivot, where the image's links can only point into the sandbox itself."""
    scratch = cfg.root_dir
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg.workspace_bytes},mode=700")
    for sub in ("upper", "root"):
        os.mkdir(f"{scratch}/{sub}", 0o755)
    root = f"{scratch}/root"
    overlay(root, trees or cfg.image_layers, scratch, upper=f"{scratch}/upper")
    for path in ("/tmp", "/proc", "/dev"):
        if not stat.S_ISDIR(os.lstat(root + path).st_mode):
            raise OSError(f"{path} of the sandbox's root is not a directory (no skeleton layer?)")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg.tmp_bytes},mode=1777")
    mount_dev(root + "/dev", cfg.tmp_bytes)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    pivot_into(root)
    mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    if not os.path.isdir(cfg.workspace):
        os.makedirs(cfg.workspace, 0o755)
        os.chown(cfg.workspace, cfg.uid, cfg.gid)


def _stage_hidden(stage: str, hidden: dict[str, str]) -> None:
    """As the host's root, in a mount namespace of its own: the host paths `hidden` names
    (name -> path: each layer, the runtime's code, the template's groups' files) bound
    read-only under `stage`, a read-only tmpfs. Copied into the zygote's namespaces after it
    enters its user namespace, these mounts are locked: the zygote, root there with every
    capability, can neither make them writable nor unmount them (made after entering, it
    could remount a shared layer read-write and change every image built on it)."""
    mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for name, path in hidden.items():
        bind_ro(path, _mkdirs(stage, "/" + name))
    os.mkdir(stage + "/mnt", 0o755)  # where each member builds its root, in a namespace of its own
    mount(None, stage, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def zygote_root(root_dir: str, layers: int, tmp_bytes: int) -> None:
    """An image zygote's root, made inside its namespaces on a tmpfs at `root_dir`/root: an
    overlay of its `layers` (the first that many of the staged `layers/N`, top first, the
    skeleton among them), read-only, the stage under `HIDDEN`, a /tmp, a /dev and a /proc."""
    stage, scratch = f"{root_dir}/stage", f"{root_dir}/root"
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=700")
    root = f"{scratch}/r"
    os.mkdir(root, 0o755)
    overlay(root, [f"{stage}/layers/{i}" for i in range(layers)], scratch)
    for path in (HIDDEN, "/tmp", "/proc", "/dev"):  # the skeleton's real directories
        if not stat.S_ISDIR(os.lstat(root + path).st_mode):
            raise OSError(f"{path} of the zygote's root is not a directory (no skeleton layer?)")
    mount(stage, root + HIDDEN, None, MS_BIND | MS_REC)  # a copy of locked mounts stays locked
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},mode=1777")
    mount_dev(root + "/dev", tmp_bytes)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    pivot_into(root)


def enter_image_zygote(
    id_map: tuple[int, int, int],
    root_dir: str,
    layers: list[str],
    tmp_bytes: int,
    hidden: dict[str, str],
) -> None:
    """This process (the host's root, in the zygote's cgroups) becomes pid 1 of an image
    zygote: root of the sandboxes' user namespace, in mount, pid, net, ipc and uts namespaces
    of its own and a session of its own (no terminal), its root the image (read-only). It
    keeps its capabilities over what that namespace owns, to make sandboxes; it has none over
    the host, nor over the layers it is built from. The caller then execs the image's Python.
    `hidden` must stage each of `layers` as `layers/N`, in the same order."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Seen only in this mount namespace (and copied into the zygote's): nothing on the host.
    mount("tmpfs", root_dir, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for sub in ("stage", "root"):
        os.mkdir(f"{root_dir}/{sub}", 0o755)
    _stage_hidden(f"{root_dir}/stage", hidden)
    enter_user_namespace(*id_map)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
    if os.fork() != 0:
        os._exit(0)  # the zygote is known by its socket; the kernel adopts and reaps it
    os.setsid()
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    zygote_root(root_dir, len(layers), tmp_bytes)
    socket.sethostname("zygote")


# --- the sequence ------------------------------------------------------------------------------


def _drop_privileges(cfg: IsolationConfig) -> None:
    cap_last = last_cap()
    prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT)  # while we still hold CAP_SETPCAP
    drop_bounding_set(cap_last)
    os.setresgid(cfg.gid, cfg.gid, cfg.gid)
    os.setresuid(cfg.uid, cfg.uid, cfg.uid)
    clear_capabilities()
    # Non-dumpable: sandboxed processes (same uid) cannot read or write the init's memory or
    # environment through /proc/1, so they cannot tamper with what it reports to the pool.
    prctl(PR_SET_DUMPABLE, 0)
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def join_cgroups(fds: list[int]) -> None:
    for fd in fds:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)


def enter(cfg: IsolationConfig, cgroup_fds: list[int], keep_fds: list[int]) -> None:
    """Returns in the sandbox's init process, fully isolated; the calling process never returns.

    Errors before the fork propagate to the caller's handler; errors inside the new init are
    raised there too (the caller reports them on its socket), and the init then exits, which
    takes the whole sandbox down with it.
    """
    join_cgroups(cgroup_fds)
    # Zygotes are shielded from the OOM killer; the sandbox must be a fair victim again.
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("0")
    sources = {} if cfg.image_layers else open_host_sources(cfg)
    trees = clone_trees(cfg.image_layers) if cfg.image_layers and cfg.enter_userns else []
    if cfg.enter_userns:
        enter_user_namespace(*cfg.id_map)
    uid, gid = _build_ids(cfg)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # a uid the namespace maps: files it makes have an owner
    unshare(
        CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    )
    if os.fork() != 0:
        os._exit(0)  # the init is adopted by the zygote, which reaps it
    # pid 1 of the sandbox from here on, in a session of its own: no controlling terminal.
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    prctl(PR_SET_PDEATHSIG, 0)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if cfg.image_layers:
        _image_root(cfg, trees)
    else:
        _host_root(cfg, sources)
    socket.sethostname("sandbox")
    keep = set(keep_fds)
    for fd in os.listdir("/proc/self/fd"):
        if int(fd) > 2 and int(fd) not in keep:
            with contextlib.suppress(OSError):
                os.close(int(fd))
    devnull = os.open("/dev/null", os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    os.close(devnull)
    _drop_privileges(cfg)
    if cfg.seccomp_bpf:
        load_seccomp(bytes.fromhex(cfg.seccomp_bpf))
    os.environ.clear()
    os.environ.update(cfg.env)
    os.chdir(cfg.workspace)
