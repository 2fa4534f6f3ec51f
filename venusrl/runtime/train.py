"""`venusrl train`: engine, sandbox pool, coordinator and trainer, in one process by default;
with `runtime.kind: ray`, the rollout side (engines, sandbox pools and the agent loops between
them) runs in rollout workers on a Ray cluster (`runtime.cluster`), with them the trainer's ranks
when it has several, and the rest stays as it is.

The loop: the coordinator streams groups through the engine and the sandbox pool (`rollouts`);
each trainer step takes B complete groups, computes group-normalised advantages (masked members
left out), takes one GRPO step and publishes the new weights to the engine (hot update, version
+ 1), which lets the coordinator start the groups the staleness bound was holding back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from venusrl.config import Config
from venusrl.coordinator.coordinator import Coordinator, GroupResult
from venusrl.coordinator.mixing import EnvShare, mixed_tasks, task_key
from venusrl.envs.accounts import PoolStats
from venusrl.runtime import record
from venusrl.runtime.checkpoint_schedule import CheckpointSchedule
from venusrl.runtime.loggers import RunLoggers, open_loggers
from venusrl.runtime.roles import (
    RolloutSide,
    Sandboxes,
    environment_mix,
    new_trainer,
    open_sandboxes,
    start_background,
    start_rollouts,
)
from venusrl.runtime.run_dir import RunStart, prepare_run_dir, start_policy
from venusrl.runtime.step_metrics import admission_metrics, reward_wait_s, since, step_metrics
from venusrl.runtime.warm_start import OnTrainer, prepare_model, warm_start
from venusrl.trainer.api import Trainer
from venusrl.trainer.grpo import group_advantages, informative
from venusrl.trainer.shaping import Overlong
from venusrl.trainer.trainer import StepStats
from venusrl.types import SamplingParams, Trajectory

T = TypeVar("T")
log = logging.getLogger(__name__)

# Steps in a row that train nothing (every group scored alike) before the run says so.
UNTRAINED_STEPS_WARNING = 3


async def train(
    cfg: Config,
    run_dir: Path,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    resume: bool = False,
    on_message: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Train `cfg.run.steps` steps (the rest of them on `resume`); returns the steps' metrics.
    `on_step` sees each step's `metrics.jsonl` line, `on_message` what the run has to say."""
    torch.manual_seed(cfg.run.seed)
    # The engine and the trainer compute side by side on their own threads, one core each by
    # default: more threads than cores makes both several times slower (MEASURED.md).
    torch.set_num_threads(cfg.engine.threads or 1)
    say = on_message or (lambda message: log.warning("%s", message))
    mix = environment_mix(cfg)  # task files read first: a bad row leaves no run directory
    start = prepare_run_dir(cfg, run_dir, resume, say)
    if cfg.rollout.temperature == 0:
        say(
            "rollout.temperature=0 samples greedily: the members of a group act alike wherever"
            " their environment does, and GRPO learns only from groups whose rewards differ"
        )
    # Each turn samples with a seed of its own made from this one (`agent_loop.turn_seed`).
    sampling = SamplingParams(temperature=cfg.rollout.temperature, seed=cfg.run.seed)
    with _trainer_thread() as on_trainer:
        async with contextlib.AsyncExitStack() as stack:
            loggers = stack.enter_context(open_loggers(cfg, run_dir, start.state.step + 1, say))
            sandboxes = await open_sandboxes(cfg, mix, stack)
            prepared = await prepare_model(cfg, start, mix, sandboxes.source)
            trainer = new_trainer(cfg, start, sampling)
            stack.callback(trainer.close)
            side = await start_rollouts(cfg, start, sandboxes, prepared.fmt, sampling, stack)
            stack.callback(_cancel, side.background)
            if sandboxes.fleet is not None:
                stack.push_async_callback(_write_cluster_report, sandboxes, run_dir)
            if prepared.demos:
                await warm_start(cfg, start, run_dir, prepared, trainer, on_trainer, on_message)
                await side.engine.publish(trainer, run_dir, start.model_dir)
            if cfg.trainer.kl_coef:
                # Read from disk, so that a resumed run is held to the same reference.
                await on_trainer(trainer.use_reference, start_policy(cfg, run_dir))
            start_background(cfg, sandboxes, side)
            coordinator = Coordinator(
                mixed_tasks(mix, cfg.run.seed, set(start.state.consumed_tasks)),
                side.rollouts,
                cfg.rollout,
                weight_version=lambda: side.engine.version,
                informative=informative_groups(cfg),
            )
            stack.push_async_callback(coordinator.close)
            coordinator.start()
            run = _Run(
                cfg, run_dir, start, mix, trainer, sandboxes, side, coordinator, on_trainer, loggers
            )
            return await run.steps(on_step, say)


def overlong_shaping(cfg: Config) -> Overlong:
    """The loss's shaping of rewards (`trainer.overlong_*`, `trainer.mask_truncated`)."""
    t = cfg.trainer
    limit = t.overlong_max_tokens or cfg.rollout.max_episode_tokens
    return Overlong(limit, t.overlong_buffer_tokens, t.overlong_penalty, t.mask_truncated)


def informative_groups(cfg: Config) -> Callable[[Sequence[Trajectory]], bool] | None:
    """`rollout.dynamic_sampling`: whether a group's rewards, raw or as the loss shapes them,
    teach GRPO anything (None: off)."""
    mode = cfg.rollout.dynamic_sampling
    if mode == "off":
        return None
    shaped = overlong_shaping(cfg).reward
    reward: Callable[[Trajectory], float | None] = shaped if mode == "shaped" else _raw
    return lambda group: informative([reward(t) for t in group])


def _raw(traj: Trajectory) -> float | None:
    return traj.reward


@contextlib.contextmanager
def _trainer_thread() -> Iterator[OnTrainer]:
    """Trainer work runs on one thread of its own, beside the engine's: asyncio's default pool
    would spread it over many threads, each with its own malloc arena for torch's buffers."""
    thread = ThreadPoolExecutor(1, thread_name_prefix="venusrl-trainer")

    async def on_trainer(fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(thread, fn, *args)

    try:
        yield on_trainer
    finally:
        thread.shutdown()


def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()


async def _write_cluster_report(sandboxes: Sandboxes, run_dir: Path) -> None:
    """`cluster.json`: where episodes and groups ran, what restarted."""
    assert sandboxes.fleet is not None
    report = await sandboxes.fleet.report()
    (run_dir / "cluster.json").write_text(json.dumps(report, indent=1))


@dataclass
class _Run:
    """The training loop over its wired roles."""

    cfg: Config
    run_dir: Path
    start: RunStart
    mix: list[EnvShare]
    trainer: Trainer
    sandboxes: Sandboxes
    side: RolloutSide
    coordinator: Coordinator
    on_trainer: OnTrainer
    loggers: RunLoggers

    async def steps(
        self, on_step: Callable[[dict[str, Any]], None] | None, say: Callable[[str], None]
    ) -> list[dict[str, Any]]:
        cfg, state = self.cfg, self.start.state
        started = time.monotonic() - self.start.wall_s  # a resumed run's times go on
        # Counters since this run (re)started: a served engine may have counted before.
        counted = await self.side.engine.counters()
        failures = _FailureCount(self.coordinator)
        untrained = _Untrained(self.run_dir, say)
        run = cfg.run
        checkpoint = CheckpointSchedule(
            run.checkpoint_every, run.steps - 1, run.checkpoint_every_s, time.monotonic()
        )
        metrics = []
        for step in range(state.step + 1, cfg.run.steps):
            t0 = time.monotonic()
            batch = await self.coordinator.next_batch()
            t1 = time.monotonic()
            stats = await self._train(batch)
            t2 = time.monotonic()
            await self.side.engine.publish(self.trainer, self.run_dir, self.start.model_dir)
            t3 = time.monotonic()
            self.coordinator.version_changed()
            engine = since(counted, await self.side.engine.counters())
            pool = await self._pool_counters()
            line = self._line(step, batch, stats, time.monotonic() - started, engine, pool)
            # Where the step's time went: waiting for its batch, training, publishing.
            line.update(batch_wait_s=round(t1 - t0, 3), train_s=round(t2 - t1, 3),
                        publish_s=round(t3 - t2, 3))  # fmt: skip
            # The share of the step the trainer waited on rewards alone, its batch rolled out.
            line["reward_wait_share"] = round(reward_wait_s(batch, t0, t1) / (t3 - t0), 4)
            line["since_last_step"] = failures.since_last_step()
            untrained.observe(line)
            self._record(step, batch, started)
            self.loggers.log(line)  # metrics.jsonl first; a failing TensorBoard or W&B is dropped
            metrics.append(line)
            if checkpoint.due(step, time.monotonic()):
                await self.on_trainer(
                    self.trainer.save_checkpoint, self.run_dir, state, self.start.model_dir
                )
                checkpoint.saved(time.monotonic())
            if on_step is not None:
                on_step(line)
        return metrics

    @functools.cached_property
    def overlong(self) -> Overlong:
        return overlong_shaping(self.cfg)

    async def _train(self, batch: list[GroupResult]) -> StepStats:
        """A step on the batch's trajectories, each group's advantages from its rewards as
        shaped for the loss (`trainer.overlong_*`, `trainer.mask_truncated`)."""
        shaped = self.overlong.reward
        rows: list[tuple[Trajectory, float]] = [
            (t, a)
            for g in batch
            for t, a in zip(
                g.trajectories, group_advantages([shaped(t) for t in g.trajectories]), strict=True
            )
            if a is not None
        ]
        return await self.on_trainer(self.trainer.step, [t for t, _ in rows], [a for _, a in rows])

    def _line(
        self,
        step: int,
        batch: list[GroupResult],
        stats: StepStats,
        wall_s: float,
        engine: dict[str, float],
        pool: dict[str, Any],
    ) -> dict[str, Any]:
        coordinator = self.coordinator
        extra = {
            "loss": stats.loss,
            "entropy": stats.entropy,
            "kl": stats.kl,
            "clip_fraction": stats.clip_fraction,
            # Trainer over engine probability of the sampled tokens: far from 1 when the engine
            # samples from other weights than it says.
            "ratio_mean": stats.mean_ratio,
            # The off-policy correction (`trainer.off_policy`): its mean importance weight, the
            # share of tokens past `trainer.is_cap`, and how far the sampler is from the trainer.
            "is_weight_mean": stats.is_weight,
            "is_capped_fraction": stats.is_capped,
            "sampler_kl": stats.sampler_kl,
            "grad_norm": stats.grad_norm,
            "tokens": stats.tokens,
            "sandboxes_running": self.sandboxes.source.sandboxes_running(),
            "groups_started": coordinator.stats.groups_started,
            "groups_dropped": coordinator.stats.groups_dropped,
            "groups_uniform": coordinator.stats.groups_uniform,
            "groups_running": coordinator.running_groups,
            # Tool calls the group ranking saw return while their members ran: zero means it
            # ranks on the tool time it was given, not the run's own.
            "tool_calls_seen": coordinator.stats.tool_calls_seen,
            "episodes_resumed": self.side.rollouts.resumed_episodes,
            **admission_metrics(self.side.window),
            **self.side.rollouts.reward_counters(),
            **self._overlong_metrics(batch),
            "engine": engine,
            **pool,
        }
        version = self.trainer.version
        return step_metrics(step, batch, version, wall_s, extra, by_env=len(self.mix) > 1)

    def _overlong_metrics(self, batch: list[GroupResult]) -> dict[str, Any]:
        """Where the loss's rewards are shaped: the trajectories masked for their length and
        the mean penalty of the rest."""
        overlong = self.overlong
        if not overlong.on:
            return {}
        scored = [t for g in batch for t in g.trajectories if t.reward is not None]
        kept = [t for t in scored if not overlong.masked(t)]
        penalties = [overlong.penalty_of(t.model_tokens) for t in kept]
        return {
            "overlong_masked": len(scored) - len(kept),
            "overlong_penalty_mean": round(sum(penalties) / len(penalties), 4) if kept else 0.0,
        }

    async def _pool_counters(self) -> dict[str, Any]:
        """The sandbox pool's totals (`PoolStats`): the run's own pool, or a Ray fleet's
        workers' pools as one."""
        if self.sandboxes.pool is not None:
            stats: PoolStats | None = self.sandboxes.pool.stats()
        else:
            assert self.sandboxes.fleet is not None
            stats = await self.sandboxes.fleet.pool_stats()
        if stats is None:
            return {}
        return {"pool": {k: v for k, v in stats.as_dict().items() if not isinstance(v, bool)}}

    def _record(self, step: int, batch: list[GroupResult], started: float) -> None:
        """The batch's trajectories on disk; the state the next checkpoint saves."""
        records = (
            record.trajectory_record(t, step, g.env, started, replaced)
            for g in batch
            for replaced, kept in ((False, g.trajectories), (True, g.replaced))
            for t in kept
        )
        record.append_records(self.run_dir, records)
        state = self.start.state
        state.consumed_tasks += [task_key(g.env, g.task.id) for g in batch]
        state.step, state.weight_version = step, self.trainer.version


class _FailureCount:
    """Every infrastructure failure since the last step, the groups it dropped included (a
    batch counts only its own groups' failures: a group dropped for them is in none)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self._last = self._now()

    def _now(self) -> dict[str, int]:
        s = self.coordinator.stats
        return {
            "infra_failures": s.infra_failures,
            "env_failures": s.env_failures,
            "groups_dropped": s.groups_dropped,
        }

    def since_last_step(self) -> dict[str, int]:
        now = self._now()
        delta = {k: v - self._last[k] for k, v in now.items()}
        self._last = now
        return delta


class _Untrained:
    """Says so when steps in a row train nothing: every group of their batches scored alike
    (all won or all lost), so GRPO's advantages are all zero."""

    def __init__(self, run_dir: Path, say: Callable[[str], None]) -> None:
        self.run_dir, self.say = run_dir, say
        self.in_a_row = 0

    def observe(self, line: dict[str, Any]) -> None:
        self.in_a_row = 0 if line["tokens"] else self.in_a_row + 1
        if self.in_a_row != UNTRAINED_STEPS_WARNING:
            return
        reward = line["reward_mean"]
        policy = "-" if reward is None else f"{reward:.2f}"
        demos = self._demonstrations_reward()
        beside = "" if demos is None else f", the demonstrations' {demos:.2f}"
        self.say(
            f"warning: the last {self.in_a_row} steps trained nothing: every group scored"
            f" alike, so every advantage is 0 (the policy's mean reward {policy}{beside}). A task"
            " the policy always or never solves teaches nothing: make rewards differ within a"
            " group (harder or easier tasks, partial credit, a larger rollout.group_size)"
        )

    def _demonstrations_reward(self) -> float | None:
        path = self.run_dir / "warm_start.json"
        if not path.exists():
            return None
        value = json.loads(path.read_text()).get("demo_reward_mean")
        return None if value is None else float(value)
