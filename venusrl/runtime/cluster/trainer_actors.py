"""The trainer ranks as Ray actors (`runtime.kind=ray`, `trainer.world_size` > 1): one placement
group of `trainer.world_size` bundles (a GPU each with `trainer.device=cuda`, else
`runtime.trainer_cpus` CPUs), one actor per bundle running the same `RankServer` as a local
rank process, driven by `RankedTrainer` through `RayRanks`.

PACK, not STRICT_PACK: FSDP gathers and reduces every layer's parameters each step, so the ranks
belong on as few nodes as hold them (NVLink, not the network), but a group larger than one node
must still be placed rather than wait for ever. torch.distributed meets at rank 0's node (its IP,
a port free there). Every rank reads the model directory and writes its checkpoint shards into
the run directory: on several nodes, both must be on a filesystem all of them share.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Collection, Iterator
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from venusrl.runtime.cluster.ray_cluster import CALLS, at_default_priority
from venusrl.runtime.config import RuntimeConfig
from venusrl.trainer.rank_link import STREAM_AHEAD, Message, RankGone, RankJob
from venusrl.trainer.rank_server import RankServer

PLACEMENT_TIMEOUT_S = 300.0  # the placement group and the actors' start


class TrainerRank:
    """One rank (a Ray actor): `run` streams a command's messages; `until_closed` answers only
    when the rank closes, so that the driver, waiting on it, sees the actor die."""

    def __init__(self, job: RankJob, rank: int, world_size: int) -> None:
        at_default_priority()  # the trainer is the run's critical path, as the engines are
        self.server = RankServer(job, rank, world_size)
        self._closed = threading.Event()

    def rendezvous(self) -> str:
        """torch.distributed's meeting point on this node: its IP, a port free on it now."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def whereabouts(self) -> str:
        """This actor's pid and its node's IP, to name it if it dies."""
        return f"pid {os.getpid()} on {ray.util.get_node_ip_address()}"

    def run(self, command: str, args: tuple[Any, ...]) -> Iterator[Message]:
        yield from self.server.handle(command, args)

    def until_closed(self) -> None:
        self._closed.wait()

    def close(self) -> None:
        self.server.close()
        self._closed.set()


class RayRanks:
    """`RankLink` over `world_size` `TrainerRank` actors in one placement group."""

    def __init__(self, runtime: RuntimeConfig, job: RankJob, world_size: int) -> None:
        gpus = 1.0 if job.config.device.startswith("cuda") else 0.0
        wanted = {"GPU": gpus, "CPU": runtime.trainer_cpus}
        bundle = {k: v for k, v in wanted.items() if v > 0}  # Ray refuses a zero
        self._group = placement_group([bundle] * world_size, strategy="PACK")
        self._actors: list[Any] = []
        self._sentinels: list[Any] = []
        self._where: list[str] = []  # "pid N on IP", by rank
        self._closed = False
        try:
            ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(
                    f"the {world_size} trainer ranks ({bundle} each) could not be placed within"
                    f" {PLACEMENT_TIMEOUT_S:.0f} s: the rollout workers or other jobs hold the"
                    " cluster's resources"
                )
            # Ray's type stubs do not list concurrency_groups, which it takes.
            watched = ray.remote(concurrency_groups={"watch": 1})  # type: ignore[call-overload]
            remote = watched(TrainerRank)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(self._group, rank)
                self._actors.append(
                    remote.options(
                        name=f"trainer-rank-{rank}",
                        namespace=runtime.namespace,
                        num_cpus=bundle.get("CPU", 0.0),
                        num_gpus=bundle.get("GPU", 0.0),
                        max_restarts=0,  # a rank cannot rejoin its group: the run stops
                        scheduling_strategy=strategy,
                    ).remote(job, rank, world_size)
                )
            self._sentinels = [
                a.until_closed.options(concurrency_group="watch").remote() for a in self._actors
            ]
            self._streams: list[Any] = [None] * world_size
            self._where = [self._first(a.whereabouts.remote()) for a in self._actors]
            self.init_method = self._first(self._actors[0].rendezvous.remote())
        except BaseException:
            self.close(grace_s=0)
            raise

    def send(self, rank: int, command: str, args: tuple[Any, ...]) -> None:
        CALLS["run"] += 1
        self._streams[rank] = (
            self._actors[rank]
            .run.options(num_returns="streaming", _generator_backpressure_num_objects=STREAM_AHEAD)
            .remote(command, args)
        )

    def receive(self, ranks: Collection[int], timeout_s: float) -> tuple[int, Message] | None:
        streams = [self._streams[r] for r in ranks]
        ready, _ = ray.wait([*streams, *self._sentinels], num_returns=1, timeout=timeout_s)
        for r, sentinel in enumerate(self._sentinels):
            if sentinel in ready:
                raise self._gone(r)
        if not ready:
            return None
        rank = min(r for r in ranks if any(self._streams[r] is x for x in ready))
        try:
            message: Message = ray.get(next(self._streams[rank]))
        except (RayActorError, StopIteration):
            raise self._gone(rank) from None
        return rank, message

    def close(self, grace_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        if grace_s > 0 and self._sentinels:
            ray.wait([a.close.remote() for a in self._actors], num_returns=len(self._actors),
                     timeout=grace_s)  # fmt: skip
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        if self._sentinels:  # gone, their GPUs and names free for whatever starts next
            ray.wait(self._sentinels, num_returns=len(self._sentinels), timeout=10)
        remove_placement_group(self._group)

    def _first(self, ref: Any) -> Any:
        """`ray.get(ref)` within the start's timeout, or the rank that died meanwhile."""
        ready, _ = ray.wait([ref, *self._sentinels], num_returns=1, timeout=PLACEMENT_TIMEOUT_S)
        for r, sentinel in enumerate(self._sentinels):
            if sentinel in ready:
                raise self._gone(r)
        if not ready:
            raise ValueError(
                f"the trainer ranks did not start within {PLACEMENT_TIMEOUT_S:.0f} s: is every"
                " node's venusrl install importable?"
            )
        return ray.get(ref)

    def _gone(self, rank: int) -> RankGone:
        where = f", {self._where[rank]}" if rank < len(self._where) else ""
        try:
            ray.get(self._sentinels[rank], timeout=5)
            detail = "it closed"
        except RayActorError as e:
            detail = str(e)
        except ray.exceptions.GetTimeoutError:
            detail = "it stopped answering"
        return RankGone(rank, f"(Ray actor trainer-rank-{rank}{where}) died", detail)
