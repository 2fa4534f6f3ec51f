"""Sandbox pools across nodes: one environment manager actor per node, one facade for the
coordinator.

Each node runs its own `SandboxPool` (memory admission, warm templates, page sharing) inside an
environment manager actor pinned to it. The driver sees `ClusterPool`, with the calls of a local
pool: a new group goes to the node with the most admissible memory (`policy.placement`), and
all of a group's members are forked on that node, from the group's one zygote. Each sandbox verb
is one actor call; the tool's output comes back, nothing else.

An environment manager that dies takes its sandboxes with it: calls on them raise
`SandboxCrashed` (an infrastructure failure, replaced by the coordinator), Ray restarts the
actor, and the facade prepares the run's templates on it again before placing groups there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from venusrl.config import Config
from venusrl.envs.pool import SandboxGroup, SandboxPool
from venusrl.envs.sandbox import Sandbox
from venusrl.envs.types import ExecResult, SandboxCrashed, TemplateSpec
from venusrl.policy.placement import most_room
from venusrl.runtime.cluster.ray_cluster import (
    ActorLost,
    Replicas,
    at_default_priority,
    call,
    until_alive,
)

GiB = 1 << 30
RESTART_TIMEOUT_S = 300.0
NODE_MEMORY_FRACTION = 0.8  # of the node's available memory, at most, for its sandboxes


def _available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


class EnvManager:
    """The sandbox pool of one node, as a Ray actor. Sandboxes and groups are named by keys."""

    def __init__(self, budget_bytes: int, admission: str, share_pages: bool) -> None:
        at_default_priority()
        # Sized from the node: the configured budget, but never more than the node can give.
        budget = min(budget_bytes, int(NODE_MEMORY_FRACTION * _available_memory_bytes()))
        self.pool = SandboxPool(budget, admission=admission, share_pages=share_pages)  # type: ignore[arg-type]
        self._started = False
        self._groups: dict[str, SandboxGroup] = {}
        self._sandboxes: dict[str, Sandbox] = {}
        self._ids = itertools.count()

    async def ready(self, templates: list[TemplateSpec]) -> str:
        """Start the pool and prepare `templates` (again, after a restart); the node's id."""
        if not self._started:
            await self.pool.start()
            self._started = True
        for spec in templates:
            await self.pool.prepare_template(spec)
        return str(ray.get_runtime_context().get_node_id())

    def room(self) -> int:
        return self.pool.room_bytes()

    async def open_group(
        self, template: str, priority: int, setup: str | None, files: Mapping[str, bytes] | None
    ) -> str:
        key = f"g{next(self._ids)}"
        self._groups[key] = await self.pool.open_group(template, priority, setup, files)
        return key

    async def add(self, group: str) -> tuple[str, str]:
        """A new member of `group`: its key, and the node it runs on."""
        key = self._keep(await self._group(group).add())
        return key, str(ray.get_runtime_context().get_node_id())

    async def create(
        self, template: str, priority: int, setup: str | None, files: Mapping[str, bytes] | None
    ) -> str:
        return self._keep(await self.pool.create(template, priority, setup, files))

    async def verb(self, sandbox: str, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        if name not in ("exec", "run_python", "read_file", "write_file"):
            raise ValueError(f"{name} is not a sandbox verb")
        return await getattr(self._sandbox(sandbox), name)(*args, **kw)

    async def close_sandbox(self, sandbox: str) -> None:
        sb = self._sandboxes.pop(sandbox, None)
        if sb is not None:
            await sb.close()

    async def close_group(self, group: str) -> None:
        g = self._groups.pop(group, None)
        if g is not None:
            for sb in g:
                self._sandboxes.pop(sb.id, None)
            await g.close()

    def stats(self) -> dict[str, Any]:
        return self.pool.stats().as_dict()

    async def shutdown(self) -> None:
        await self.pool.close()

    def _keep(self, sb: Sandbox) -> str:
        self._sandboxes[sb.id] = sb
        return sb.id

    def _group(self, key: str) -> SandboxGroup:
        g = self._groups.get(key)
        if g is None:  # its manager restarted since the group opened
            raise SandboxCrashed(f"group {key} is not on this node (its manager restarted)")
        return g

    def _sandbox(self, key: str) -> Sandbox:
        sb = self._sandboxes.get(key)
        if sb is None:
            raise SandboxCrashed(f"sandbox {key} is not on this node (its manager restarted)")
        return sb


class RemoteSandbox:
    """A sandbox on some node: the verbs of `Sandbox` that environments use, one call each."""

    def __init__(self, pool: ClusterPool, node: int, epoch: int, key: str) -> None:
        self._pool, self.node, self._epoch, self.id = pool, node, epoch, key
        self._closed = False
        pool._running += 1

    async def exec(
        self, command: str | Sequence[str], /, *, timeout_s: float, max_output_bytes: int
    ) -> ExecResult:
        kw = {"timeout_s": timeout_s, "max_output_bytes": max_output_bytes}
        return await self._verb("exec", (command,), kw)

    async def run_python(self, source: str, /, *, timeout_s: float) -> ExecResult:
        return await self._verb("run_python", (source,), {"timeout_s": timeout_s})

    async def read_file(self, path: str, /) -> bytes:
        return await self._verb("read_file", (path,), {})

    async def write_file(self, path: str, data: bytes, /) -> None:
        await self._verb("write_file", (path, data), {})

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool._running -= 1
        with contextlib.suppress(SandboxCrashed):
            await self._pool._call(self.node, self._epoch, "close_sandbox", self.id)

    async def _verb(self, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        return await self._pool._call(self.node, self._epoch, "verb", self.id, name, args, kw)


class RemoteGroup(list[RemoteSandbox]):
    """A group's sandboxes, all on one node (`SandboxGroup`'s calls)."""

    def __init__(self, pool: ClusterPool, node: int, epoch: int, key: str) -> None:
        super().__init__()
        self._pool, self.node, self._epoch, self.key = pool, node, epoch, key

    async def add(self) -> RemoteSandbox:
        key, node_id = await self._pool._call(self.node, self._epoch, "add", self.key)
        self._pool.member_on(self.node, self._epoch, self.key, node_id)
        sb = RemoteSandbox(self._pool, self.node, self._epoch, key)
        self.append(sb)
        return sb

    async def close(self) -> None:
        self._pool.group_closed(self.node, self._epoch, self.key)
        with contextlib.suppress(SandboxCrashed):
            await self._pool._call(self.node, self._epoch, "close_group", self.key)


class ClusterPool:
    """Where the coordinator's sandboxes come from in a Ray run: one pool per node."""

    def __init__(self, cfg: Config, nodes: list[str]) -> None:
        rt, sb = cfg.runtime, cfg.sandbox
        self.nodes = nodes
        self.managers: list[Any] = [
            ray.remote(EnvManager)
            .options(
                name=f"sandboxes-{i}",
                namespace=rt.namespace,
                num_cpus=0,
                max_restarts=rt.actor_restarts,
                max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote(int(sb.memory_budget_gib * GiB), sb.admission, sb.share_pages)
            for i, node in enumerate(nodes)
        ]
        self.templates: list[TemplateSpec] = []
        # Restarts per manager are its epochs: keys made before the latest one are gone.
        self.replicas = Replicas(len(nodes), self._revive)
        self.groups_per_node = [0] * len(nodes)
        self.groups_since_start = [0] * len(nodes)  # since the manager's last (re)start
        self._running = 0
        # An open group (manager, its epoch, key: a restarted manager numbers its groups from
        # the start again) -> the nodes its members' managers reported running them on. A
        # closed group is kept only as a count, if its members ran on several nodes.
        self.member_nodes: dict[tuple[int, int, str], set[str]] = {}
        self.groups_on_several_nodes = 0

    def member_on(self, node: int, epoch: int, key: str, node_id: str) -> None:
        self.member_nodes.setdefault((node, epoch, key), set()).add(node_id)

    def group_closed(self, node: int, epoch: int, key: str) -> None:
        if len(self.member_nodes.pop((node, epoch, key), ())) > 1:
            self.groups_on_several_nodes += 1

    async def __aenter__(self) -> ClusterPool:
        await asyncio.gather(*(call(m.ready, []) for m in self.managers))
        self.replicas.up = set(range(len(self.managers)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def prepare_template(self, spec: TemplateSpec) -> None:
        self.templates.append(spec)
        await asyncio.gather(
            *(call(self.managers[i].ready, [spec]) for i in sorted(self.replicas.up))
        )

    async def open_group(
        self,
        template: str,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> RemoteGroup:
        node = await self._place()
        epoch = self.replicas.restarts[node]
        key = await self._call(node, epoch, "open_group", template, priority, setup, files)
        self.groups_per_node[node] += 1
        self.groups_since_start[node] += 1
        return RemoteGroup(self, node, epoch, key)

    async def create(
        self,
        template: str,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> RemoteSandbox:
        node = await self._place()
        epoch = self.replicas.restarts[node]
        key = await self._call(node, epoch, "create", template, priority, setup, files)
        return RemoteSandbox(self, node, epoch, key)

    def sandboxes_running(self) -> int:
        return self._running

    async def _place(self) -> int:
        up = sorted(self.replicas.up)
        if not up:
            raise SandboxCrashed("no environment manager is up")
        rooms = await asyncio.gather(*(self._room(i) for i in up))
        return up[most_room(rooms)]

    async def _room(self, i: int) -> int:
        try:
            return int(await self._call(i, self.replicas.restarts[i], "room"))
        except SandboxCrashed:
            return -1

    async def _call(self, node: int, epoch: int, method: str, *args: Any) -> Any:
        if node not in self.replicas.up or epoch != self.replicas.restarts[node]:
            raise SandboxCrashed(f"the environment manager on node {node} restarted")
        try:
            return await self.replicas.call(
                node, epoch, getattr(self.managers[node], method), *args
            )
        except ActorLost as e:
            raise SandboxCrashed(f"the environment manager on node {node} died: {e}") from e

    async def _revive(self, i: int) -> None:
        """Wait for Ray to restart manager i; its successor reaps the dead pool's sandboxes when
        its pool starts, and prepares the run's templates again."""
        self.groups_since_start[i] = 0
        manager = self.managers[i]
        await until_alive(lambda: call(manager.ready, self.templates), RESTART_TIMEOUT_S)

    async def report(self) -> dict[str, Any]:
        """Placement, restarts, and each node's pool statistics (None for a pool that is down)."""
        stats = await asyncio.gather(*(self._stats(i) for i in range(len(self.managers))))
        return {
            "pools": stats,
            "sandbox_nodes": self.nodes,
            "groups_per_node": self.groups_per_node,
            "manager_restarts": self.replicas.restarts,
            "groups_since_start": self.groups_since_start,
            "groups_on_several_nodes": self.groups_on_several_nodes
            + sum(len(n) > 1 for n in self.member_nodes.values()),
        }

    async def _stats(self, i: int) -> dict[str, Any] | None:
        if i not in self.replicas.up:
            return None
        try:
            return dict(await call(self.managers[i].stats))
        except ActorLost:
            return None

    async def close(self) -> None:
        self.replicas.cancel()
        for i in sorted(self.replicas.up):
            with contextlib.suppress(ActorLost):
                await call(self.managers[i].shutdown)
        for manager in self.managers:
            ray.kill(manager, no_restart=True)
