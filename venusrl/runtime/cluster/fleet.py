"""The run's rollout workers (`worker.RolloutWorker`, one Ray actor each: an engine, a sandbox
pool and the agent loops beside them), seen from the driver as the coordinator's `Rollouts`, the
trainer's weight publisher and the warm start's sandbox source. Every call names the worker's
method itself (`ray_cluster.call`), so the seam is type-checked as a local call is.

- **One call per episode.** A member's whole episode (fork its sandbox from the group's zygote,
  every turn's generation, every tool call, the reward) runs in the worker; the trajectory comes
  back. Turns and tool calls never cross a process boundary, which on a small model was most of
  what the runtime cost (BENCHMARKS.md, "What the Ray runtime costs").
- **Placement.** A new group goes to the worker that holds the fewest open groups, ties to the
  one with the most admissible memory (`policy.placement.place_group`). Its K sandboxes
  fork on that node from one zygote, and its K trajectories share that engine's prompt KV; a
  trajectory never leaves the engine that holds its KV.
- **Priorities** reach the workers when the coordinator re-ranks the groups, each worker only
  the ones it holds and only when they changed. Members' progress (tokens, turns and tool time so
  far) comes back with each finished episode: the other episodes in flight on its worker.
- **Weights** go through Ray's object store a bucket at a time (`RolloutFleet.publish`), each
  engine copying each bucket as it comes: neither the driver nor the store holds a whole copy.
- **Failures.** An episode whose sandbox was preempted (a node's pool running out of memory
  preempts its lowest-priority sandboxes) moves to another worker: the group opens there
  too, a fresh sandbox forks from its setup, the environment acts again on the turns the model
  already took, and the episode goes on (the cluster form of the paper's migration fallback;
  a tool that does not answer as recorded makes it an infrastructure failure after all). A
  worker that dies takes its engine, its sandboxes and the episodes in flight with it: those are
  infrastructure failures, and the coordinator replaces them; a group whose worker died opens
  again on another worker for its replacement members, so the group still completes. Ray
  restarts the worker (its successor reaps the dead pool's sandboxes); the fleet prepares the
  templates and loads the model into it, and places groups there again once the next publish
  has given it the current weights (a group's tokens are of weights at least as new as those
  when it started: `policy.staleness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from venusrl.config import Config
from venusrl.coordinator.rollouts import OnProgress, failed
from venusrl.envs.accounts import PoolStats
from venusrl.envs.environment import Environment, Task
from venusrl.envs.types import ExecResult, InfraFailure, SandboxCrashed, TemplateSpec
from venusrl.model.weight_stream import Bucket, pack
from venusrl.policy.critical_groups import BEST_EFFORT
from venusrl.policy.placement import place_group
from venusrl.runtime.cluster.ray_cluster import (
    ActorLost,
    Method,
    P,
    RayCluster,
    Replicas,
    T,
    by_ref,
    call,
    until_alive,
)
from venusrl.runtime.cluster.reward_worker import RewardWorker, reward_actor
from venusrl.runtime.cluster.worker import RolloutWorker, WorkerReport
from venusrl.trainer.api import Trainer
from venusrl.types import FailureKind, Finish, SamplingParams, Trajectory, TurnTimes

START_TIMEOUT_S = 600.0  # loading a large model onto a GPU takes a while
RESTART_TIMEOUT_S = 300.0


def _add(total: dict[str, float], counts: Mapping[str, float]) -> None:
    for key, value in counts.items():
        total[key] = total.get(key, 0) + value


class RemoteSandbox:
    """A sandbox of some worker: the verbs of `Sandbox` that environments use, one call each."""

    def __init__(self, fleet: RolloutFleet, worker: int, epoch: int, key: str) -> None:
        self._fleet, self.worker, self._epoch, self.id = fleet, worker, epoch, key
        self._closed = False
        fleet.single_sandboxes += 1

    async def exec(
        self,
        command: str | Sequence[str],
        /,
        *,
        timeout_s: float,
        max_output_bytes: int,
        stdin: bytes = b"",
    ) -> ExecResult:
        return await self._call(
            RolloutWorker.exec, self.id, command, timeout_s, max_output_bytes, stdin
        )

    async def run_python(self, source: str, /, *, timeout_s: float) -> ExecResult:
        return await self._call(RolloutWorker.run_python, self.id, source, timeout_s)

    async def read_file(self, path: str, /) -> bytes:
        return await self._call(RolloutWorker.read_file, self.id, path)

    async def write_file(self, path: str, data: bytes, /) -> None:
        await self._call(RolloutWorker.write_file, self.id, path, data)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fleet.single_sandboxes -= 1
        with contextlib.suppress(SandboxCrashed):
            await self._call(RolloutWorker.close_sandbox, self.id)

    async def _call(self, method: Method[RolloutWorker, P, T], *args: P.args, **kw: P.kwargs) -> T:
        return await self._fleet.call(self.worker, self._epoch, method, *args, **kw)


class RemoteGroup:
    """An open group, on the worker that holds its sandboxes and plays its episodes.

    An episode whose sandbox its pool preempted (the node ran short of memory) moves to another
    worker: the group is opened there too (its setup replayed from the template), the
    environment acts again on the turns the model already took, and the episode goes on with
    that worker's engine (which computes the context's KV anew), rather than starting over. A
    group whose worker died opens again elsewhere for its next members."""

    def __init__(
        self,
        fleet: RolloutFleet,
        group_id: str,
        env: type[Environment],
        task: Task,
        worker: int,
        epoch: int,
    ) -> None:
        self.fleet, self.group_id, self.env, self.task = fleet, group_id, env, task
        self.worker, self.epoch = worker, epoch  # where new members play
        self.opened = {worker: epoch}  # every worker the group is open on, at its epoch

    async def play(self, trajectory_id: str, on_progress: OnProgress) -> Trajectory:
        fleet = self.fleet
        if not fleet.is_up(self.worker, self.epoch):
            try:  # the group's worker died: its replacement members play on another one
                self.worker, self.epoch = await self._open_on(fleet.up())
            except InfraFailure as e:
                return failed(trajectory_id, self.group_id, self.task, FailureKind.SANDBOX, str(e))
            fleet.reopened_groups += 1
        traj = await self._play(self.worker, self.epoch, trajectory_id, on_progress, None)
        if not (traj.failed_with(FailureKind.PREEMPTED) and traj.turn_starts):
            return traj
        try:
            elsewhere = [i for i in fleet.up() if i != self.worker] or fleet.up()
            worker, epoch = await self._open_on(elsewhere)
        except InfraFailure:
            return traj
        fleet.migrated.append(trajectory_id)
        moved = await self._play(worker, epoch, trajectory_id, on_progress, traj)
        fleet.migrated_completed += moved.finish is not Finish.INFRA
        return moved

    async def _open_on(self, candidates: list[int]) -> tuple[int, int]:
        """The worker `place` picks among `candidates`, with the group open on it."""
        worker, epoch = await self.fleet.place(candidates)
        if self.opened.get(worker) != epoch:
            await self.fleet.open_on(worker, epoch, self.group_id, self.env, self.task)
            self.opened[worker] = epoch
        return worker, epoch

    async def _play(
        self, worker: int, epoch: int, tid: str, on_progress: OnProgress, replay: Trajectory | None
    ) -> Trajectory:
        fleet = self.fleet
        fleet.on_progress[tid] = on_progress
        fleet.active[worker] += 1
        sent = time.monotonic()
        try:
            traj, started, progress = await fleet.call(
                worker, epoch, RolloutWorker.play, self.group_id, tid, replay
            )
        except Exception as e:  # the worker died, or the episode failed there
            return failed(
                tid, self.group_id, self.task, FailureKind.WORKER, f"{type(e).__name__}: {e}"
            )
        finally:
            fleet.on_progress.pop(tid, None)
            fleet.active[worker] -= 1
        fleet.played[worker] += 1
        for other, (p, age) in progress.items():  # reported while this episode played
            if other in fleet.on_progress:
                fleet.on_progress[other](p, age)
        # Turn times to this process's clock (off by the call's latency, a millisecond or so).
        shift = sent - started
        traj.turn_times = [
            TurnTimes(t.requested + shift, t.generated + shift, t.acted + shift)
            for t in traj.turn_times
        ]
        return traj

    async def close(self) -> None:
        self.fleet.group_closed(self.group_id)
        for worker, epoch in self.opened.items():
            with contextlib.suppress(InfraFailure):
                await self.fleet.call(worker, epoch, RolloutWorker.close_group, self.group_id)


class RolloutFleet:
    """The run's rollout workers, seen from the driver: the coordinator's `Rollouts`, the
    trainer's weight publisher, and single sandboxes for the warm start."""

    def __init__(self, cfg: Config, cluster: RayCluster) -> None:
        rt = cfg.runtime
        self.cfg, self.cluster = cfg, cluster
        # Off the rollout's path, the run's reward workers: an actor of their own (first: a
        # resource no node has is refused before any actor starts).
        self.rewards = reward_actor(cfg) if cfg.reward.placement == "pool" else None
        self.workers: list[Any] = [  # Ray's handles, untyped: called through `call`
            ray.remote(RolloutWorker)
            .options(
                name=f"rollout-{i}",
                namespace=rt.namespace,
                num_cpus=rt.engine_cpus,
                num_gpus=rt.engine_gpus,
                max_restarts=rt.actor_restarts,
                max_task_retries=0,  # an episode lost with its worker is the coordinator's call
            )
            .remote(cfg, i)
            for i in range(rt.engines)
        ]
        self._ranking_pushed: Mapping[str, int] = {}
        self._ranking_push: asyncio.Task[None] | None = None
        self._reward_counts: dict[str, int] = {}
        self.reward_node: list[str] = []  # the reward worker's node, once it started
        n = len(self.workers)
        # Restarts per worker are its epochs: keys made before the latest one are gone.
        self.replicas = Replicas(n, self._revive, rt.actor_restarts)
        self.nodes: list[str] = []
        self.templates: list[TemplateSpec] = []
        self.active = [0] * n  # episodes in flight, per worker
        self.played = [0] * n  # episodes each worker played to their end
        self.groups_placed = [0] * n
        self.reopened_groups = 0  # opened again elsewhere, their worker dead
        self.migrated: list[str] = []  # episodes moved to another worker, their sandbox preempted
        self.migrated_completed = 0  # of those, the ones that went on to their end
        self.single_sandboxes = 0
        self.on_progress: dict[str, OnProgress] = {}  # episodes in flight -> the coordinator's hook
        self._group_workers: dict[str, set[int]] = {}  # open groups -> the workers they are on
        self._priority: Mapping[str, int] = {}  # the coordinator's latest, every open group
        self._pushed: list[dict[str, int]] = [{} for _ in range(n)]
        self._to_push: dict[int, dict[str, int]] = {}
        self._pushers: dict[int, asyncio.Task[None]] = {}
        self._engine: tuple[dict[str, bytes], int, SamplingParams, Any] | None = None
        self._published: int | None = None  # the version of the last publish
        self._started_version = 0  # the engines' version before any publish
        # Workers restarted since it, their engines loaded, waiting for the next; a wait leaves
        # only as it is resolved (`_resolve`), so no publish, however it fails, can lose one.
        self._awaiting: dict[int, asyncio.Future[None]] = {}
        # Each worker's latest engine counters and the epoch they came from; an engine that
        # restarted counts from zero, so its predecessor's last reading is carried.
        self._counters: dict[int, tuple[int, dict[str, float]]] = {}
        self._carried: dict[str, float] = {}
        self._closed = False

    # --- starting -------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutFleet:
        try:
            started = asyncio.gather(
                *(call(w, RolloutWorker.node_id) for w in self.workers),
                *([call(self.rewards, RewardWorker.node_id)] if self.rewards else []),
            )
            nodes = list(await asyncio.wait_for(started, START_TIMEOUT_S))
            self.nodes, self.reward_node = nodes[: len(self.workers)], nodes[len(self.workers) :]
        except TimeoutError:
            await self.close()
            raise ValueError(
                f"the {len(self.workers)} rollout workers"
                f"{' and the reward worker' if self.rewards else ''} did not start within"
                f" {START_TIMEOUT_S:.0f} s: is every node's venusrl install importable, is there"
                " room for them (and a node with reward.ray_resource, where it is set)?"
            ) from None
        try:
            await asyncio.gather(
                *(
                    call(w, RolloutWorker.ready, [], self._sharing(i))
                    for i, w in enumerate(self.workers)
                )
            )
        except BaseException:  # a pool that cannot start (not root, no cgroups): none stays
            await self.close()
            raise
        self.replicas.up = set(range(len(self.workers)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _sharing(self, i: int) -> int:
        """How many workers share worker i's node (and so its sandbox memory)."""
        return Counter(self.nodes)[self.nodes[i]]

    async def prepare_template(self, spec: TemplateSpec) -> None:
        self.templates.append(spec)
        await asyncio.gather(
            *(
                call(self.workers[i], RolloutWorker.ready, [spec], self._sharing(i))
                for i in self.up()
            )
        )

    async def start_engines(
        self, model_dir: Path, version: int, sampling: SamplingParams
    ) -> RolloutFleet:
        """Load the model into every worker's engine (through the object store, so nodes share
        no filesystem)."""
        files = {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}
        # Held for the fleet's life: a restarted worker loads the model from it again.
        self._engine = (by_ref(files), version, sampling, self.rewards)
        self._started_version = version
        await asyncio.gather(
            *(
                self.call(i, self.replicas.restarts[i], RolloutWorker.start_engine, *self._engine)
                for i in self.up()
            )
        )
        return self

    # --- the trainer's side -----------------------------------------------------------------

    async def publish(self, trainer: Trainer, run_dir: Path, model_dir: Path) -> None:
        """The trainer's weights into every worker's engine, through the object store a bucket
        at a time (`trainer.publish_bucket_mib`): the next bucket is gathered while the workers
        load this one, and this one leaves the store before the next goes in, so neither this
        process nor the store ever holds more than two. The workers up, and those restarted
        since the last publish (`_revive`), get them; one that dies meanwhile is brought back
        and waits for the next. If the stream breaks (a trainer rank dies), every engine is
        told: it keeps its version, refuses to run half-copied weights, and the error stops
        the run."""
        stream = trainer.hf_weights()
        awaiting = dict(self._awaiting)  # those restarted since the last, as this one begins
        targets = {i: self.replicas.restarts[i] for i in [*self.up(), *awaiting]}
        buckets = pack(stream, int(self.cfg.trainer.publish_bucket_mib * 2**20))
        gathering: asyncio.Future[Bucket | None] | None = None
        try:
            begin = (stream.manifest, trainer.version)
            await self._on_each(targets, awaiting, RolloutWorker.begin_weights, *begin)
            # Off the event loop: sharded ranks stream the weights meanwhile.
            gathering = asyncio.ensure_future(asyncio.to_thread(next, buckets, None))
            while (bucket := await gathering) is not None:
                ref = by_ref(bucket)
                del bucket
                gathering = asyncio.ensure_future(asyncio.to_thread(next, buckets, None))
                await self._on_each(targets, awaiting, RolloutWorker.weights_bucket, ref)
                del ref  # out of the store once every worker has it
        except BaseException as e:
            if gathering is not None:
                with contextlib.suppress(BaseException):
                    await gathering
            # The trainer's stream ends too (`pack` closes it: sharded ranks finish theirs),
            # off the event loop.
            await asyncio.to_thread(buckets.close)
            with contextlib.suppress(Exception):
                broke = f"{type(e).__name__}: {e}"
                await self._on_each(targets, awaiting, RolloutWorker.end_weights, broke)
            raise  # those awaiting still wait, for the next publish
        await self._on_each(targets, awaiting, RolloutWorker.end_weights, None)
        self._published = trainer.version
        for i, waiting in awaiting.items():  # every one left has the whole set
            self._resolve(i, waiting, None)

    @property
    def version(self) -> int:
        """The weight version the engines hold: the last publish's, once one completed."""
        return self._started_version if self._published is None else self._published

    def waiting_for_weights(self) -> list[int]:
        """Workers restarted and loaded, out of service until the next publish."""
        return sorted(self._awaiting)

    def _resolve(self, i: int, waiting: asyncio.Future[None], lost: ActorLost | None) -> None:
        """End worker i's wait for a publish: back in service, or `lost` (its revive goes
        around again, `Replicas`). A newer wait of a later revive stays."""
        if self._awaiting.get(i) is waiting:
            del self._awaiting[i]
        if not waiting.done():
            if lost is None:
                waiting.set_result(None)
            else:
                waiting.set_exception(lost)

    async def _on_each(
        self, targets: dict[int, int], awaiting: dict[int, asyncio.Future[None]],
        method: Method[RolloutWorker, P, None], *args: P.args, **kw: P.kwargs,
    ) -> None:  # fmt: skip
        """`method` on every worker of `targets` (index -> epoch), those `awaiting` their first
        weights since a restart among them; a worker that dies leaves `targets` (it is being
        restarted, and waits for the next publish), and the first other error is raised once
        every call is answered."""

        async def one(i: int) -> None:
            try:
                if i in awaiting:  # not in service: outside `call`'s bookkeeping
                    await call(self.workers[i], method, *args, **kw)
                else:
                    await self.call(i, targets[i], method, *args, **kw)
            except (InfraFailure, ActorLost) as e:
                del targets[i]
                if i in awaiting:  # died again since its restart
                    self._resolve(i, awaiting.pop(i), ActorLost(str(e)))

        errors = await asyncio.gather(*map(one, list(targets)), return_exceptions=True)
        for error in errors:
            if isinstance(error, BaseException):
                raise error

    async def counters(self) -> dict[str, float]:
        """The engines' totals, summed over the workers: never lower than before, however
        many restarted (a worker down counts with its last reading)."""

        async def read(i: int) -> None:
            epoch = self.replicas.restarts[i]
            try:
                counts = await self.call(i, epoch, RolloutWorker.engine_counters)
            except InfraFailure:
                return
            last = self._counters.get(i)
            if last is not None and last[0] != epoch:
                _add(self._carried, last[1])
            self._counters[i] = (epoch, counts)

        await asyncio.gather(*(read(i) for i in self.up()))
        if self.rewards is not None:  # read with the engines', for the step line
            with contextlib.suppress(ActorLost):
                self._reward_counts = await call(self.rewards, RewardWorker.counters)
        total = dict(self._carried)
        for _, counts in self._counters.values():
            _add(total, counts)
        return total

    async def pool_stats(self) -> PoolStats | None:
        """The pools of the workers up, as one (`PoolStats.merge`); a worker that restarted
        counts from its restart. None while no worker answers."""

        async def read(i: int) -> PoolStats | None:
            try:
                return await self.call(i, self.replicas.restarts[i], RolloutWorker.pool_stats)
            except InfraFailure:
                return None

        stats = [s for s in await asyncio.gather(*(read(i) for i in self.up())) if s is not None]
        return PoolStats.merge(stats) if stats else None

    # --- the coordinator's side (`Rollouts`) ------------------------------------------------

    async def open_group(
        self, group_id: str, env: type[Environment], task: Task, priority: int
    ) -> RemoteGroup:
        self._priority = {**self._priority, group_id: priority}
        worker, epoch = await self.place(self.up())
        await self.open_on(worker, epoch, group_id, env, task)
        return RemoteGroup(self, group_id, env, task, worker, epoch)

    async def place(self, candidates: list[int]) -> tuple[int, int]:
        """The worker among `candidates` that a group goes to (`place_group`), and its epoch."""
        if not candidates:
            raise SandboxCrashed("no rollout worker is up")
        rooms = await asyncio.gather(*(self._room(i) for i in candidates))
        groups = Counter(w for ws in self._group_workers.values() for w in ws)
        worker = candidates[place_group([groups[i] for i in candidates], rooms)]
        return worker, self.replicas.restarts[worker]

    async def open_on(
        self, worker: int, epoch: int, group_id: str, env: type[Environment], task: Task
    ) -> None:
        priority = self._priority.get(group_id, BEST_EFFORT)
        await self.call(worker, epoch, RolloutWorker.open_group, group_id, env, task, priority)
        self._group_workers.setdefault(group_id, set()).add(worker)
        self.groups_placed[worker] += 1

    def group_closed(self, group_id: str) -> None:
        self._group_workers.pop(group_id, None)

    @property
    def resumed_episodes(self) -> int:
        return len(self.migrated)

    def reward_counters(self) -> dict[str, int]:
        """The reward worker's, as the engines' counters last read them (a restarted one counts
        from its restart); nothing inline."""
        return dict(self._reward_counts)

    def set_priorities(self, priority: Mapping[str, int]) -> None:
        """Each worker gets the priorities of the groups it holds, when they changed; one push
        in flight per worker, the latest mapping sent after it."""
        self._priority = priority
        if self.rewards is not None and priority != self._ranking_pushed:
            self._ranking_pushed = priority
            if self._ranking_push is None:
                self._ranking_push = asyncio.ensure_future(self._push_ranking())
        for i in self.up():
            mine = {g: p for g, p in priority.items() if i in self._group_workers.get(g, ())}
            if mine != self._pushed[i]:
                self._pushed[i] = mine
                self._to_push[i] = mine
                if i not in self._pushers:
                    self._pushers[i] = asyncio.ensure_future(self._push(i))

    async def _push(self, i: int) -> None:
        try:
            while i in self._to_push:
                mine = self._to_push.pop(i)
                with contextlib.suppress(InfraFailure):
                    await self.call(
                        i, self.replicas.restarts[i], RolloutWorker.set_priorities, mine
                    )
        finally:
            del self._pushers[i]

    async def _push_ranking(self) -> None:
        """The whole ranking to the reward worker (it grades every worker's groups), the latest
        after the push in flight."""
        sent: Mapping[str, int] | None = None
        try:
            while sent is not self._ranking_pushed:
                sent = self._ranking_pushed
                with contextlib.suppress(ActorLost):
                    await call(self.rewards, RewardWorker.set_priorities, dict(sent))
        finally:
            self._ranking_push = None

    def sandboxes_running(self) -> int:
        return sum(self.active) + self.single_sandboxes

    # --- single sandboxes (`SandboxSource`) -------------------------------------------------

    async def create(
        self,
        template: str | TemplateSpec,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> RemoteSandbox:
        worker, epoch = await self.place(self.up())
        key = await self.call(worker, epoch, RolloutWorker.create, template, priority, setup, files)
        return RemoteSandbox(self, worker, epoch, key)

    # --- calls, failures, reports -----------------------------------------------------------

    def up(self) -> list[int]:
        return sorted(self.replicas.up)

    def is_up(self, i: int, epoch: int) -> bool:
        return i in self.replicas.up and epoch == self.replicas.restarts[i]

    async def call(
        self, i: int, epoch: int, method: Method[RolloutWorker, P, T], *args: P.args,
        **kw: P.kwargs,
    ) -> T:  # fmt: skip
        """A call to worker i as it was at `epoch`; a worker that died or restarted since is an
        `InfraFailure` (`SandboxCrashed`), after it was taken out of service."""
        if not self.is_up(i, epoch):
            raise SandboxCrashed(f"rollout worker {i} restarted")
        try:
            return await self.replicas.call(i, epoch, self.workers[i], method, *args, **kw)
        except ActorLost as e:
            raise SandboxCrashed(f"rollout worker {i} died: {e}") from e

    async def _room(self, i: int) -> int:
        try:
            return await self.call(i, self.replicas.restarts[i], RolloutWorker.room)
        except InfraFailure:
            return -1

    async def _revive(self, i: int) -> None:
        """Wait for Ray to restart worker i; prepare the run's templates on it (its pool reaps
        the dead pool's sandboxes when it starts), then the model; once weights were published,
        wait for the next publish to bring it the current ones. `ActorLost` if it died again
        meanwhile (`Replicas` counts that death and, while Ray restarts it, revives it again)."""
        worker = self.workers[i]
        self._pushed[i] = {}
        self.nodes[i] = await until_alive(
            lambda: call(worker, RolloutWorker.node_id), RESTART_TIMEOUT_S
        )
        await call(worker, RolloutWorker.ready, self.templates, self._sharing(i))
        if self._engine is None:
            return
        await call(worker, RolloutWorker.start_engine, *self._engine)
        if self._published is not None:
            # Holding no whole copy of the weights, the fleet has none to give it before then.
            self._awaiting[i] = asyncio.get_running_loop().create_future()
            await self._awaiting[i]

    async def report(self) -> dict[str, Any]:
        """Where episodes and groups ran, what restarted, and each worker's pool statistics
        (None for a worker that is down)."""
        reports = await asyncio.gather(*(self._report(i) for i in range(len(self.workers))))
        served = Counter(t for r in reports if r is not None for t in r["served"])
        return {
            "workers": [
                {
                    "node": self.nodes[i],
                    "pid": r["pid"] if r else None,
                    "restarts": self.replicas.restarts[i],
                    "up": i in self.replicas.up,
                    "episodes_played": self.played[i],
                    "groups_placed": self.groups_placed[i],
                    "pool": r["pool"].as_dict() if r else None,
                    "trajectories_served": len(r["served"]) if r else None,
                    "rewards": r["rewards"] if r else None,
                }
                for i, r in enumerate(reports)
            ],
            # Trajectory ids that more than one engine generated for: only moved episodes.
            "trajectories_on_several_engines": sorted(t for t, n in served.items() if n > 1),
            "migrated_trajectories": self.migrated,
            "reopened_groups": self.reopened_groups,
            "waiting_for_weights": self.waiting_for_weights(),
            "migrated_episodes": len(self.migrated),
            "migrated_completed": self.migrated_completed,
            "reward_worker": await self._reward_report(),
            "actor_calls": self.cluster.actor_calls(),
        }

    async def _reward_report(self) -> dict[str, Any] | None:
        if self.rewards is None:
            return None
        try:
            return await call(self.rewards, RewardWorker.report)
        except ActorLost:
            return {"node": self.reward_node[0] if self.reward_node else None, "up": False}

    async def _report(self, i: int) -> WorkerReport | None:
        if i not in self.replicas.up:
            return None
        try:
            return await call(self.workers[i], RolloutWorker.report)
        except ActorLost:
            return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.replicas.cancel()
        for task in [*self._pushers.values(), *filter(None, [self._ranking_push])]:
            task.cancel()
        for i in self.up():
            with contextlib.suppress(ActorLost):
                await call(self.workers[i], RolloutWorker.shutdown)
        if self.rewards is not None:
            with contextlib.suppress(ActorLost):
                await call(self.rewards, RewardWorker.shutdown)
        for actor in [*self.workers, *filter(None, [self.rewards])]:
            ray.kill(actor, no_restart=True)
