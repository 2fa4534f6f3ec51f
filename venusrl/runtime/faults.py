"""Fault injection for `venusrl train`: the platform failing under a run, on purpose.

Sandboxes are killed for real (every process in their cgroup gets SIGKILL at a random moment of
their life), as a crashed container would be. Engine failures cannot be produced on demand by a
healthy engine, so those are injected in front of it: the call raises instead of generating.
Both must end up as infrastructure failures the coordinator replaces or masks, never as rewards.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from venusrl.engine.request import GenerationOutput, SamplingParams
from venusrl.envs.pool import SandboxPool
from venusrl.envs.sandbox import Sandbox


class InjectedEngineError(RuntimeError):
    pass


class FailingGenerate:
    def __init__(self, generate: Any, rate: float, seed: int) -> None:
        self._generate, self.rate, self._rng = generate, rate, random.Random(seed)
        self.injected = 0

    async def __call__(
        self, prompt_ids: list[int], params: SamplingParams, **metadata: Any
    ) -> GenerationOutput:
        if self._rng.random() < self.rate:
            self.injected += 1
            raise InjectedEngineError("injected engine failure")
        out: GenerationOutput = await self._generate(prompt_ids, params, **metadata)
        return out


async def kill_sandboxes(pool: SandboxPool, fraction: float, seed: int) -> None:
    """Runs until cancelled: each new sandbox is, with probability `fraction`, killed 0-1 s in."""
    rng = random.Random(seed)
    seen: set[str] = set()
    pending: set[asyncio.Future[None]] = set()
    while True:
        for sb in pool.sandboxes():
            if sb.id in seen:
                continue
            seen.add(sb.id)
            if rng.random() < fraction:
                pending.add(asyncio.ensure_future(_kill_later(sb, rng.uniform(0.0, 1.0))))
        pending = {t for t in pending if not t.done()}
        await asyncio.sleep(0.05)


async def _kill_later(sandbox: Sandbox, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await asyncio.to_thread(sandbox.cgroup.kill)
