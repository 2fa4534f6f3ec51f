"""Rollout workers: an engine, a sandbox pool and the agent loops beside them, as one Ray actor.

Each worker runs, in its own process on the CPUs or GPUs Ray gives it, what one process runs
locally: the in-process engine on its thread, a sandbox pool with the node's memory (shared out
among the workers of the node), and the agent loops of the groups placed on it
(`coordinator.rollouts.LocalRollouts`). The coordinator's driver-side view is `RolloutFleet`:

- **One call per episode.** A member's whole episode (fork its sandbox from the group's zygote,
  every turn's generation, every tool call, the reward) runs in the worker; the trajectory comes
  back. Turns and tool calls never cross a process boundary, which on a small model was most of
  what the runtime cost (BENCHMARKS.md, "What the Ray runtime costs").
- **Placement.** A new group goes to the worker that holds the fewest open groups, ties to the
  one with the most admissible memory (`policy.placement.place_group`). Its K sandboxes
  fork on that node from one zygote, and its K trajectories share that engine's prompt KV; a
  trajectory never leaves the engine that holds its KV.
- **Priorities** reach the workers when the coordinator re-ranks the groups, each worker only
  the ones it holds and only when they changed. Members' progress (tokens and turns so far)
  comes back with each finished episode.
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
import os
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from venusrl.config import Config
from venusrl.coordinator.agent_loop import ChatFormat
from venusrl.coordinator.rollouts import LocalGroup, LocalRollouts, OnTurn, failed
from venusrl.envs.accounts import PoolStats
from venusrl.envs.environment import Environment, Task
from venusrl.envs.pool import SandboxPool
from venusrl.envs.sandbox import Sandbox
from venusrl.envs.types import ExecResult, GiB, InfraFailure, SandboxCrashed, TemplateSpec
from venusrl.model.tokenizer import Tokenizer
from venusrl.model.weight_stream import Bucket, Spec, pack
from venusrl.policy.critical_groups import BEST_EFFORT
from venusrl.policy.placement import place_group
from venusrl.runtime.cluster.ray_cluster import (
    ActorLost,
    RayCluster,
    Replicas,
    at_default_priority,
    call,
    until_alive,
)
from venusrl.runtime.cluster.weight_feed import WeightFeed
from venusrl.runtime.engines import LocalEngine
from venusrl.runtime.faults import engine_faults, sandbox_faults
from venusrl.trainer.api import Trainer
from venusrl.types import (
    FailureKind,
    Finish,
    GenerationOutput,
    SamplingParams,
    Trajectory,
    TurnMeta,
    TurnTimes,
)

START_TIMEOUT_S = 600.0  # loading a large model onto a GPU takes a while
RESTART_TIMEOUT_S = 300.0
NODE_MEMORY_FRACTION = 0.8  # of the node's available memory, at most, for its sandboxes
SANDBOX_VERBS = ("exec", "run_python", "read_file", "write_file")


def _available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def _add(total: dict[str, float], counts: Mapping[str, float]) -> None:
    for key, value in counts.items():
        total[key] = total.get(key, 0) + value


class RolloutWorker:
    """One rollout worker (a Ray actor). Groups and sandboxes are named by keys."""

    def __init__(self, cfg: dict[str, Any], index: int) -> None:
        at_default_priority()
        self.cfg = Config.model_validate(cfg)
        self.index = index
        torch.set_num_threads(self.cfg.engine.threads or 1)
        self.pool: SandboxPool | None = None
        self.engine: LocalEngine | None = None
        self.rollouts: LocalRollouts | None = None
        self._groups: dict[str, LocalGroup] = {}
        self._sandboxes: dict[str, Sandbox] = {}
        self._progress: dict[str, tuple[int, int]] = {}  # episodes in flight: tokens, turns
        self.served: set[str] = set()  # trajectory ids this engine generated for
        self._faults: list[asyncio.Task[None]] = []  # `faults.*_sandboxes`
        self._feed: WeightFeed | None = None  # a publish under way

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    async def ready(self, templates: list[TemplateSpec], workers_on_node: int) -> str:
        """Start the pool (its share of the node's memory) and prepare `templates` (again,
        after a restart); the node's id."""
        if self.pool is None:
            sb = self.cfg.sandbox
            # Sized from the node: the configured budget, but never more than the node can give.
            node_budget = min(
                int(sb.memory_budget_gib * GiB),
                int(NODE_MEMORY_FRACTION * _available_memory_bytes()),
            )
            pool = SandboxPool(
                node_budget // workers_on_node, admission=sb.admission, share_pages=sb.share_pages
            )
            await pool.start()
            self.pool = pool
        for spec in templates:
            await self.pool.prepare_template(spec)
        return self.node_id()

    def room(self) -> int:
        return self._pool().room_bytes()

    async def start_engine(
        self,
        model_files: dict[str, bytes],
        version: int,
        sampling: SamplingParams,
    ) -> None:
        # The engine and the tokenizer read the files once: the directory goes right after, so a
        # worker that is killed leaves nothing behind in /tmp.
        with tempfile.TemporaryDirectory(prefix="venusrl-engine-") as tmp:
            model_dir = Path(tmp)
            for name, data in model_files.items():
                (model_dir / name).write_bytes(data)
            tokenizer = Tokenizer.load(model_dir)
            if tokenizer is None or tokenizer.chat_template is None:
                raise ValueError("the published model needs a tokenizer with a chat template")
            self.engine = LocalEngine(model_dir, self.cfg, version)
        seed = self.cfg.run.seed + self.index
        generate = engine_faults(self._generate, self.cfg.faults, seed)
        fmt = ChatFormat(tokenizer, self.cfg.rollout.tool_parser)
        self.rollouts = LocalRollouts(
            self._pool(), generate, fmt, sampling, self.cfg.rollout,
            end_trajectory=self.engine.end_trajectory,
            resume_preempted=False,  # the fleet moves it to another worker
        )  # fmt: skip
        # From here on: the warm start's sandboxes are spared, as in one process.
        self._faults = sandbox_faults(self._pool(), self.cfg.faults, seed)

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
    ) -> GenerationOutput:
        assert self.engine is not None
        if meta.trajectory_id is not None:
            self.served.add(meta.trajectory_id)
        return await self.engine.generate(prompt_ids, params, meta)

    async def engine_counters(self) -> dict[str, float]:
        return {} if self.engine is None else await self.engine.counters()

    def pool_stats(self) -> PoolStats:
        return self._pool().stats()

    async def begin_weights(self, manifest: dict[str, Spec], version: int) -> None:
        """An update of the engine's weights to `version`: announced by `manifest` (answered
        once the engine accepts it), its buckets to come (`weights_bucket`), then
        `end_weights`."""
        if self.engine is None:  # restarted since the publish began: it waits for the next
            raise ActorLost("the worker restarted: no engine to update yet")
        timeout_s = self.cfg.trainer.rank_timeout_s  # the longest the trainer may take
        self._feed = WeightFeed(self.engine, manifest, version, timeout_s)
        await self._feed.started()

    async def weights_bucket(self, bucket: Bucket) -> None:
        """Answered once the engine has copied `bucket`. A worker restarted since the update
        began has no feed: it answers as a lost actor, so that the publish leaves it out (it
        waits for the next) rather than fail for every engine."""
        if self._feed is None:
            raise ActorLost("the worker restarted during a weight update")
        await self._feed.give(bucket)

    async def end_weights(self, broke: str | None) -> None:
        feed, self._feed = self._feed, None
        if feed is not None:
            await feed.end(broke)

    # --- groups and their episodes ----------------------------------------------------------

    async def open_group(self, key: str, env: type[Environment], task: Task, priority: int) -> None:
        rollouts = self._rollouts()
        rollouts.set_priorities({**rollouts.priority, key: priority})
        self._groups[key] = await rollouts.open_group(key, env, task, priority)

    async def play(
        self, key: str, trajectory_id: str, replay: Trajectory | None
    ) -> tuple[Trajectory, float, dict[str, tuple[int, int]]]:
        """One member's episode of group `key` (going on from `replay`, when given); when it
        started on this worker's clock; the progress of the other episodes in flight here."""
        started = time.monotonic()
        group = self._groups.get(key)
        if group is None:  # this worker restarted since the group opened
            raise SandboxCrashed(f"group {key} is not on this worker (it restarted)")
        self._progress[trajectory_id] = (0, 0)
        try:
            traj = await group.play(
                trajectory_id,
                lambda tokens, turns: self._progress.__setitem__(trajectory_id, (tokens, turns)),
                replay,
            )
        finally:
            del self._progress[trajectory_id]
        return traj, started, dict(self._progress)

    async def close_group(self, key: str) -> None:
        group = self._groups.pop(key, None)
        if group is not None:
            await group.close()

    def set_priorities(self, priority: dict[str, int]) -> None:
        self._rollouts().set_priorities(priority)

    # --- single sandboxes (the warm start's demonstrations) ---------------------------------

    async def create(
        self, template: str, priority: int, setup: str | None, files: Mapping[str, bytes] | None
    ) -> str:
        sb = await self._pool().create(template, priority, setup, files)
        self._sandboxes[sb.id] = sb
        return sb.id

    async def verb(self, sandbox: str, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        if name not in SANDBOX_VERBS:
            raise ValueError(f"{name} is not a sandbox verb")
        sb = self._sandboxes.get(sandbox)
        if sb is None:
            raise SandboxCrashed(f"sandbox {sandbox} is not on this worker (it restarted)")
        return await getattr(sb, name)(*args, **kw)

    async def close_sandbox(self, sandbox: str) -> None:
        sb = self._sandboxes.pop(sandbox, None)
        if sb is not None:
            await sb.close()

    # --- reports and shutdown ---------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        return {
            "node": self.node_id(),
            "pid": os.getpid(),  # its sandbox pool's is named after it (`envs.orphans`)
            "pool": self._pool().stats().as_dict(),
            "served": sorted(self.served),
            "episodes_in_flight": len(self._progress),
        }

    async def shutdown(self) -> None:
        for task in self._faults:
            task.cancel()
        if self.engine is not None:
            await self.engine.close()
        if self.pool is not None:
            await self.pool.close()

    def _pool(self) -> SandboxPool:
        if self.pool is None:
            raise RuntimeError("the worker's pool is not started: call ready() first")
        return self.pool

    def _rollouts(self) -> LocalRollouts:
        if self.rollouts is None:
            raise RuntimeError("the worker has no engine yet: call start_engine() first")
        return self.rollouts


class RemoteSandbox:
    """A sandbox of some worker: the verbs of `Sandbox` that environments use, one call each."""

    def __init__(self, fleet: RolloutFleet, worker: int, epoch: int, key: str) -> None:
        self._fleet, self.worker, self._epoch, self.id = fleet, worker, epoch, key
        self._closed = False
        fleet.single_sandboxes += 1

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
        self._fleet.single_sandboxes -= 1
        with contextlib.suppress(SandboxCrashed):
            await self._fleet.call(self.worker, self._epoch, "close_sandbox", self.id)

    async def _verb(self, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        return await self._fleet.call(self.worker, self._epoch, "verb", self.id, name, args, kw)


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

    async def play(self, trajectory_id: str, on_turn: OnTurn) -> Trajectory:
        fleet = self.fleet
        if not fleet.is_up(self.worker, self.epoch):
            try:  # the group's worker died: its replacement members play on another one
                self.worker, self.epoch = await self._open_on(fleet.up())
            except InfraFailure as e:
                return failed(trajectory_id, self.group_id, self.task, FailureKind.SANDBOX, str(e))
            fleet.reopened_groups += 1
        traj = await self._play(self.worker, self.epoch, trajectory_id, on_turn, None)
        if not (traj.failed_with(FailureKind.PREEMPTED) and traj.turn_starts):
            return traj
        try:
            elsewhere = [i for i in fleet.up() if i != self.worker] or fleet.up()
            worker, epoch = await self._open_on(elsewhere)
        except InfraFailure:
            return traj
        fleet.migrated.append(trajectory_id)
        moved = await self._play(worker, epoch, trajectory_id, on_turn, traj)
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
        self, worker: int, epoch: int, tid: str, on_turn: OnTurn, replay: Trajectory | None
    ) -> Trajectory:
        fleet = self.fleet
        fleet.on_turn[tid] = on_turn
        fleet.active[worker] += 1
        sent = time.monotonic()
        try:
            traj, started, progress = await fleet.call(
                worker, epoch, "play", self.group_id, tid, replay
            )
        except Exception as e:  # the worker died, or the episode failed there
            return failed(
                tid, self.group_id, self.task, FailureKind.WORKER, f"{type(e).__name__}: {e}"
            )
        finally:
            fleet.on_turn.pop(tid, None)
            fleet.active[worker] -= 1
        fleet.played[worker] += 1
        for other, (tokens, turns) in progress.items():
            if other in fleet.on_turn:
                fleet.on_turn[other](tokens, turns)
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
                await self.fleet.call(worker, epoch, "close_group", self.group_id)


class RolloutFleet:
    """The run's rollout workers, seen from the driver: the coordinator's `Rollouts`, the
    trainer's weight publisher, and single sandboxes for the warm start."""

    def __init__(self, cfg: Config, cluster: RayCluster) -> None:
        rt = cfg.runtime
        self.cfg, self.cluster = cfg, cluster
        self.workers: list[Any] = [
            ray.remote(RolloutWorker)
            .options(
                name=f"rollout-{i}",
                namespace=rt.namespace,
                num_cpus=rt.engine_cpus,
                num_gpus=rt.engine_gpus,
                max_restarts=rt.actor_restarts,
                max_task_retries=0,  # an episode lost with its worker is the coordinator's call
            )
            .remote(cfg.model_dump(), i)
            for i in range(rt.engines)
        ]
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
        self.on_turn: dict[str, OnTurn] = {}  # episodes in flight -> the coordinator's hook
        self._group_workers: dict[str, set[int]] = {}  # open groups -> the workers they are on
        self._priority: Mapping[str, int] = {}  # the coordinator's latest, every open group
        self._pushed: list[dict[str, int]] = [{} for _ in range(n)]
        self._to_push: dict[int, dict[str, int]] = {}
        self._pushers: dict[int, asyncio.Task[None]] = {}
        self._engine: tuple[Any, int, SamplingParams] | None = None
        self._published: int | None = None  # the version of the last publish
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
            self.nodes = list(
                await asyncio.wait_for(
                    asyncio.gather(*(call(w.node_id) for w in self.workers)), START_TIMEOUT_S
                )
            )
        except TimeoutError:
            await self.close()
            raise ValueError(
                f"the {len(self.workers)} rollout workers did not start within "
                f"{START_TIMEOUT_S:.0f} s: is every node's venusrl install importable, and is "
                "there room for them?"
            ) from None
        try:
            await asyncio.gather(
                *(call(w.ready, [], self._sharing(i)) for i, w in enumerate(self.workers))
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
            *(call(self.workers[i].ready, [spec], self._sharing(i)) for i in self.up())
        )

    async def start_engines(
        self, model_dir: Path, version: int, sampling: SamplingParams
    ) -> RolloutFleet:
        """Load the model into every worker's engine (through the object store, so nodes share
        no filesystem)."""
        files = {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}
        # Held for the fleet's life: a restarted worker loads the model from it again.
        self._engine = (ray.put(files), version, sampling)
        await asyncio.gather(
            *(
                self.call(i, self.replicas.restarts[i], "start_engine", *self._engine)
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
            await self._on_each(targets, awaiting, "begin_weights", *begin)
            # Off the event loop: sharded ranks stream the weights meanwhile.
            gathering = asyncio.ensure_future(asyncio.to_thread(next, buckets, None))
            while (bucket := await gathering) is not None:
                ref = ray.put(bucket)
                del bucket
                gathering = asyncio.ensure_future(asyncio.to_thread(next, buckets, None))
                await self._on_each(targets, awaiting, "weights_bucket", ref)
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
                await self._on_each(targets, awaiting, "end_weights", broke)
            raise  # those awaiting still wait, for the next publish
        await self._on_each(targets, awaiting, "end_weights", None)
        self._published = trainer.version
        for i, waiting in awaiting.items():  # every one left has the whole set
            self._resolve(i, waiting, None)

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
        self, targets: dict[int, int], awaiting: dict[int, asyncio.Future[None]], method: str,
        *args: Any,
    ) -> None:  # fmt: skip
        """`method` on every worker of `targets` (index -> epoch), those `awaiting` their first
        weights since a restart among them; a worker that dies leaves `targets` (it is being
        restarted, and waits for the next publish), and the first other error is raised once
        every call is answered."""

        async def one(i: int) -> None:
            try:
                if i in awaiting:  # not in service: outside `call`'s bookkeeping
                    await call(getattr(self.workers[i], method), *args)
                else:
                    await self.call(i, targets[i], method, *args)
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
                counts = dict(await self.call(i, epoch, "engine_counters"))
            except InfraFailure:
                return
            last = self._counters.get(i)
            if last is not None and last[0] != epoch:
                _add(self._carried, last[1])
            self._counters[i] = (epoch, counts)

        await asyncio.gather(*(read(i) for i in self.up()))
        total = dict(self._carried)
        for _, counts in self._counters.values():
            _add(total, counts)
        return total

    async def pool_stats(self) -> PoolStats | None:
        """The pools of the workers up, as one (`PoolStats.merge`); a worker that restarted
        counts from its restart. None while no worker answers."""

        async def read(i: int) -> PoolStats | None:
            try:
                stats: PoolStats = await self.call(i, self.replicas.restarts[i], "pool_stats")
            except InfraFailure:
                return None
            return stats

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
        await self.call(worker, epoch, "open_group", group_id, env, task, priority)
        self._group_workers.setdefault(group_id, set()).add(worker)
        self.groups_placed[worker] += 1

    def group_closed(self, group_id: str) -> None:
        self._group_workers.pop(group_id, None)

    @property
    def resumed_episodes(self) -> int:
        return len(self.migrated)

    def set_priorities(self, priority: Mapping[str, int]) -> None:
        """Each worker gets the priorities of the groups it holds, when they changed; one push
        in flight per worker, the latest mapping sent after it."""
        self._priority = priority
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
                    await self.call(i, self.replicas.restarts[i], "set_priorities", mine)
        finally:
            del self._pushers[i]

    def sandboxes_running(self) -> int:
        return sum(self.active) + self.single_sandboxes

    # --- single sandboxes (`SandboxSource`) -------------------------------------------------

    async def create(
        self,
        template: str,
        priority: int = 0,
        setup: str | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> RemoteSandbox:
        worker, epoch = await self.place(self.up())
        key = await self.call(worker, epoch, "create", template, priority, setup, files)
        return RemoteSandbox(self, worker, epoch, key)

    # --- calls, failures, reports -----------------------------------------------------------

    def up(self) -> list[int]:
        return sorted(self.replicas.up)

    def is_up(self, i: int, epoch: int) -> bool:
        return i in self.replicas.up and epoch == self.replicas.restarts[i]

    async def call(self, i: int, epoch: int, method: str, *args: Any) -> Any:
        """A call to worker i as it was at `epoch`; a worker that died or restarted since is an
        `InfraFailure` (`SandboxCrashed`), after it was taken out of service."""
        if not self.is_up(i, epoch):
            raise SandboxCrashed(f"rollout worker {i} restarted")
        try:
            return await self.replicas.call(i, epoch, getattr(self.workers[i], method), *args)
        except ActorLost as e:
            raise SandboxCrashed(f"rollout worker {i} died: {e}") from e

    async def _room(self, i: int) -> int:
        try:
            return int(await self.call(i, self.replicas.restarts[i], "room"))
        except InfraFailure:
            return -1

    async def _revive(self, i: int) -> None:
        """Wait for Ray to restart worker i; prepare the run's templates on it (its pool reaps
        the dead pool's sandboxes when it starts), then the model; once weights were published,
        wait for the next publish to bring it the current ones. `ActorLost` if it died again
        meanwhile (`Replicas` counts that death and, while Ray restarts it, revives it again)."""
        worker = self.workers[i]
        self._pushed[i] = {}
        self.nodes[i] = await until_alive(lambda: call(worker.node_id), RESTART_TIMEOUT_S)
        await call(worker.ready, self.templates, self._sharing(i))
        if self._engine is None:
            return
        await call(worker.start_engine, *self._engine)
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
                    "pool": r["pool"] if r else None,
                    "trajectories_served": len(r["served"]) if r else None,
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
            "actor_calls": self.cluster.actor_calls(),
        }

    async def _report(self, i: int) -> dict[str, Any] | None:
        if i not in self.replicas.up:
            return None
        try:
            return dict(await call(self.workers[i].report))
        except ActorLost:
            return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.replicas.cancel()
        for task in list(self._pushers.values()):
            task.cancel()
        for i in self.up():
            with contextlib.suppress(ActorLost):
                await call(self.workers[i].shutdown)
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
