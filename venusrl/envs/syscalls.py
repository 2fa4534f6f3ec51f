"""The Linux calls a sandbox is made of: namespaces, mounts, pivot_root, capabilities, seccomp.

This module also runs on an image's own Python (the zygote of an image sandbox), so it needs only
the standard library and the C library of the process it is in, and keeps to Python 3.8's syntax
(`tests/envs/test_inside_modules.py`). The seccomp filter is compiled on the host, where
libseccomp is (`compile_seccomp`), and loaded inside as raw BPF (`load_seccomp`): an image need
not have the library.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import platform

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
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
# noroot, no_setuid_fixup and keep_caps off, each locked: uid 0 inside gains nothing by exec
SECBITS_LOCKED_NOROOT = 0x01 | 0x02 | 0x04 | 0x08

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
_SYS_OPEN_TREE = {"x86_64": 428, "aarch64": 428}
_SYS_MOVE_MOUNT = {"x86_64": 429, "aarch64": 429}
_AT_FDCWD = -100
_OPEN_TREE_CLONE = 1
_AT_RECURSIVE = 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 4

# The process's own symbols: the C library it is linked with, glibc or musl alike.
libc = ctypes.CDLL(None, use_errno=True)


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


def _syscall_nr(table: dict[str, int]) -> int:
    machine = platform.machine()
    if machine not in table:
        raise OSError(errno.ENOSYS, f"sandboxes are not supported on {machine}")
    return table[machine]


def open_tree_clone(path: str) -> int:
    """A detached copy of the mount tree at `path`, as a descriptor (Linux 5.2): it can be
    attached (`move_mount_fd`) in another mount namespace, even one of another user namespace,
    where a bind of `path` itself would be refused."""
    flags = _OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC
    nr = _syscall_nr(_SYS_OPEN_TREE)
    return _check(libc.syscall(nr, _AT_FDCWD, path.encode(), flags), f"open_tree {path}")


def move_mount_fd(tree: int, target: str) -> None:
    nr = _syscall_nr(_SYS_MOVE_MOUNT)
    ret = libc.syscall(nr, tree, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH)
    _check(ret, f"move_mount onto {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    nr = _syscall_nr(_SYS_PIVOT_ROOT)
    _check(libc.syscall(nr, new_root.encode(), put_old.encode()), "pivot_root")


def last_cap() -> int:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


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


def compile_seccomp() -> bytes:
    """The deny-list filter as raw BPF (host side, with libseccomp): EPERM for `SECCOMP_DENY`
    and for clone() creating namespaces; clone3 answers ENOSYS, so the C library falls back to
    clone(), whose flags a filter can read."""
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
    lib.seccomp_export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:

        def rule(name: str, action: int, args: tuple[_ArgCmp, ...] = ()) -> None:
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
            rule("clone", _scmp_errno(errno.EPERM), (_ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag),))
        fd = os.memfd_create("seccomp-bpf")
        try:
            ret = lib.seccomp_export_bpf(ctx, fd)
            if ret < 0:
                raise OSError(-ret, "seccomp_export_bpf")
            os.lseek(fd, 0, os.SEEK_SET)
            return os.read(fd, 1 << 20)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def load_seccomp(bpf: bytes) -> None:
    """Load a filter `compile_seccomp` made (no_new_privs must be set already)."""

    class Fprog(ctypes.Structure):
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

    if not bpf or len(bpf) % 8:
        raise OSError(errno.EINVAL, "a seccomp program is a whole number of 8-byte filters")
    program = ctypes.create_string_buffer(bpf, len(bpf))
    prog = Fprog(len(bpf) // 8, ctypes.cast(program, ctypes.c_void_p))
    ret = libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)
    _check(ret, "prctl(PR_SET_SECCOMP)")
