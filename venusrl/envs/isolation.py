"""Turn a freshly forked process into the init of an isolated sandbox.

Called in a child the zygote just forked (root, host namespaces, the template already in memory).
The sequence, and why each step is there (MEASURED.md, and the environment-service issue):

1. join the sandbox's cgroups first, so every page it touches from now on is charged to it;
2. new mount, pid, net, ipc, uts and cgroup namespaces; fork so the child is pid 1 of the new pid
   namespace (when it exits the kernel kills everything left in the sandbox); the parent exits;
3. build a minimal root on a tmpfs: read-only binds of /usr and the Python installation only (the
   host's /etc, /root, /home and the project are never mounted, so no secret is reachable even by
   path), a private writable /workspace (an overlay of the template's files on a size-limited
   tmpfs, so writes are copy-on-write and never reach a sibling), a size-limited /tmp, a fresh
   /proc that shows only the sandbox's pids, a tiny /dev; then pivot_root and detach the old root;
4. no network: the new net namespace has only a loopback that stays down, and it is not the host's;
5. drop to an unprivileged host uid, enter a user namespace where that uid is 1000, drop every
   capability (bounding set included), set no_new_privs and load a seccomp deny-list.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import platform
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

SANDBOX_UID = 1000  # the uid sandboxed code sees
WORKSPACE = "/workspace"

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(libc.unshare(flags), f"unshare({flags:#x})")


def prctl(option: int, arg: int = 0) -> int:
    return _check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    ret = libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(ret, f"mount {source} on {target} ({fstype}, {data})")


def umount(target: str) -> None:
    _check(libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def _syscall_nr(table: Mapping[str, int]) -> int:
    machine = platform.machine()
    if machine not in table:
        raise OSError(errno.ENOSYS, f"sandboxes are not supported on {machine}")
    return table[machine]


def pivot_root(new_root: str, put_old: str) -> None:
    nr = _syscall_nr(_SYS_PIVOT_ROOT)
    _check(libc.syscall(nr, new_root.encode(), put_old.encode()), "pivot_root")


def last_cap() -> int:
    return int(Path("/proc/sys/kernel/cap_last_cap").read_text())


def drop_bounding_set(cap_last: int) -> None:
    """No capability can ever be gained again, even by executing a file that has some."""
    for cap in range(cap_last + 1):
        with contextlib.suppress(OSError):  # caps the kernel does not know
            prctl(PR_CAPBSET_DROP, cap)


def clear_capabilities() -> None:
    """Empty the permitted, effective and inheritable sets."""

    class Header(ctypes.Structure):
        _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))

    class Data(ctypes.Structure):
        _fields_ = (
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        )

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (Data * 2)()
    _check(libc.syscall(_syscall_nr(_SYS_CAPSET), ctypes.byref(header), data), "capset")


# --- seccomp -------------------------------------------------------------------------------------

# Syscalls no tool needs and many kernel exploits start from (after Docker's default profile):
# mounting and namespaces, kernel modules and keyrings, tracing other processes, BPF, io_uring.
SECCOMP_DENY = (
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "syslog",
    "open_by_handle_at",
    "name_to_handle_at",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "quotactl",
    "lookup_dcookie",
    "vhangup",
    "personality",
)
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7


def _scmp_errno(err: int) -> int:
    return 0x00050000 | err


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


def seccomp_available() -> bool:
    return ctypes.util.find_library("seccomp") is not None


def load_seccomp_denylist() -> None:
    """EPERM for `SECCOMP_DENY`; clone() creating namespaces is refused; clone3 answers ENOSYS so
    the C library falls back to clone(), whose flags a filter can read."""
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    )
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_load.argtypes = (ctypes.c_void_p,)
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:

        def rule(name: str, action: int, args: Sequence[_ArgCmp] = ()) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                return  # not a syscall on this architecture
            arr = (_ArgCmp * max(1, len(args)))(*args)
            ret = lib.seccomp_rule_add_array(ctx, action, nr, len(args), arr)
            if ret < 0:
                raise OSError(-ret, f"seccomp rule for {name}")

        for name in SECCOMP_DENY:
            rule(name, _scmp_errno(errno.EPERM))
        rule("clone3", _scmp_errno(errno.ENOSYS))
        for flag in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP):
            rule("clone", _scmp_errno(errno.EPERM), [_ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag)])
        ret = lib.seccomp_load(ctx)
        if ret < 0:
            raise OSError(-ret, "seccomp_load")
    finally:
        lib.seccomp_release(ctx)


# --- the sandbox -------------------------------------------------------------------------------


@dataclass(frozen=True)
class IsolationConfig:
    """Everything `enter` needs; built by the pool, sent through the zygote as JSON."""

    cgroup_procs: list[str]
    root_dir: str  # an empty host directory to build the sandbox's root on
    host_uid: int  # unprivileged host uid the sandbox runs as (uid 1000 inside)
    lower_dirs: list[str] = field(default_factory=list)  # read-only workspace layers, top first
    workspace_bytes: int = 256 << 20
    tmp_bytes: int = 64 << 20
    ro_binds: list[str] = field(default_factory=list)  # extra host paths, mounted read-only
    env: dict[str, str] = field(default_factory=dict)
    seccomp: bool = True


def python_binds() -> list[str]:
    """The host paths the sandbox needs to run this Python with its installed packages."""
    paths = {sys.base_prefix, sys.prefix, str(Path(sys.executable).resolve().parent.parent)}
    return sorted(p for p in paths if not p.startswith("/usr/"))


def _bind_ro(src: str, dst: str) -> None:
    mount(src, dst, None, MS_BIND | MS_REC)
    # Keep the flags the source mount already has locked (nosuid, nodev, ...), add read-only.
    st = os.statvfs(src)
    locked = st.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)


def _mkdirs(root: str, path: str) -> str:
    dst = root + path
    os.makedirs(dst, exist_ok=True)
    return dst


def _touch(path: str) -> None:
    with open(path, "a"):
        pass


def _build_root(cfg: IsolationConfig) -> None:
    root = cfg.root_dir
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    # /tmp first: a Python installation under /tmp (a venv in a temporary checkout) is bound
    # below it next, and must not be hidden by it.
    tmp = _mkdirs(root, "/tmp")
    mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg.tmp_bytes},mode=1777")
    for top in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        host = f"/{top}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{top}")
        elif os.path.isdir(host):
            _bind_ro(host, _mkdirs(root, host))
    for path in ["/usr", *python_binds(), *cfg.ro_binds]:
        if os.path.isdir(path):
            _bind_ro(path, _mkdirs(root, path))
    etc = _mkdirs(root, "/etc")
    for name in ("ld.so.cache", "alternatives", "localtime"):
        if os.path.exists(f"/etc/{name}"):
            target = f"{etc}/{name}"
            if os.path.isdir(f"/etc/{name}"):
                os.makedirs(target)
            else:
                _touch(target)
            _bind_ro(f"/etc/{name}", target)
    Path(etc, "passwd").write_text(
        f"root:x:0:0::/:/bin/false\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{WORKSPACE}:/bin/sh\n"
    )
    Path(etc, "group").write_text(f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n")
    Path(etc, "hosts").write_text("127.0.0.1 localhost sandbox\n")
    Path(etc, "hostname").write_text("sandbox\n")

    dev = _mkdirs(root, "/dev")
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "size=64k,mode=755")
    for name in ("null", "zero", "full", "random", "urandom"):
        _touch(f"{dev}/{name}")
        mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{dev}/{name}")
    os.symlink("/proc/self/fd/1", f"{dev}/stdout")
    os.symlink("/proc/self/fd/2", f"{dev}/stderr")
    shm = _mkdirs(root, "/dev/shm")
    mount("tmpfs", shm, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg.tmp_bytes},mode=1777")

    mount("proc", _mkdirs(root, "/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    workspace = _mkdirs(root, WORKSPACE)
    ws_opts = f"size={cfg.workspace_bytes},mode=755,uid={cfg.host_uid},gid={cfg.host_uid}"
    if not cfg.lower_dirs:
        mount("tmpfs", workspace, "tmpfs", MS_NOSUID | MS_NODEV, ws_opts)
    else:
        # Copy-on-write files: the template's files are the lower layers, writes land in a
        # size-limited tmpfs of the sandbox's own.
        data = _mkdirs(root, "/.wsdata")
        mount("tmpfs", data, "tmpfs", MS_NOSUID | MS_NODEV, ws_opts)
        for sub in ("upper", "work"):
            os.mkdir(f"{data}/{sub}")
            os.chown(f"{data}/{sub}", cfg.host_uid, cfg.host_uid)
        opts = f"lowerdir={':'.join(cfg.lower_dirs)},upperdir={data}/upper,workdir={data}/work"
        mount("overlay", workspace, "overlay", MS_NOSUID | MS_NODEV, opts)
        umount(data)  # the overlay keeps its own reference; nothing inside can reach it
        os.rmdir(data)

    os.chdir(root)
    os.mkdir(".oldroot")
    pivot_root(".", ".oldroot")
    os.chdir("/")
    umount("/.oldroot")
    os.rmdir("/.oldroot")
    mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _drop_privileges(host_uid: int) -> None:
    cap_last = last_cap()
    os.setgroups([])
    drop_bounding_set(cap_last)  # while we still hold CAP_SETPCAP
    os.setresgid(host_uid, host_uid, host_uid)
    os.setresuid(host_uid, host_uid, host_uid)  # leaving uid 0 clears the remaining sets
    prctl(PR_SET_DUMPABLE, 1)  # changing uid made /proc/self root-owned; we must write our maps
    unshare(CLONE_NEWUSER)
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{SANDBOX_UID} {host_uid} 1")
    Path("/proc/self/gid_map").write_text(f"{SANDBOX_UID} {host_uid} 1")
    # A new user namespace hands out a full set again (over nothing the host owns): drop it.
    drop_bounding_set(cap_last)
    clear_capabilities()
    # Non-dumpable: sandboxed processes (same uid) cannot read or write the init's memory or
    # environment through /proc/1, so they cannot tamper with what it reports to the pool.
    prctl(PR_SET_DUMPABLE, 0)
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def sandbox_env(extra: Mapping[str, str]) -> dict[str, str]:
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


def enter(cfg: IsolationConfig, keep_fds: Sequence[int]) -> None:
    """Returns in the sandbox's init process, fully isolated; the calling process never returns.

    Errors before the fork propagate to the caller's handler; errors inside the new init are
    raised there too (the caller reports them on its socket), and the init then exits, which
    takes the whole sandbox down with it.
    """
    for procs in cfg.cgroup_procs:
        Path(procs).write_text(str(os.getpid()))
    unshare(
        CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    )
    if os.fork() != 0:
        os._exit(0)  # the init is adopted by the zygote, which reaps it
    # pid 1 of the sandbox from here on.
    import signal

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    prctl(PR_SET_PDEATHSIG, 0)
    # Zygotes are shielded from the OOM killer; the sandbox must be a fair victim again.
    Path("/proc/self/oom_score_adj").write_text("0")
    _build_root(cfg)
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
    _drop_privileges(cfg.host_uid)
    if cfg.seccomp:
        load_seccomp_denylist()
    os.environ.clear()
    os.environ.update(sandbox_env(cfg.env))
    os.chdir(WORKSPACE)
