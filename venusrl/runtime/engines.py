"""The rollout engine of a run in one process: in-process on its own thread, or served over
HTTP (`venusrl serve`, or a vLLM or SGLang server: `rollout.backend`). On a Ray cluster each
rollout worker runs a `LocalEngine` of its own (`runtime.cluster.worker`)."""

from __future__ import annotations

import asyncio
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
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta

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

    async def kv_capacity_tokens(self) -> int:
        """Tokens of KV its device pages hold."""
        return await self.engine.call(
            lambda e: e.cache.kv.device_pages.capacity * e.cache.page_size
        )

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
    """An engine behind HTTP: weights go through a directory both can read."""

    def __init__(self, remote: ServedClient, version: int) -> None:
        self.remote = remote
        self.version = version  # of the weights it holds: the last update it answered
        self.generate = self.remote.generate
        self.end_trajectory = self.remote.end_trajectory

    async def counters(self) -> dict[str, float]:
        """The server's totals since it started (vLLM's and SGLang's: what this client saw of
        them); {} where it cannot say (a server without `GET /stats`, or a failed read): a
        step's metrics are not worth failing the run."""
        try:
            return await self.remote.counters()
        except RemoteEngineError as e:
            log.warning("no engine counters from %s: %s", self.remote.url, e)
            return {}

    async def publish(self, trainer: Trainer, run_dir: Path, model_dir: Path) -> None:
        out = run_dir / "published" / f"v{trainer.version}"
        await asyncio.to_thread(trainer.write_model_dir, out, model_dir)
        await self.remote.update_weights(out, trainer.version)
        self.version = trainer.version
        for old in (run_dir / "published").glob("v*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)

    async def close(self) -> None:
        await self.remote.close()


BACKENDS: dict[str, type[BackendClient]] = {"vllm": VllmEngine, "sglang": SglangEngine}


async def served_engine(cfg: Config, model_dir: Path, version: int) -> ServedEngine:
    """The engine at `run.engine_url`, of `rollout.backend`. Another project's server is checked
    first and loaded with the weights the run starts from (whatever it was started with: a fresh
    run writes its start model only now), so every token it samples is of a known version."""
    assert cfg.run.engine_url is not None
    if cfg.rollout.backend == "venus":
        return ServedEngine(RemoteEngine(cfg.run.engine_url), version)
    eos = read_model_config(model_dir).eos_token_ids
    client = BACKENDS[cfg.rollout.backend](cfg.run.engine_url, eos, version)
    try:
        critical = cfg.rollout.priorities == "critical"
        await client.check(read_hf_config(model_dir), cfg.rollout.max_context, critical)
        await client.update_weights(model_dir, version)
    except RemoteEngineError as e:
        await client.close()
        raise ValueError(f"rollout.backend={cfg.rollout.backend}: {e}") from None
    return ServedEngine(client, version)
