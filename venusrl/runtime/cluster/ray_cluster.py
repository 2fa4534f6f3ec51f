"""Joining (or starting) the Ray cluster, and calling actors with our own error types."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import ray
from ray.exceptions import RayActorError, RayTaskError

from venusrl.runtime.config import RuntimeConfig
from venusrl.trainer.config import TrainerConfig

T = TypeVar("T")
P = ParamSpec("P")
Actor = TypeVar("Actor")
# A method of an actor's class, named to call it on a handle: its arguments and result typed.
Method = Callable[Concatenate[Actor, P], Awaitable[T]]
log = logging.getLogger(__name__)
# Actor calls this process made, by method name: each costs the caller ~1 ms of CPU (submission,
# serialisation), what the Ray runtime adds over one process (`cluster.json`, runtime_overhead.py).
CALLS: Counter[str] = Counter()


class ActorLost(RuntimeError):
    """The actor behind a call died (or is restarting): the work it held is gone."""


class RayCluster:
    """The cluster a run places its actors on. Joins `address`, or starts a one-node cluster
    here; a Ray session the caller already opened is used as it is (and left open)."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg
        self._calls_at_start = CALLS.copy()
        self._owned = not ray.is_initialized()
        if self._owned:
            check_reachable(cfg.address)
            ray.init(
                # Ray reads None as "the cluster started last, if its address file says one":
                # a session killed without `ray stop` leaves that file, and the run would wait
                # on a dead cluster forever. "local" starts one here, as None is documented to.
                address=cfg.address or "local",
                namespace=cfg.namespace,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )

    def check_room(self, trainer: TrainerConfig) -> None:
        """Refuse, before anything starts, engines and trainer ranks the cluster can never hold
        together (Ray would keep them pending forever)."""
        total = ray.cluster_resources()
        rt = self.cfg
        ranks = trainer.world_size if trainer.world_size > 1 else 0  # else in the driver
        rank_gpus = 1.0 if trainer.device.startswith("cuda") else 0.0
        for resource, each, rank_each in (
            ("CPU", rt.engine_cpus, rt.trainer_cpus),
            ("GPU", rt.engine_gpus, rank_gpus),
        ):
            have, need = total.get(resource, 0.0), rt.engines * each + ranks * rank_each
            if need > have:
                key = f"runtime.engine_{resource.lower()}s"
                asked = f"runtime.engines={rt.engines} x {key}={each}"
                if ranks * rank_each:
                    asked += f" + trainer.world_size={ranks} x {rank_each:g}"
                raise ValueError(f"{asked} needs {need:g} {resource}s; the cluster has {have:g}")

    def nodes(self) -> list[str]:
        """The ids of the nodes that are alive, in a stable order (the head's first)."""
        alive = [n for n in ray.nodes() if n["Alive"]]
        head = ray.get_runtime_context().get_node_id()
        return sorted((n["NodeID"] for n in alive), key=lambda node: (node != head, node))

    def actor_calls(self) -> dict[str, int]:
        """Actor calls made since this run joined the cluster, by method."""
        return dict((CALLS - self._calls_at_start).most_common())

    def shutdown(self) -> None:
        if self._owned:
            ray.shutdown()


def at_default_priority() -> None:
    """Run this actor's process at niceness 0. Ray starts worker processes at niceness 15, below
    the driver; the engines and the sandbox pools are the job's critical path (sandboxes inherit
    their pool's niceness), so they get the priority they have in one process. Linux keeps a
    nice value per thread: every thread of the process is reset, and threads started later
    inherit it."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except PermissionError:
        log.warning("cannot raise this actor's priority to niceness 0 (needs CAP_SYS_NICE)")
    except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
        pass


def available_memory_bytes() -> int:
    """This node's available memory (what its actors' sandbox pools are sized from)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def check_reachable(address: str | None) -> None:
    """A `host:port` nobody answers on makes `ray.init` retry for minutes: say so at once."""
    if address is None or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"runtime.address: {address!r} is not host:port, 'auto' or ray://...")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"runtime.address: nothing answers at {address} ({e})") from None


def by_ref(value: T) -> T:
    """`value` put in the object store once, for many actor calls to share: Ray hands each call
    the object itself (an argument that is a ref is resolved), so the calls type as with `T`."""
    return cast(T, ray.put(value))


async def call(actor: Any, method: Method[Actor, P, T], *args: P.args, **kw: P.kwargs) -> T:
    """`await actor.method.remote(*args, **kw)`, `method` given as the actor class's own (so a
    call is type-checked as a local one would be; Ray's handles are untyped), with the method's
    own exception re-raised as it is (a sandbox error stays a sandbox error) and a dead actor as
    `ActorLost`."""
    name = method.__name__
    CALLS[name] += 1
    try:
        result: T = await getattr(actor, name).remote(*args, **kw)
        return result
    except RayTaskError as e:
        if isinstance(e.cause, BaseException):
            raise e.cause from None
        raise
    except RayActorError as e:
        raise ActorLost(str(e).splitlines()[0]) from e


async def until_alive(ping: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """Retry `ping` until the actor answers (Ray restarts it in the meantime)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await ping()
        except ActorLost:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


class Replicas:
    """Which of N restartable actors are up. One found dead is taken out of service and brought
    back in the background: `revive(i)` waits for Ray's restart and redoes what the owner needs
    (weights, templates); the actor is up again when it returns. It raises `ActorLost` when the
    actor died again meanwhile: that death is counted, and while Ray has restarts left for it
    (`max_restarts`, as the actor was made with) the revive starts over; then it stays down."""

    def __init__(self, n: int, revive: Callable[[int], Awaitable[None]], max_restarts: int) -> None:
        self.up: set[int] = set()
        self.restarts = [0] * n  # deaths seen, per actor: Ray restarts one max_restarts times
        self.max_restarts = max_restarts
        self._revive = revive
        self._reviving: set[asyncio.Future[None]] = set()

    def lost(self, i: int, epoch: int) -> bool:
        """Take actor i out of service after a call made at `epoch` (its restarts then) failed;
        False if it already was, or if the call was made to an incarnation that is already
        replaced (a failure that arrives after the restart says nothing of the new one)."""
        if i not in self.up or epoch != self.restarts[i]:
            return False
        self.up.discard(i)
        self.restarts[i] += 1
        if self.restarts[i] > self.max_restarts:  # Ray will not restart it
            return True
        task = asyncio.ensure_future(self._back(i))
        self._reviving.add(task)
        task.add_done_callback(self._reviving.discard)
        return True

    async def call(
        self, i: int, epoch: int, actor: Any, method: Method[Actor, P, T],
        *args: P.args, **kw: P.kwargs,
    ) -> T:  # fmt: skip
        """`call(actor, method, ...)` on actor i, made at `epoch`; if the actor is dead, it is
        taken out of service (and brought back) before `ActorLost` reaches the caller."""
        try:
            return await call(actor, method, *args, **kw)
        except ActorLost:
            self.lost(i, epoch)
            raise

    async def _back(self, i: int) -> None:
        while True:
            try:
                await self._revive(i)
            except ActorLost:  # died again while being brought back
                self.restarts[i] += 1
                if self.restarts[i] > self.max_restarts:
                    return
                continue
            self.up.add(i)
            return

    def cancel(self) -> None:
        for task in list(self._reviving):
            task.cancel()
