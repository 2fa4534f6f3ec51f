"""Memory, pids, cpu and freezer cgroups for sandboxes, on cgroup v1 or v2.

A sandbox's memory cgroup is charged exactly the pages its processes touched first, so a member
forked from a warm template is charged its private pages only (the template's pages stay charged
to the template's cgroup). Reading `memory.usage_in_bytes` / `memory.current` costs ~15 us; summing
RSS would count shared pages K times and `smaps_rollup` costs ~2.4 ms per process (MEASURED.md).

One `Cgroup` is one node of the tree, present in every controller we use. On v1 that is one
directory per controller (memory, pids, cpu, freezer); on v2 one directory in the unified tree.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
CPU_PERIOD_US = 100_000


@functools.cache
def _v2_root() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _dev, mountpoint, fstype, *_ = line.split()
        if fstype == "cgroup2":
            controllers = Path(mountpoint, "cgroup.controllers")
            if controllers.exists() and "memory" in controllers.read_text().split():
                return Path(mountpoint)
    return None


def detect_version() -> int:
    """1 when memory/pids/cpu/freezer are on v1 (this machine), 2 when memory is on v2."""
    if all((V1_ROOT / c / "cgroup.procs").exists() for c in V1_CONTROLLERS):
        return 1
    if _v2_root() is not None:
        return 2
    raise RuntimeError(
        "no usable cgroups: need memory, pids, cpu and freezer on cgroup v1 under /sys/fs/cgroup, "
        "or a cgroup2 mount with the memory controller"
    )


def _read_key(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


@dataclass(frozen=True)
class Cgroup:
    """A node of the tree, relative path `rel` (e.g. "venusrl/pool-12/sb-3")."""

    rel: str
    version: int

    def dirs(self) -> list[Path]:
        if self.version == 1:
            return [V1_ROOT / c / self.rel for c in V1_CONTROLLERS]
        root = _v2_root()
        assert root is not None
        return [root / self.rel]

    def _file(self, controller: str, name: str) -> Path:
        if self.version == 1:
            return V1_ROOT / controller / self.rel / name
        return self.dirs()[0] / name

    def procs_files(self) -> list[str]:
        """Where a process writes its pid to join (every controller on v1)."""
        return [str(d / "cgroup.procs") for d in self.dirs()]

    def child(self, name: str) -> Cgroup:
        return Cgroup(f"{self.rel}/{name}", self.version)

    # --- lifecycle -------------------------------------------------------------------------------

    def create(self) -> None:
        for d in self.dirs():
            d.mkdir(parents=True, exist_ok=True)
        if self.version == 2:  # children need the controllers enabled in every ancestor
            root = _v2_root()
            assert root is not None
            node = root
            for part in Path(self.rel).parts:
                with contextlib.suppress(OSError):
                    (node / "cgroup.subtree_control").write_text("+memory +pids +cpu")
                node = node / part

    def exists(self) -> bool:
        return self.dirs()[0].exists()

    def limit(self, memory_bytes: int | None, max_pids: int | None, cpus: float | None) -> None:
        if memory_bytes is not None:
            name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
            self._file("memory", name).write_text(str(memory_bytes))
            if self.version == 2:  # no swap: an over-limit sandbox is OOM-killed, not paged out
                with contextlib.suppress(OSError):
                    self._file("memory", "memory.swap.max").write_text("0")
        if max_pids is not None:
            self._file("pids", "pids.max").write_text(str(max_pids))
        if cpus is not None:
            quota = max(1000, int(cpus * CPU_PERIOD_US))
            if self.version == 1:
                self._file("cpu", "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                self._file("cpu", "cpu.cfs_quota_us").write_text(str(quota))
            else:
                self._file("cpu", "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")

    def pids(self) -> list[int]:
        try:
            text = self._file("pids", "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def all_pids(self) -> list[int]:
        """Pids of this node and every descendant."""
        base = self.dirs()[0] if self.version == 2 else V1_ROOT / "pids" / self.rel
        out: list[int] = []
        for root, _dirs, files in os.walk(base):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):  # removed meanwhile (ENOENT or ENODEV)
                    out += [int(p) for p in Path(root, "cgroup.procs").read_text().split()]
        return out

    def freeze(self, frozen: bool) -> None:
        if self.version == 1:
            path = self._file("freezer", "freezer.state")
            with contextlib.suppress(FileNotFoundError):
                path.write_text("FROZEN" if frozen else "THAWED")
        else:
            with contextlib.suppress(FileNotFoundError):
                self._file("cpu", "cgroup.freeze").write_text("1" if frozen else "0")

    def _thaw_subtree(self) -> None:
        """Thaw this node and every descendant. Thawing a node does not thaw a child frozen on
        its own account: one a process froze to kill it and then died (a run killed mid-kill)
        stays frozen, and its processes, their SIGKILL pending, never exit."""
        if self.version == 1:
            base, name, thawed = V1_ROOT / "freezer" / self.rel, "freezer.state", "THAWED"
        else:
            base, name, thawed = self.dirs()[0], "cgroup.freeze", "0"
        for root, _dirs, files in os.walk(base):
            if name in files:
                with contextlib.suppress(OSError):  # removed meanwhile
                    Path(root, name).write_text(thawed)

    def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in this subtree. A pid-namespace init ignores SIGTERM and a fork
        bomb outruns a kill loop, so: freeze, kill, thaw (the kills land), repeat until empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.all_pids()
            if not pids:
                return
            self.freeze(True)
            for pid in self.all_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._thaw_subtree()
            if time.monotonic() > deadline:
                raise RuntimeError(f"cgroup {self.rel} still has processes {pids[:8]} after kill")
            time.sleep(0.002)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill everything, then remove the subtree, leaves first."""
        if not self.exists():
            return
        self.kill(timeout_s)
        for d in self.dirs():
            if not d.exists():
                continue
            for root, dirs, _files in sorted(os.walk(d), key=lambda w: -len(w[0])):
                for name in dirs:
                    _rmdir_retry(Path(root, name))
            _rmdir_retry(d)

    # --- readings --------------------------------------------------------------------------------

    @functools.cached_property
    def _usage_path(self) -> str:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return str(self._file("memory", name))

    def memory_bytes(self) -> int:
        # Polled for every sandbox many times a second, on the event loop's thread: a raw
        # read of a cached path costs half of what pathlib's read_text does.
        try:
            fd = os.open(self._usage_path, os.O_RDONLY)
        except OSError:  # removed meanwhile
            return 0
        try:
            return int(os.read(fd, 32))
        except (OSError, ValueError):
            return 0
        finally:
            os.close(fd)

    def peak_memory_bytes(self) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int(self._file("memory", name).read_text())
        except (FileNotFoundError, OSError):  # memory.peak needs Linux 5.19
            return self.memory_bytes()

    def oom_kills(self) -> int:
        """OOM kills caused by this node's own limit (not by its children's)."""
        try:
            if self.version == 1:
                return _read_key(self._file("memory", "memory.oom_control"), "oom_kill")
            return _read_key(self._file("memory", "memory.events.local"), "oom_kill")
        except OSError:
            return 0


def _rmdir_retry(path: Path) -> None:
    # A cgroup whose last process just died can be busy for a moment.
    for _ in range(200):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)
    path.rmdir()
