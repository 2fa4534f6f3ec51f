"""N rollout engines as Ray actors, behind one `generate` with sticky routing.

Each actor runs the in-process engine (`AsyncEngine`) in its own worker process, on the CPUs or
GPUs Ray gives it. The model reaches the actors through the object store (a directory's files),
so nodes need no shared filesystem; new weights do too: the trainer's tensors are put once and
every engine fetches them (`publish`), then the version moves on.

Failures: a call to an engine that died raises `EngineLost` (an infrastructure failure for the
coordinator: the trajectory's KV was on that engine, so the trajectory cannot go on elsewhere
without its context being prefilled anew, and is replaced). Ray restarts the actor; the fleet
waits for it, loads the current weights into it, and routes new trajectories to it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch

from venusrl.config import Config, EngineConfig
from venusrl.engine.async_engine import AsyncEngine
from venusrl.engine.engine import Engine
from venusrl.engine.request import GenerationOutput, SamplingParams
from venusrl.policy.placement import StickyRouter, least_loaded
from venusrl.runtime.cluster.ray_cluster import (
    ActorLost,
    Replicas,
    at_default_priority,
    call,
    until_alive,
)
from venusrl.trainer.trainer import GRPOTrainer

RESTART_TIMEOUT_S = 300.0
START_TIMEOUT_S = 600.0  # loading a large model onto a GPU takes a while


class EngineLost(ActorLost):
    """The engine holding a trajectory died: the trajectory is an infrastructure failure."""


class EngineActor:
    """One rollout engine in a Ray worker process."""

    def __init__(self, model_files: dict[str, bytes], engine: dict[str, Any], version: int) -> None:
        at_default_priority()
        cfg = EngineConfig.model_validate(engine)
        torch.set_num_threads(cfg.threads or 1)
        self._dir = Path(tempfile.mkdtemp(prefix="venusrl-engine-"))
        for name, data in model_files.items():
            (self._dir / name).write_bytes(data)
        core = Engine.from_model_dir(self._dir, cfg)
        core.weight_version = version
        self.engine = AsyncEngine(core).start()

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def version(self) -> int:
        return int(self.engine.engine.weight_version)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, metadata: dict[str, Any]
    ) -> GenerationOutput:
        return await self.engine.generate(prompt_ids, params, **metadata)

    async def end_trajectory(self, trajectory_id: str) -> None:
        await self.engine.call(lambda e: e.end_trajectory(trajectory_id))

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        # Between two engine steps: requests in flight keep their KV, and their tokens from
        # here on record the new version.
        await self.engine.call(lambda e: e.update_weights(weights.items(), version=version))

    def stop(self) -> None:
        self.engine.stop()


def model_files(model_dir: Path) -> dict[str, bytes]:
    """A model directory's files (config, tokenizer, safetensors), to ship to the actors."""
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}


class EngineFleet:
    """Where the coordinator's `generate` goes in a Ray run: the same call, N engines."""

    def __init__(self, cfg: Config, model_dir: Path, version: int) -> None:
        rt = cfg.runtime
        # Held for the fleet's life: Ray re-runs the constructor with it when an engine restarts.
        self._model_files = ray.put(model_files(model_dir))
        self.actors: list[Any] = [
            ray.remote(EngineActor)
            .options(
                name=f"engine-{i}",
                namespace=rt.namespace,
                num_cpus=rt.engine_cpus,
                num_gpus=rt.engine_gpus,
                max_restarts=rt.actor_restarts,
                max_task_retries=0,  # a request lost with its engine is the coordinator's call
            )
            .remote(self._model_files, cfg.engine.model_dump(), version)
            for i in range(rt.engines)
        ]
        self.router = StickyRouter(len(self.actors))
        self.replicas = Replicas(len(self.actors), self._revive)
        self.nodes: list[str] = []
        self.new_trajectories = [0] * len(self.actors)  # first turns, since the last (re)start
        # Live trajectory id -> the engines that served its turns; folded into the counts below
        # when it ends, so a long run's bookkeeping stays the size of what is in flight.
        self.serving: dict[str, set[int]] = {}
        self.trajectories_per_engine = [0] * len(self.actors)  # ended ones each engine served
        self.on_several_engines: list[str] = []  # ended ones whose turns moved (should not be)
        self._weights: tuple[Any, int] | None = None  # the latest published (object ref, version)

    async def start(self) -> EngineFleet:
        try:
            self.nodes = list(
                await asyncio.wait_for(
                    asyncio.gather(*(call(a.node_id) for a in self.actors)), START_TIMEOUT_S
                )
            )
        except TimeoutError:
            await self.close()
            raise ValueError(
                f"the {len(self.actors)} engine actors did not start within {START_TIMEOUT_S:.0f}"
                " s: is every node's venusrl install importable, and is there room for them?"
            ) from None
        self.replicas.up = set(range(len(self.actors)))
        return self

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, **metadata: Any
    ) -> GenerationOutput:
        tid = metadata.get("trajectory_id")
        # A call outside any trajectory has no KV to stick to: the least loaded engine.
        up = self.replicas.up
        i = self.router.route(tid, up) if tid else least_loaded(self.router.active, up)
        if i not in up:
            raise EngineLost(f"engine {i}, which held trajectory {tid}'s KV, is down")
        try:
            out: GenerationOutput = await self.replicas.call(
                i, self.replicas.restarts[i], self.actors[i].generate, prompt_ids, params, metadata
            )
        except ActorLost as e:
            raise EngineLost(f"engine {i} died under trajectory {tid}: {e}") from e
        if tid:
            if tid not in self.serving:
                self.new_trajectories[i] += 1
            self.serving.setdefault(tid, set()).add(i)
        return out

    async def end_trajectory(self, trajectory_id: str) -> None:
        i = self.router.engine_of(trajectory_id)
        self.router.end(trajectory_id)
        engines = self.serving.pop(trajectory_id, set())
        for j in engines:
            self.trajectories_per_engine[j] += 1
        if len(engines) > 1:
            self.on_several_engines.append(trajectory_id)
        if i is not None and i in self.replicas.up:
            with contextlib.suppress(ActorLost):
                await call(self.actors[i].end_trajectory, trajectory_id)

    async def publish(self, trainer: GRPOTrainer, run_dir: Path, model_dir: Path) -> None:
        weights = {k: v.detach().cpu() for k, v in trainer.model.hf_state_dict().items()}
        self._weights = (ray.put(weights), trainer.version)
        await asyncio.gather(*(self._load_weights(i) for i in sorted(self.replicas.up)))

    async def _load_weights(self, i: int) -> None:
        with contextlib.suppress(ActorLost):  # it is being brought back with these weights
            await self._send_weights(i, self.replicas.restarts[i])

    async def _send_weights(self, i: int, epoch: int) -> None:
        if self._weights is not None:
            ref, version = self._weights
            await self.replicas.call(i, epoch, self.actors[i].update_weights, ref, version)

    async def _revive(self, i: int) -> None:
        """Wait for Ray to restart engine i and give it the current weights. Trajectories still
        routed to it were lost with it: their next call fails."""
        self.new_trajectories[i] = 0
        actor = self.actors[i]
        self.nodes[i] = await until_alive(lambda: call(actor.node_id), RESTART_TIMEOUT_S)
        while True:
            version = self._weights[1] if self._weights else None
            await self._send_weights(i, self.replicas.restarts[i])
            # A publish during the load went to the engines that were up: catch up.
            if (self._weights[1] if self._weights else None) == version:
                return

    def report(self) -> dict[str, Any]:
        return {
            "engines": [
                {
                    "node": self.nodes[i],
                    "restarts": self.replicas.restarts[i],
                    "up": i in self.replicas.up,
                    "new_trajectories_since_start": self.new_trajectories[i],
                }
                for i in range(len(self.actors))
            ],
            # Ended trajectories and those still in flight (cancelled at the end of the run).
            "trajectories_per_engine": [
                n + sum(i in engines for engines in self.serving.values())
                for i, n in enumerate(self.trajectories_per_engine)
            ],
            "trajectories_on_several_engines": sorted(
                self.on_several_engines
                + [tid for tid, engines in self.serving.items() if len(engines) > 1]
            ),
        }

    async def close(self) -> None:
        self.replicas.cancel()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
