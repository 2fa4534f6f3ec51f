"""Where pools keep their cgroups and directories, and the reaping of what crashed pools left.

A pool is named `pool-<pid>-<n>` after its process, so the next pool on the node can tell a live
pool's cgroup and runtime directory from those of a process that died without closing its pool.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from venusrl.envs.cgroups import Cgroup

log = logging.getLogger(__name__)
CGROUP_BASE = "venusrl"
RUNTIME_BASE = Path("/tmp/venusrl-sandboxes")


def private_dir(path: Path) -> None:
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
