"""The processes a test started, and only those: the machine is shared with other runs, whose
sandboxes (and the orphans of their killed pools) come and go during ours, so a leak check that
counts every sandbox on the host fails whenever another run is about."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

from venusrl.envs.cgroups import Cgroup, detect_version
from venusrl.envs.orphans import CGROUP_BASE

# A script that opens a sandbox pool, leaves a sandbox process running and prints the pool's
# name: another run, whose kill -9 orphans its sandboxes.
ORPHAN_MAKER = """
import asyncio, sys
from venusrl.envs import SandboxPool
async def main():
    pool = SandboxPool(memory_budget_bytes=1 << 30)
    await pool.start()
    sb = await pool.create("python")
    await sb.exec("sleep 1000 >/dev/null 2>&1 &")
    print(pool.name, flush=True)
    await asyncio.sleep(1000)
asyncio.run(main())
"""


def pool_processes(owners: Collection[int]) -> set[int]:
    """The processes in the cgroups of the sandbox pools opened by the processes `owners`, alive
    or gone (a pool is named `pool-<pid>-<n>` after its process, and a sandbox stays in its
    cgroup until it is killed, whoever its parent has become)."""
    base = Cgroup(CGROUP_BASE, detect_version())
    if not base.exists():
        return set()
    found: set[int] = set()
    for pool in base.dirs()[0].iterdir():
        kind, _, rest = pool.name.partition("-")
        owner = rest.partition("-")[0]
        if kind == "pool" and owner.isdigit() and int(owner) in owners:
            with contextlib.suppress(OSError):  # the pool closed meanwhile
                found |= set(base.child(pool.name).all_pids())
    return found


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):  # exited while we looked
                stat = Path(f"/proc/{name}/stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def our_processes() -> set[int]:
    """What this process started: its descendants, and its pools' sandboxes even once orphaned
    (a sandbox process that outlived its pool)."""
    me = os.getpid()
    return descendants(me) | pool_processes({me})


def left_after(count: Callable[[], set[int]], timeout_s: float) -> set[int]:
    """What `count()` still finds after up to `timeout_s` (a killed process leaves /proc only
    once its parent has reaped it)."""
    deadline = time.monotonic() + timeout_s
    while (left := count()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def wait_for_no_new_processes(before: set[int], timeout_s: float) -> set[int]:
    """The processes this one started since `before` that are still alive after `timeout_s`."""
    return left_after(lambda: our_processes() - before, timeout_s)
