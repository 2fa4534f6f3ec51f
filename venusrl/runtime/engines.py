"""The rollout engine of a run in one process: in-process on its own thread, or one or several
served over HTTP (`venusrl serve`, or vLLM or SGLang servers: `rollout.backend`). On a Ray
cluster each rollout worker runs a `LocalEngine` of its own (`runtime.cluster.worker`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from venusrl.config import Config
from venusrl.engine.async_engine import AsyncEngine
from venusrl.engine.backend_client import BackendClient
from venusrl.engine.engine import Engine
from venusrl.engine.remote import RemoteEngine, RemoteEngineError
from venusrl.engine.sglang_client import SglangEngine
from venusrl.engine.vllm_client import VllmEngine
from venusrl.model.directory import read_hf_config, read_model_config
from venusrl.policy.agent_admission import CacheSignal
from venusrl.trainer.api import Trainer
from venusrl.types import Generate, GenerationOutput, SamplingParams, TurnMeta

log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.005  # how often a draining engine is asked whether its turns have ended


class LocalEngine:
    """The in-process engine, on its own thread."""

    def __init__(self, model_dir: Path, cfg: Config, version: int) -> None:
        core = Engine.from_model_dir(model_dir, cfg.engine, weight_version=version)
        self.engine = AsyncEngine(core).start()
        self.version = version  # of the weights it holds: the last load that completed
        self.generate = self.engine.generate
        self.weight_update = cfg.engine.weight_update
        self._lost = 0  # re-prefill tokens after eviction, at the last cache signal

    async def end_trajectory(self, trajectory_id: str) -> None:
        await self.engine.call(lambda e: e.end_trajectory(trajectory_id))

    @property
    def generates(self) -> list[Generate]:
        """The engines a KV window places turns on: this one."""
        return [self.generate]

    async def kv_capacities(self) -> list[int]:
        """Tokens of KV its device pages hold (one engine's)."""
        tokens = await self.engine.call(
            lambda e: e.cache.kv.device_pages.capacity * e.cache.page_size
        )
        return [tokens]

    async def cache_signal(self) -> CacheSignal:
        """What its KV cache did since the last call: live occupancy now, KV lost to eviction
        and computed again meanwhile (for `rollout.admission`)."""

        def read(e: Engine) -> tuple[float, int]:
            occupancy = e.cache.live_pages() / e.cache.kv.device_pages.capacity
            return occupancy, e.stats.reprefill_tokens["evicted"]

        occupancy, lost = await self.engine.call(read)
        signal = CacheSignal(occupancy, lost - self._lost)
        self._lost = lost
        return signal

    async def counters(self) -> dict[str, float]:
        """The engine's totals since it started (`Engine.counters`)."""
        return await self.engine.call(lambda e: e.counters())

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # Runs on the engine's thread between two of its steps, copying each tensor as the
        # stream delivers it (`CausalLM.load_weights`; generation waits meanwhile): requests in
        # flight keep their KV and record the new version on the tokens they produce from now on.
        # Drained first, they end their turns under the old weights, and none starts meanwhile.
        drain, flush = self.weight_update == "drain", self.weight_update == "flush"
        if drain:
            await self.engine.call(lambda e: e.hold_admission())
        try:
            while drain and await self.engine.call(lambda e: e.turns_in_flight):
                await asyncio.sleep(DRAIN_POLL_S)
            await self.engine.call(
                lambda e: e.update_weights(weights, version=version, flush_cache=flush)
            )
            self.version = version
        finally:  # a refused or broken load, too: the engine must not stay closed to new turns
            if drain:
                await self.engine.call(lambda e: e.resume_admission())

    async def publish(self, trainer: Trainer, run_dir: Path, model_dir: Path) -> None:
        await self.load_weights(trainer.hf_weights(), trainer.version)

    async def close(self) -> None:
        self.engine.stop()


class ServedClient(Protocol):
    """A served engine's client: ours (`RemoteEngine`) or another project's (`BackendClient`)."""

    url: str

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta | None = None
    ) -> GenerationOutput: ...

    async def end_trajectory(self, trajectory_id: str) -> None: ...

    async def counters(self) -> dict[str, float]: ...

    async def update_weights(self, path: Path, version: int) -> int: ...

    async def close(self) -> None: ...


class ServedEngine:
    """One engine behind HTTP: its client and the weight version it holds."""

    def __init__(self, remote: ServedClient, version: int) -> None:
        self.remote = remote
        self.version = version  # of the weights it holds: the last update it answered

    async def counters(self) -> dict[str, float]:
        """The server's totals since it started (vLLM's and SGLang's: what this client saw of
        them); {} where it cannot say (a server without `GET /stats`, or a failed read): a
        step's metrics are not worth failing the run."""
        try:
            return await self.remote.counters()
        except RemoteEngineError as e:
            log.warning("no engine counters from %s: %s", self.remote.url, e)
            return {}


class ServedEngines:
    """The run's served engines (`run.engine_url`, one or several) as one rollout engine. Each
    turn goes where the KV window puts it (`TurnWindow.gate` over `generates`) or, without a
    window (`generate`), to the engine its trajectory started on, the one with the fewest
    trajectories then. A trajectory whose turn goes to another engine than its last has its KV
    let go there: the engines share no memory, so the new one computes the context again. New
    weights go through a directory every server reads, to all of them at once."""

    def __init__(self, engines: list[ServedEngine]) -> None:
        self.engines = engines
        self.on: dict[str, int] = {}  # trajectory -> the engine that last served it
        self._live = [0] * len(engines)  # trajectories on each
        self.generates: list[Generate] = [self._on_engine(i) for i in range(len(engines))]

    @property
    def version(self) -> int:
        """The weights every engine holds: the oldest of their versions."""
        return min(e.version for e in self.engines)

    async def kv_capacities(self) -> list[int]:
        """Each engine's device KV, tokens (`GET /health` of `venusrl serve`)."""
        capacities = []
        for e in self.engines:
            if not isinstance(e.remote, RemoteEngine):
                raise ValueError(
                    f"{e.remote.url} does not report its device KV to the client, which"
                    " rollout.admission=critical places turns by: set rollout.admission=none"
                )
            capacities.append(await e.remote.kv_capacity_tokens())
        return capacities

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
    ) -> GenerationOutput:
        tid = meta.trajectory_id
        i = self.on.get(tid) if tid is not None else None
        if i is None:
            i = min(range(len(self.engines)), key=lambda j: self._live[j])
        return await self.generates[i](prompt_ids, params, meta)

    def _on_engine(self, i: int) -> Generate:
        remote = self.engines[i].remote

        async def generate(
            prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
        ) -> GenerationOutput:
            tid = meta.trajectory_id
            if tid is not None and self.on.get(tid) != i:
                await self.end_trajectory(tid)
                self.on[tid] = i
                self._live[i] += 1
            return await remote.generate(prompt_ids, params, meta)

        return generate

    async def end_trajectory(self, trajectory_id: str) -> None:
        i = self.on.pop(trajectory_id, None)
        if i is None:
            return
        self._live[i] -= 1
        # A hint for the engine's cache: one that cannot take it (down, restarting) has lost
        # that KV anyway.
        with contextlib.suppress(RemoteEngineError):
            await self.engines[i].remote.end_trajectory(trajectory_id)

    async def counters(self) -> dict[str, float]:
        """The engines' totals, summed."""
        total: dict[str, float] = {}
        for counted in await asyncio.gather(*(e.counters() for e in self.engines)):
            for k, v in counted.items():
                total[k] = total.get(k, 0) + v
        return total

    async def publish(self, trainer: Trainer, run_dir: Path, model_dir: Path) -> None:
        out = run_dir / "published" / f"v{trainer.version}"
        await asyncio.to_thread(trainer.write_model_dir, out, model_dir)

        async def update(e: ServedEngine) -> None:
            await e.remote.update_weights(out, trainer.version)
            e.version = trainer.version

        await asyncio.gather(*(update(e) for e in self.engines))
        for old in (run_dir / "published").glob("v*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)

    async def close(self) -> None:
        await asyncio.gather(*(e.remote.close() for e in self.engines))


BACKENDS: dict[str, type[BackendClient]] = {"vllm": VllmEngine, "sglang": SglangEngine}


async def served_engines(cfg: Config, model_dir: Path, version: int) -> ServedEngines:
    """The engines at `run.engine_url`, of `rollout.backend`. Another project's server is checked
    first and loaded with the weights the run starts from (whatever it was started with: a fresh
    run writes its start model only now), so every token it samples is of a known version."""
    engines: list[ServedEngine] = []
    try:
        for url in cfg.run.engine_urls:
            engines.append(ServedEngine(await served_client(cfg, url, model_dir, version), version))
    except BaseException:
        await asyncio.gather(*(e.remote.close() for e in engines))
        raise
    return ServedEngines(engines)


async def served_client(cfg: Config, url: str, model_dir: Path, version: int) -> ServedClient:
    if cfg.rollout.backend == "venus":
        return RemoteEngine(url)
    eos = read_model_config(model_dir).eos_token_ids
    client = BACKENDS[cfg.rollout.backend](url, eos, version)
    try:
        critical = cfg.rollout.priorities == "critical"
        await client.check(read_hf_config(model_dir), cfg.rollout.max_context, critical)
        await client.update_weights(model_dir, version)
    except RemoteEngineError as e:
        await client.close()
        raise ValueError(f"rollout.backend={cfg.rollout.backend}: {e}") from None
    return client
