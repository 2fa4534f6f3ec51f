"""Where pools keep their cgroups and directories, and the reaping of what crashed pools left.

A pool is named `pool-<pid>-<n>` after its process, so the next pool on the node can tell a live
pool's cgroup and runtime directory from those of a process that died without closing its pool.
A process killed outright (`kill -9`) leaves no sandbox running (each member exits when its pool's
socket closes, and its pid namespace with it) and no mount (every mount is in a sandbox's or a
zygote's own mount namespace); its cgroups and directories are removed by its reaper
(`watch_process`), a small process of its own session that waits for it to die.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from venusrl.envs.cgroups import Cgroup

log = logging.getLogger(__name__)
CGROUP_BASE = "venusrl"
RUNTIME_BASE = Path("/tmp/venusrl-sandboxes")


def private_dir(path: Path) -> None:
    """Root's own directory, not a symlink, writable by nobody else: the pool creates, chowns
    and removes files under it as root, so nobody else may plant anything there. Others may
    traverse it: a sandbox builds its root from paths under it in its own user namespace."""
    path.mkdir(mode=0o711, exist_ok=True)
    path.chmod(0o711)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise PermissionError(
            f"{path} must be a directory owned by root and writable only by it; remove it"
        )


def _pid_alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped by its parent, is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except (FileNotFoundError, ProcessLookupError):  # gone, or going as it is read
        return False
    return stat_line[stat_line.rindex(b")") + 2 :][:1] not in (b"Z", b"X")


def _dead_pool_names(names: Iterator[str], pid: int | None = None) -> list[str]:
    dead = []
    for name in names:
        parts = name.split("-")
        is_pool = len(parts) == 3 and parts[0] == "pool" and parts[1].isdigit()
        if is_pool and pid is not None and int(parts[1]) != pid:
            continue
        if is_pool and not _pid_alive(int(parts[1])):
            dead.append(name)
    return dead


# The reaper, the write end of its pipe and the pid it watches (a forked child is not it).
_reaper: list[tuple[subprocess.Popen[bytes], int, int]] = []


def watch_process(version: int) -> None:
    """Start, once per process, a reaper that outlives it: when this process is gone (however
    it died), the reaper removes every pool it left. It learns of the death when the pipe
    only this process holds closes."""
    if _reaper and _reaper[0][2] == os.getpid() and _reaper[0][0].poll() is None:
        return
    read_end, write_end = os.pipe()  # the write end stays here, never inherited by an exec
    code = "from venusrl.envs.orphans import reaper_main; reaper_main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(os.getpid()), str(version)],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C of the run's terminal does not stop it
    )
    os.close(read_end)
    _reaper[:] = [(proc, write_end, os.getpid())]


def reaper_main() -> None:
    pid, version = int(sys.argv[1]), int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.read(0, 1 << 12):
        pass
    for _ in range(100):  # the pipe closes as the process exits; wait until it is gone
        if not _pid_alive(pid):
            break
        time.sleep(0.05)
    base = Cgroup(CGROUP_BASE, version).dirs()[0]
    for _ in range(5):  # a loaded machine may be slow to let the last process die
        reap_orphans(version, pid)
        left = [
            d
            for d in (base.iterdir() if base.exists() else ())
            if d.name.startswith(f"pool-{pid}-")
        ]
        if not left:
            return
        time.sleep(1.0)


def reap_orphans(version: int, pid: int | None = None) -> list[str]:
    """Kill and remove what pools of crashed processes (of `pid` only, if given) left behind:
    cgroups, directories."""
    base = Cgroup(CGROUP_BASE, version)
    reaped = []
    if base.exists():
        names = (d.name for d in base.dirs()[0].iterdir() if d.is_dir())
        for name in _dead_pool_names(names, pid):
            try:
                base.child(name).remove()
            except (RuntimeError, OSError) as e:  # a process stuck in the kernel: not our run's
                log.warning("could not reap the cgroup of dead pool %s: %s", name, e)
                continue
            reaped.append(name)
    if RUNTIME_BASE.exists():
        for name in _dead_pool_names((d.name for d in RUNTIME_BASE.iterdir()), pid):
            shutil.rmtree(RUNTIME_BASE / name, ignore_errors=True)
            reaped.append(name)
    return sorted(set(reaped))
