"""The roles of a training run, wired from its config: where sandboxes come from (a pool in this
process, or a Ray fleet of rollout workers), the engine the agent loops generate with and the
trainer publishes to, where episodes run, and the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from venusrl.config import Config
from venusrl.coordinator.admission import AdmissionWindow, TurnWindow
from venusrl.coordinator.agent_loop import ChatFormat
from venusrl.coordinator.config import MixEntry
from venusrl.coordinator.mixing import EnvShare
from venusrl.coordinator.rollouts import LocalRollouts, Rollouts
from venusrl.envs.environment import Environment
from venusrl.envs.loading import environment_class
from venusrl.envs.pool import SandboxPool
from venusrl.envs.service import SandboxSource
from venusrl.envs.task_file import read_task_file
from venusrl.model.directory import load_model
from venusrl.policy.agent_admission import AimdAdmission
from venusrl.policy.kv_window import CriticalWindow
from venusrl.rewards.kinds import reward_pool
from venusrl.runtime.engines import LocalEngine, ServedEngines, served_engines
from venusrl.runtime.faults import engine_faults, sandbox_faults
from venusrl.runtime.run_dir import RunStart
from venusrl.trainer.api import Trainer
from venusrl.trainer.lora import load_adapters
from venusrl.trainer.rank_link import Launch
from venusrl.trainer.rank_processes import ProcessRanks
from venusrl.trainer.ranks import RankedTrainer
from venusrl.trainer.trainer import GRPOTrainer
from venusrl.types import SamplingParams

if TYPE_CHECKING:  # ray is imported for Ray runs only
    from venusrl.runtime.cluster.fleet import RolloutFleet


class RolloutEngine(Protocol):
    """Where new weights are published and the engine counters read: the in-process engine, a
    served one, or the engines of a cluster's rollout workers."""

    async def publish(self, trainer: Trainer, run_dir: Path, model_dir: Path) -> None: ...

    @property
    def version(self) -> int:
        """The weight version the engines hold (the last publish that reached them): what the
        coordinator counts staleness from, never the trainer's version while it publishes."""
        ...

    async def counters(self) -> dict[str, float]:
        """The engines' totals (`Engine.counters`), summed; never lower than before."""
        ...

    async def close(self) -> None: ...


def environment_mix(cfg: Config) -> list[EnvShare]:
    """The run's environments: `rollout.mix`, or `rollout.env` alone, each with its task file's
    tasks read (`ValueError` naming the file, the row and the field at fault)."""
    r = cfg.rollout
    entries = r.mix or [MixEntry(env=r.env, tasks=r.tasks, task_fields=r.task_fields)]
    shares = []
    for e in entries:
        env = environment_class(e.env)
        tasks = (
            None if e.tasks is None else tuple(read_task_file(Path(e.tasks), env, e.task_fields))
        )
        group_size = e.group_size or r.group_size
        shares.append(EnvShare(env, e.weight, group_size, e.max_turns, tasks))
    return shares


@dataclass
class Sandboxes:
    """Where a run's sandboxes come from: its own pool, or the pools of a Ray fleet's workers."""

    source: SandboxSource
    pool: SandboxPool | None = None  # one process
    fleet: RolloutFleet | None = None  # Ray


async def open_sandboxes(
    cfg: Config, mix: list[EnvShare], stack: contextlib.AsyncExitStack
) -> Sandboxes:
    """The pool (or the fleet of rollout workers, each with an engine, a pool and the agent
    loops of its groups, which also make the warm start's sandboxes), the templates of the
    run's environments prepared, and their tools checked."""
    if cfg.runtime.kind == "ray":
        fleet = await stack.enter_async_context(start_fleet(cfg, stack))
        sandboxes = Sandboxes(fleet, fleet=fleet)
    else:
        pool = SandboxPool.from_config(cfg.sandbox)
        sandboxes = Sandboxes(await stack.enter_async_context(pool), pool=pool)
    # One per name: environments that share one (a subclass of another) share its sandboxes.
    for template in {share.env.template.name: share.env.template for share in mix}.values():
        await sandboxes.source.prepare_template(template)
    for share in mix:
        await check_tools(share.env, sandboxes.source)
    return sandboxes


def start_fleet(cfg: Config, stack: contextlib.AsyncExitStack) -> RolloutFleet:
    """The run's rollout workers, on the cluster `runtime.address` names (or one started here,
    shut down with the run)."""
    try:
        from venusrl.runtime.cluster.fleet import RolloutFleet
        from venusrl.runtime.cluster.ray_cluster import RayCluster
    except ModuleNotFoundError as e:
        raise ValueError(f"runtime.kind=ray needs Ray ({e}): pip install 'venusrl[ray]'") from None
    cluster = RayCluster(cfg.runtime)
    stack.callback(cluster.shutdown)
    cluster.check_room(cfg.trainer)
    return RolloutFleet(cfg, cluster)


async def check_tools(env: type[Environment], pool: SandboxSource) -> None:
    """Refuse, before anything trains, an environment whose template does not define its
    Python tools (a typo in a name): the model would be trained on error answers only."""
    if all(tool.run is not None for tool in env.tools):
        return
    sandbox = await pool.create(env.template.name)
    try:
        missing = await env.undefined_tools(sandbox)
    finally:
        await sandbox.close()
    if missing:
        raise ValueError(
            f"{env.name}: its template's setup defines no function for the tools {missing}"
        )


def new_trainer(cfg: Config, start: RunStart, sampling: SamplingParams) -> Trainer:
    """The trainer, on the model the run starts from (its optimizer state too, on a resume):
    in this process, or as `trainer.world_size` ranks (local processes, or Ray actors on a
    Ray run)."""
    version = start.state.weight_version
    # The engine records greedy tokens' logprobs under the raw logits.
    temperature = 1.0 if sampling.greedy else sampling.temperature
    if cfg.trainer.world_size > 1:
        launch: Launch = ProcessRanks
        if cfg.runtime.kind == "ray":  # the cluster is joined: the rollout workers are up
            from venusrl.runtime.cluster.trainer_actors import RayRanks

            launch = functools.partial(RayRanks, cfg.runtime)
        return RankedTrainer(
            start.model_dir, cfg.trainer, version, temperature, not start.fresh, launch
        )
    trainer = GRPOTrainer(
        load_model(start.model_dir, cfg.trainer.device), cfg.trainer, version, None, temperature
    )
    if not start.fresh:
        if not (start.model_dir / "optimizer.pt").exists():
            raise ValueError(
                f"--resume: {start.model_dir} holds a sharded trainer's checkpoint: resume with"
                " its trainer.world_size"
            )
        load_adapters(trainer.model, start.model_dir)
        trainer.optimizer.load_state_dict(
            torch.load(start.model_dir / "optimizer.pt", map_location=cfg.trainer.device)
        )
    return trainer


@dataclass
class RolloutSide:
    """The engine(s) and where episodes run; with `rollout.admission`, the admission window and
    its control loop."""

    engine: RolloutEngine
    rollouts: Rollouts
    window: AdmissionWindow | TurnWindow | None = None
    background: list[asyncio.Task[None]] = field(default_factory=list)  # cancelled at the end


async def start_rollouts(
    cfg: Config,
    start: RunStart,
    sandboxes: Sandboxes,
    fmt: ChatFormat,
    sampling: SamplingParams,
    stack: contextlib.AsyncExitStack,
) -> RolloutSide:
    """The engine loaded with the model the run starts from, closed with the run."""
    version = start.state.weight_version
    if sandboxes.fleet is not None:
        fleet = await sandboxes.fleet.start_engines(start.model_dir, version, sampling)
        stack.push_async_callback(fleet.close)
        return RolloutSide(fleet, fleet)
    assert sandboxes.pool is not None
    engine: LocalEngine | ServedEngines = (
        await served_engines(cfg, start.model_dir, version)
        if cfg.run.engine_url
        else LocalEngine(start.model_dir, cfg, version)
    )
    stack.push_async_callback(engine.close)
    window = await admission_window(cfg, engine)
    seed = cfg.run.seed
    # Under the KV window each turn goes to the engine its place is on; without one, the
    # engine (`ServedEngines`: the fleet) routes each trajectory itself.
    generate = engine_faults(engine.generate, cfg.faults, seed)
    engines = [engine_faults(g, cfg.faults, seed + i) for i, g in enumerate(engine.generates)]
    rewards = reward_pool(cfg.reward, cfg.rollout.reward_timeout_s)
    stack.push_async_callback(rewards.close)
    rollouts = LocalRollouts(
        sandboxes.pool, generate, fmt, sampling, cfg.rollout, engine.end_trajectory, window,
        rewards=rewards, engines=engines,
    )  # fmt: skip
    return RolloutSide(engine, rollouts, window)


async def admission_window(
    cfg: Config, engine: LocalEngine | ServedEngines
) -> AdmissionWindow | TurnWindow | None:
    """`rollout.admission`: the KV window over the run's engines (the simulator's `venus`
    policy, whose books these are too), or the start window over the in-process engine's cache
    (the config allows it with that engine only)."""
    r = cfg.rollout
    if r.admission == "none":
        return None
    if r.admission == "critical":
        return TurnWindow(CriticalWindow(), await engine.kv_capacities())
    assert isinstance(engine, LocalEngine)
    return AdmissionWindow(
        AimdAdmission(initial_window=r.admission_initial_window, period_s=r.admission_period_s),
        engine.cache_signal,
    )


def start_background(cfg: Config, sandboxes: Sandboxes, side: RolloutSide) -> None:
    """Once the warm start is done: injected sandbox faults (on a cluster each worker injects
    into its own pool) and the admission window's control loop."""
    if sandboxes.pool is not None:
        side.background += sandbox_faults(sandboxes.pool, cfg.faults, cfg.run.seed)
    if isinstance(side.window, AdmissionWindow):
        side.background.append(asyncio.create_task(side.window.control()))
