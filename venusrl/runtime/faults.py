"""Fault injection for `venusrl train`: the platform failing under a run, on purpose.

Sandboxes are killed for real (every process in their cgroup gets SIGKILL at a random moment of
their life), as a crashed container would be, or preempted by their pool through the path its
memory running high takes. Engine failures cannot be produced on demand by a
healthy engine, so those are injected in front of it: the call raises instead of generating.
Both must end up as infrastructure failures the coordinator replaces or masks, never as rewards.
"""

from __future__ import annotations

import asyncio
import random

from venusrl.envs.pool import SandboxPool
from venusrl.envs.sandbox import Sandbox
from venusrl.runtime.config import FaultsConfig
from venusrl.types import Generate, GenerationOutput, SamplingParams, TurnMeta


class InjectedEngineError(RuntimeError):
    pass


class FailingGenerate:
    def __init__(self, generate: Generate, rate: float, seed: int) -> None:
        self._generate, self.rate, self._rng = generate, rate, random.Random(seed)
        self.injected = 0

    async def __call__(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
    ) -> GenerationOutput:
        if self._rng.random() < self.rate:
            self.injected += 1
            raise InjectedEngineError("injected engine failure")
        return await self._generate(prompt_ids, params, meta)


def engine_faults(generate: Generate, faults: FaultsConfig, seed: int) -> Generate:
    """`generate`, failing `faults.engine_errors` of its calls (as it is when that is 0)."""
    return (
        FailingGenerate(generate, faults.engine_errors, seed) if faults.engine_errors else generate
    )


def sandbox_faults(pool: SandboxPool, faults: FaultsConfig, seed: int) -> list[asyncio.Task[None]]:
    """The sandbox faults `faults` asks for, injected into `pool` until the tasks are
    cancelled."""
    within_s = faults.fault_within_s
    return [
        asyncio.create_task(kill_sandboxes(pool, fraction, seed + i, within_s, preempt))
        for i, (fraction, preempt) in enumerate(
            [(faults.kill_sandboxes, False), (faults.preempt_sandboxes, True)]
        )
        if fraction
    ]


async def kill_sandboxes(
    pool: SandboxPool, fraction: float, seed: int, within_s: float = 1.0, preempt: bool = False
) -> None:
    """Runs until cancelled: each new sandbox is, with probability `fraction`, killed (every
    process of its cgroup, as a crash would) or, with `preempt`, preempted by the pool (as its
    memory running high would) at a uniform time in its first `within_s` seconds."""
    rng = random.Random(seed)
    seen: set[str] = set()
    pending: set[asyncio.Future[None]] = set()
    while True:
        for sb in pool.sandboxes():
            if sb.id in seen:
                continue
            seen.add(sb.id)
            if rng.random() < fraction:
                later = _end_later(pool, sb, rng.uniform(0.0, within_s), preempt)
                pending.add(asyncio.ensure_future(later))
        pending = {t for t in pending if not t.done()}
        await asyncio.sleep(0.05)


async def _end_later(pool: SandboxPool, sandbox: Sandbox, delay_s: float, preempt: bool) -> None:
    await asyncio.sleep(delay_s)
    if preempt:
        await pool.preempt(sandbox, "injected fault")
    else:
        await asyncio.to_thread(sandbox.cgroup.kill)
