"""Play a policy on given tasks: what a model directory wins, measured apart from training.

The episodes run as in training (the in-process engine, the agent loop, one real sandbox per
episode), on tasks the caller chooses, so two policies (a run's start policy and its final
checkpoint) can be compared on the very same tasks: the evaluation `benchmarks/train_learning.py`
reports beside the training reward.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from venusrl.config import Config
from venusrl.coordinator.agent_loop import ChatFormat, run_episode
from venusrl.engine.tokenizer import Tokenizer
from venusrl.envs.environment import Environment, Task
from venusrl.envs.pool import SandboxPool
from venusrl.envs.types import GiB
from venusrl.runtime.engines import LocalEngine
from venusrl.types import SamplingParams, Trajectory

EVAL_TASK_SEED_OFFSET = 104729  # evaluation tasks come from a stream training never draws


def evaluation_tasks(env: type[Environment], seed: int, n: int) -> list[Task]:
    return list(itertools.islice(env.tasks(seed + EVAL_TASK_SEED_OFFSET), n))


async def play_policy(
    model_dir: Path,
    env: type[Environment],
    tasks: list[Task],
    cfg: Config,
    temperature: float,
    concurrency: int = 16,
) -> list[Trajectory]:
    """One episode per task, in task order; `cfg` gives the engine and the loop's limits
    (`rollout.*`) and `engine.seed` the sampling."""
    tokenizer = Tokenizer.load(model_dir)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{model_dir} needs a tokenizer with a chat template to play episodes")
    fmt = ChatFormat(tokenizer)
    slots = asyncio.Semaphore(concurrency)  # sandboxes at a time
    # Only these episodes run on this engine: no pin needed to keep KV from other work.
    rollout = cfg.rollout.model_copy(update={"tool_wait_pin_s": None})
    async with SandboxPool(4 * GiB) as pool:
        await pool.prepare_template(env.template)
        engine = LocalEngine(model_dir, cfg, 0)

        async def one(i: int, task: Task) -> Trajectory:
            async with slots:
                sandbox = await pool.create(env.template.name, setup=task.setup, files=task.files)
                try:
                    return await run_episode(
                        env(task, sandbox), engine.generate, fmt,
                        SamplingParams(temperature=temperature), rollout,
                        f"e{i}", f"g{i}", task.id,
                    )  # fmt: skip
                finally:
                    await sandbox.close()

        try:
            return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))
        finally:
            await engine.close()
