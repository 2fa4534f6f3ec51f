"""Sandboxes need root (namespaces, cgroups, mounts); CI runs as root."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

requires_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the local sandbox backend needs root (namespaces, cgroups)"
)


def our_processes() -> set[int]:
    """Pids a test may have started: descendants of this process, and processes of another pid
    namespace (each sandbox has its own) that were orphaned, i.e. whose nearest ancestor in our
    namespace is init: a sandbox process that outlived its pool. Processes under another test
    run's pool, on a shared machine, are neither (counting them failed leak checks whenever
    another run started sandboxes)."""
    own_ns = os.readlink("/proc/self/ns/pid")
    parent: dict[int, int] = {}
    foreign: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            ns = os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:  # exited while we looked
            continue
        parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        if ns != own_ns:
            foreign.add(pid)
    me = os.getpid()
    ours: set[int] = set()
    for pid in parent:
        seen: set[int] = set()
        p = pid
        while p > 1 and p not in seen:
            if p == me:
                ours.add(pid)
                break
            seen.add(p)
            p = parent.get(p, 0)
        else:
            anchor = pid
            while anchor in foreign:
                anchor = parent.get(anchor, 0)
            if pid in foreign and anchor <= 1:
                ours.add(pid)
    ours.discard(me)
    return ours


def wait_for_no_new_processes(before: set[int], timeout_s: float) -> set[int]:
    """The processes started since `before` that are still alive after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (new := our_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return new
