"""Play a policy on given tasks: what a model directory wins, measured apart from training.

The episodes run as in training (the in-process engine, the agent loop, one real sandbox per
episode), on tasks the caller chooses, so two policies (a run's start policy and its final
checkpoint) can be compared on the very same tasks. `venusrl eval` and
`benchmarks/train_learning.py` both play and score through this module.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Sequence
from math import comb
from pathlib import Path
from typing import Any

from venusrl.config import Config
from venusrl.coordinator.agent_loop import ChatFormat, run_episode
from venusrl.envs.environment import Environment, Task
from venusrl.envs.pool import SandboxPool
from venusrl.envs.types import GiB
from venusrl.model.tokenizer import Tokenizer
from venusrl.runtime.engines import LocalEngine
from venusrl.runtime.step_metrics import won
from venusrl.trainer.checkpoint import latest_checkpoint
from venusrl.types import SamplingParams, Trajectory

EVAL_TASK_SEED_OFFSET = 104729  # evaluation tasks come from a stream training never draws


def evaluation_tasks(env: type[Environment], seed: int, n: int) -> list[Task]:
    return list(itertools.islice(env.tasks(seed + EVAL_TASK_SEED_OFFSET), n))


def resolve_model(path: Path) -> tuple[Path, Path | None]:
    """(the model directory to play, the run directory it belongs to or None) for a model
    directory, a run's `checkpoints/step-N` or `start-model`, or a run directory (its newest
    checkpoint that reads back); `ValueError` saying what `path` is instead."""
    if not path.exists():
        raise ValueError(f"{path}: no such directory")
    if not path.is_dir():
        raise ValueError(f"{path} is a file: give a model directory, a checkpoint or a run")
    if (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        skipped: list[str] = []
        checkpoint = latest_checkpoint(path, lambda p, why: skipped.append(why))
        if checkpoint is None:
            damaged = f" (passed over: {'; '.join(skipped)})" if skipped else ""
            start = path / "start-model"
            hint = f"; its start policy is {start}" if (start / "config.json").is_file() else ""
            raise ValueError(f"run directory {path} has no checkpoint{damaged}{hint}")
        return checkpoint, path
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path} is not a model directory (no config.json) nor a run directory (no config.yaml)"
        )
    tokenizer = Tokenizer.load(path)
    if tokenizer is None or tokenizer.chat_template is None:
        what = "no tokenizer.json" if tokenizer is None else "a tokenizer without a chat template"
        raise ValueError(f"{path} has {what}: episodes need the model's chat template")
    in_run = path.parent.name == "checkpoints" or path.name == "start-model"
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return path, run_dir if in_run and (run_dir / "config.yaml").is_file() else None


def check_k(k: int, samples: int) -> None:
    """pass@k estimates from `samples` episodes per task, so k may not exceed them."""
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    if samples < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got --samples {samples}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c passed (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k), the
    chance that k of the n drawn without replacement hold at least one pass."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


async def play_policy(
    model_dir: Path,
    env: type[Environment],
    tasks: list[Task],
    cfg: Config,
    temperature: float,
    samples: int = 1,
    concurrency: int = 16,
) -> list[Trajectory]:
    """`samples` episodes per task, task by task (a task's samples side by side, one group);
    `cfg` gives the engine and the loop's limits (`rollout.*`) and `engine.seed` the sampling."""
    tokenizer = Tokenizer.load(model_dir)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{model_dir} needs a tokenizer with a chat template to play episodes")
    fmt = ChatFormat(tokenizer, cfg.rollout.tool_parser)
    slots = asyncio.Semaphore(concurrency)  # sandboxes at a time
    # Only these episodes run on this engine: no pin needed to keep KV from other work.
    rollout = cfg.rollout.model_copy(update={"tool_wait_pin_s": None})
    async with SandboxPool.from_config(cfg.sandbox, 4 * GiB) as pool:
        await pool.prepare_template(env.template)
        engine = LocalEngine(model_dir, cfg, 0)

        async def one(i: int, sample: int, task: Task) -> Trajectory:
            async with slots:
                sandbox = await pool.create(
                    env.template_for(task), setup=task.setup, files=task.files
                )
                try:
                    return await run_episode(
                        env(task, sandbox), engine.generate, fmt,
                        SamplingParams(temperature=temperature), rollout,
                        f"e{i}-{sample}", f"g{i}", task.id,
                    )  # fmt: skip
                finally:
                    await sandbox.close()

        episodes = [one(i, s, t) for i, t in enumerate(tasks) for s in range(samples)]
        try:
            return list(await asyncio.gather(*episodes))
        finally:
            await engine.close()


def summarize(played: Sequence[Trajectory], samples: int, k: int) -> dict[str, Any]:
    """The figures of `played` (`samples` consecutive episodes per task). An infrastructure
    failure is no score of the policy: it counts in `failures`, not against the reward, and a
    task with fewer than k scored samples is left out of pass@k (`tasks_scored` says how many
    count)."""
    check_k(k, samples)
    scored = [t for t in played if t.reward is not None]
    wins = [t for t in scored if won(t)]
    per_task = [played[i : i + samples] for i in range(0, len(played), samples)]
    counts = [(sum(t.reward is not None for t in g), sum(map(won, g))) for g in per_task]
    pass_at = {}
    for kk in sorted({1, k}):
        counted = [pass_at_k(n, c, kk) for n, c in counts if n >= kk]
        pass_at[f"pass@{kk}"] = sum(counted) / len(counted) if counted else None
    failures = [t.failure for t in played if t.failure is not None]
    return {
        "tasks": len(per_task),
        "samples_per_task": samples,
        "episodes": len(played),
        "scored": len(scored),
        "reward_mean": sum(t.reward or 0.0 for t in scored) / len(scored) if scored else None,
        "wins": len(wins),
        **pass_at,
        "tasks_scored": sum(n >= k for n, _ in counts),
        "tool_calls_per_episode": (
            sum(t.tool_calls for t in scored) / len(scored) if scored else None
        ),
        "tool_calls_per_win": sum(t.tool_calls for t in wins) / len(wins) if wins else None,
        "finish": dict(Counter(str(t.finish) for t in played).most_common()),
        "failures": dict(Counter(str(f.kind) for f in failures).most_common()),
        "failure_examples": sorted({f.message for f in failures})[:3],
    }


def episode_record(traj: Trajectory, sample: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """One line of `venusrl eval --out`: the episode's outcome and its transcript, each part
    decoded from the tokens the model and the environment produced (special tokens shown: the
    chat's markup and the tool calls are as the model wrote them)."""
    parts = [("prompt", 0, traj.prompt_len)]
    for start, model_end, end in traj.turn_spans():
        parts += [("model", start, model_end), ("observation", model_end, end)]
    transcript = [
        {"role": role, "text": tokenizer.decode(traj.token_ids[a:b], skip_special_tokens=False)}
        for role, a, b in parts
        if b > a
    ]
    return {
        "task_id": traj.prompt_id,
        "sample": sample,
        "reward": traj.reward,
        "finish": None if traj.finish is None else str(traj.finish),
        "failure_kind": None if traj.failure is None else str(traj.failure.kind),
        "failure": None if traj.failure is None else traj.failure.message,
        "tool_calls": traj.tool_calls,
        "turns": len(traj.turn_starts),
        "tokens": len(traj.token_ids),
        "transcript": transcript,
    }
