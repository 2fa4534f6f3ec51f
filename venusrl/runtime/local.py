"""`venusrl train` in one process: engine, sandbox pool, coordinator and trainer side by side.

The loop: the coordinator streams groups through the in-process engine and the sandbox pool;
each trainer step takes B complete groups, computes group-normalised advantages (masked members
left out), takes one GRPO step and publishes the new weights to the engine (hot update, version
+ 1), which lets the coordinator start the groups the staleness bound was holding back.
A run directory holds `config.yaml` and `metrics.jsonl`, one object per step.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from venusrl.config import Config
from venusrl.coordinator.agent_loop import ChatFormat, LoopLimits
from venusrl.coordinator.coordinator import Coordinator, CoordinatorConfig, GroupResult
from venusrl.engine.async_engine import AsyncEngine
from venusrl.engine.engine import Engine
from venusrl.engine.model_dir import init_model_dir, load_model
from venusrl.engine.request import SamplingParams
from venusrl.engine.tokenizer import Tokenizer
from venusrl.envs.builtin import BUILTIN
from venusrl.envs.pool import SandboxPool
from venusrl.trainer.trainer import GRPOTrainer, TrainerConfig
from venusrl.types import Trajectory

GiB = 1 << 30


def publish(trainer: GRPOTrainer, engine: Engine) -> int:
    """Runs on the engine's thread between two of its steps: in-flight requests keep their KV
    and record the new version on the tokens they produce from now on."""
    return engine.update_weights(trainer.model.hf_state_dict().items(), version=trainer.version)


def step_metrics(
    step: int, batch: list[GroupResult], version: int, wall_s: float, extra: dict[str, Any]
) -> dict[str, Any]:
    trajectories = [t for g in batch for t in g.trajectories]
    scored = [t.reward for t in trajectories if t.reward is not None]
    model_versions = [v for t in trajectories for v, m in zip(t.versions, t.mask, strict=True) if m]
    return {
        "step": step,
        "reward_mean": sum(scored) / len(scored) if scored else None,
        "weight_version": version,
        "staleness_mean": (
            sum(version - 1 - v for v in model_versions) / len(model_versions)
            if model_versions
            else 0.0
        ),
        "groups": len(batch),
        "infra_failures": sum(g.infra_failures for g in batch),
        "masked": sum(g.masked for g in batch),
        "tool_calls_mean": sum(t.tool_calls for t in trajectories) / max(len(trajectories), 1),
        "wall_s": wall_s,
        **extra,
    }


async def train(
    cfg: Config, run_dir: Path, on_step: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    torch.manual_seed(cfg.run.seed)
    model_dir = Path(cfg.model) if cfg.model else run_dir / "initial-model"
    if not cfg.model and not (model_dir / "config.json").exists():
        init_model_dir(model_dir, preset=cfg.run.preset, seed=cfg.run.seed)
    tokenizer = Tokenizer.load(model_dir)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{model_dir} needs a tokenizer with a chat template for agent training")
    engine = AsyncEngine(Engine.from_model_dir(model_dir, cfg.engine)).start()
    trainer = GRPOTrainer(
        load_model(model_dir),
        TrainerConfig(
            lr=cfg.trainer.lr,
            clip_eps=cfg.trainer.clip_eps,
            entropy_coef=cfg.trainer.entropy_coef,
            max_grad_norm=cfg.trainer.max_grad_norm,
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        ),
    )
    env = BUILTIN[cfg.rollout.env]
    r = cfg.rollout
    metrics: list[dict[str, Any]] = []
    metrics_file = run_dir / "metrics.jsonl"
    try:
        async with SandboxPool(
            int(cfg.sandbox.memory_budget_gib * GiB),
            admission=cfg.sandbox.admission,
            share_pages=cfg.sandbox.share_pages,
        ) as pool:
            await pool.prepare_template(env.template)
            coordinator = Coordinator(
                env,
                env.tasks(cfg.run.seed),
                pool,
                engine.generate,
                ChatFormat(tokenizer),
                SamplingParams(temperature=r.temperature, seed=None),
                LoopLimits(max_context=r.max_context, max_tokens_per_turn=r.max_tokens_per_turn),
                CoordinatorConfig(
                    group_size=r.group_size,
                    batch_groups=r.batch_groups,
                    max_staleness=r.max_staleness,
                    max_infra_retries=r.max_infra_retries,
                    group_timeout_s=r.group_timeout_s,
                    priorities=r.priorities,
                ),
                weight_version=lambda: trainer.version,
            )
            coordinator.start()
            started = time.monotonic()
            try:
                for step in range(cfg.run.steps):
                    batch = await coordinator.next_batch()
                    rows: list[tuple[Trajectory, float]] = [
                        (t, a)
                        for g in batch
                        for t, a in zip(g.trajectories, g.advantages(), strict=True)
                        if a is not None
                    ]
                    stats = await asyncio.to_thread(
                        trainer.step, [t for t, _ in rows], [a for _, a in rows]
                    )
                    await engine.call(functools.partial(publish, trainer))
                    coordinator.version_changed()
                    line = step_metrics(
                        step,
                        batch,
                        trainer.version,
                        time.monotonic() - started,
                        {
                            "loss": stats.loss,
                            "entropy": stats.entropy,
                            "clip_fraction": stats.clip_fraction,
                            "tokens": stats.tokens,
                            "sandboxes_running": pool.stats().sandboxes_running,
                        },
                    )
                    with metrics_file.open("a") as f:
                        f.write(json.dumps(line) + "\n")
                    metrics.append(line)
                    if on_step is not None:
                        on_step(line)
            finally:
                await coordinator.close()
    finally:
        engine.stop()
    return metrics
