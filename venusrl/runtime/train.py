"""`venusrl train`: engine, sandbox pool, coordinator and trainer, in one process by default;
with `runtime.kind: ray`, the rollout side (engines, sandbox pools and the agent loops between
them) runs in rollout workers on a Ray cluster (`runtime.cluster`) and the rest stays as it is.

The loop: the coordinator streams groups through the engine and the sandbox pool (`rollouts`);
each trainer step takes B complete groups, computes group-normalised advantages (masked members
left out), takes one GRPO step and publishes the new weights to the engine (hot update, version
+ 1), which lets the coordinator start the groups the staleness bound was holding back.
A run directory holds `config.yaml` and `metrics.jsonl`, one object per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import yaml

from venusrl.config import Config, MixEntry
from venusrl.coordinator.admission import AdmissionWindow
from venusrl.coordinator.agent_loop import ChatFormat, LoopLimits, run_episode
from venusrl.coordinator.coordinator import Coordinator, CoordinatorConfig, GroupResult
from venusrl.coordinator.demonstrations import ScriptedGenerate, retokenize
from venusrl.coordinator.mixing import EnvShare, mixed_tasks, task_key, task_stream
from venusrl.coordinator.rollouts import LocalRollouts, Rollouts
from venusrl.engine.model import CausalLM
from venusrl.engine.model_dir import PRESETS, init_model_dir, load_model
from venusrl.engine.request import SamplingParams
from venusrl.engine.tokenizer import CHATML_TEMPLATE, Tokenizer, build_byte_level_tokenizer
from venusrl.envs.environment import Environment, Task
from venusrl.envs.loading import environment_class
from venusrl.envs.pool import SandboxPool
from venusrl.envs.service import SandboxSource
from venusrl.envs.types import GiB
from venusrl.policy.agent_admission import AimdAdmission
from venusrl.runtime import record
from venusrl.runtime.engines import LocalEngine, ServedEngine
from venusrl.runtime.faults import engine_faults, sandbox_faults
from venusrl.trainer.checkpoint import (
    RunState,
    latest_checkpoint,
    load_run_state,
    save_checkpoint,
    write_model_dir,
)
from venusrl.trainer.trainer import GRPOTrainer, TrainerConfig
from venusrl.types import Finish, Trajectory

if TYPE_CHECKING:  # ray is imported for Ray runs only
    from venusrl.runtime.cluster.workers import RolloutFleet

T = TypeVar("T")
log = logging.getLogger(__name__)


class RolloutEngine(Protocol):
    """Where new weights are published and the engine counters read: the in-process engine, a
    served one, or the engines of a cluster's rollout workers."""

    async def publish(self, trainer: GRPOTrainer, run_dir: Path, model_dir: Path) -> None: ...

    async def counters(self) -> dict[str, float]:
        """The engines' totals (`Engine.counters`), summed; never lower than before."""
        ...

    async def close(self) -> None: ...


def admission_window(cfg: Config, engine: LocalEngine | ServedEngine) -> AdmissionWindow | None:
    """`rollout.admission`: the window over the in-process engine's cache (the config allows it
    with that engine only)."""
    r = cfg.rollout
    if r.admission == "none":
        return None
    assert isinstance(engine, LocalEngine)
    return AdmissionWindow(
        AimdAdmission(initial_window=r.admission_initial_window, period_s=r.admission_period_s),
        engine.cache_signal,
    )


def admission_metrics(window: AdmissionWindow | None) -> dict[str, int]:
    """The window's state when a step ends (nothing without `rollout.admission`)."""
    if window is None:
        return {}
    return {
        "admission_window": window.window,
        "episodes_active": window.active,
        "episodes_held_back": window.waiting,
    }


def step_metrics(
    step: int,
    batch: list[GroupResult],
    version: int,
    wall_s: float,
    extra: dict[str, Any],
    by_env: bool = False,
) -> dict[str, Any]:
    """The `metrics.jsonl` line of a step; `by_env` adds each environment's mean reward and group
    count (a mixed run)."""
    trajectories = [t for g in batch for t in g.trajectories]
    scored = [t.reward for t in trajectories if t.reward is not None]
    wins = [t for t in trajectories if t.reward is not None and t.reward > 0]
    model_versions = [v for t in trajectories for v, m in zip(t.versions, t.mask, strict=True) if m]
    durations = sorted(g.duration_s for g in batch)
    return {
        "step": step,
        "reward_mean": sum(scored) / len(scored) if scored else None,
        "weight_version": version,
        "staleness_mean": (
            sum(version - 1 - v for v in model_versions) / len(model_versions)
            if model_versions
            else 0.0
        ),
        "staleness_max": max((version - 1 - v for v in model_versions), default=0),
        "groups": len(batch),
        "group_s": [round(d, 3) for d in durations],  # open to last member's end, sorted
        "infra_failures": sum(g.infra_failures for g in batch),
        "env_failures": sum(g.env_failures for g in batch),  # of them, the environment's bugs
        "masked": sum(g.masked for g in batch),
        "tool_calls_mean": sum(t.tool_calls for t in trajectories) / max(len(trajectories), 1),
        "wins": len(wins),
        "tool_calls_per_win": sum(t.tool_calls for t in wins) / len(wins) if wins else None,
        "wall_s": wall_s,
        **extra,
        **({"by_env": _by_env(batch)} if by_env else {}),
    }


def since(before: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """Counters from `before` to `now` (a counter `before` lacks counts from zero)."""
    return {k: v - before.get(k, 0) for k, v in now.items()}


def _by_env(batch: list[GroupResult]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({g.env for g in batch}):
        groups = [g for g in batch if g.env == name]
        scored = [t.reward for g in groups for t in g.trajectories if t.reward is not None]
        out[name] = {
            "groups": len(groups),
            "reward_mean": sum(scored) / len(scored) if scored else None,
        }
    return out


def _prepare_run_dir(
    cfg: Config, run_dir: Path, resume: bool, say: Callable[[str], None]
) -> tuple[Path, RunState | None, float]:
    """The model to start from (on a fresh run without `model`, a directory still to be
    written), the state to resume (None for a fresh run) and the run's time when it was saved
    (its wall_s: a resumed run's times go on from there)."""
    metrics_file = run_dir / "metrics.jsonl"
    if resume:
        checkpoint = latest_checkpoint(
            run_dir, lambda path, why: say(f"--resume: passing over {path.name}: {why}")
        )
        if checkpoint is None:
            raise ValueError(
                f"--resume: {run_dir} has no checkpoint that reads back (the first is written "
                f"after run.checkpoint_every={cfg.run.checkpoint_every} steps): start again with "
                "another --run-dir, or remove this one"
            )
        _refuse_changes_to_the_model(cfg, run_dir)
        if (run_dir / "warm_start.json").exists() and not _has_weights(run_dir / "start-model"):
            raise ValueError(
                f"--resume: {run_dir / 'start-model'} is missing, and the run warm-started: the"
                " policy written there is its KL reference (the initial model would not be)"
            )
        state = load_run_state(checkpoint)
        if state.step + 1 >= cfg.run.steps:
            raise ValueError(
                f"--resume: {run_dir} has trained {state.step + 1} steps, run.steps is "
                f"{cfg.run.steps}: nothing to train (pass run.steps=N with N > {state.step + 1}"
                " to train longer)"
            )
        # Steps after the checkpoint are redone: drop their lines so none appears twice.
        kept = [m for m in record.read_metrics(run_dir) if m["step"] <= state.step]
        tmp = metrics_file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
        tmp.replace(metrics_file)
        record.truncate_records(run_dir, state.step)
        # What it resumes with, overrides included: the next --resume starts from this.
        _write_config(cfg, run_dir)
        return checkpoint, state, kept[-1]["wall_s"] if kept else 0.0
    if metrics_file.exists():
        raise ValueError(f"{run_dir} already holds a run: pass --resume, or another --run-dir")
    if cfg.model and not (Path(cfg.model) / "config.json").is_file():
        raise ValueError(f"model: {cfg.model} is not a model directory (it has no config.json)")
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_config(cfg, run_dir)
    return (Path(cfg.model) if cfg.model else run_dir / "initial-model"), None, 0.0


# Keys whose value the checkpoint has already fixed (its weights are of that model): a resume
# that changes them would silently go on with the old one.
FIXED_ON_RESUME = ("model", "run.preset")


def _refuse_changes_to_the_model(cfg: Config, run_dir: Path) -> None:
    ran = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    now = cfg.model_dump()
    for key in FIXED_ON_RESUME:
        *sections, name = key.split(".")
        before, after = ran, now
        for section in sections:
            before, after = before.get(section) or {}, after[section]
        if before.get(name) != after[name]:
            raise ValueError(
                f"--resume: {key} cannot change on resume (the run's checkpoints are of"
                f" {key}={before.get(name)!r}); start a new run to train {after[name]!r}"
            )


def _write_config(cfg: Config, run_dir: Path) -> None:
    path = run_dir / "config.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    tmp.replace(path)


def environment_mix(cfg: Config) -> list[EnvShare]:
    """The run's environments: `rollout.mix`, or `rollout.env` alone."""
    r = cfg.rollout
    entries = r.mix or [MixEntry(env=r.env)]
    return [
        EnvShare(environment_class(e.env), e.weight, e.group_size or r.group_size, e.max_turns)
        for e in entries
    ]


async def play_demonstrations(
    cfg: Config, mix: list[EnvShare], pool: SandboxSource, fmt: ChatFormat, limits: LoopLimits
) -> list[Trajectory]:
    """Scripted demonstrations played in real sandboxes through the agent loop. The environments
    of the mix that have a demonstrator share `run.warm_start_episodes` by their weights; the
    others are left to reinforcement learning."""
    n_tasks = cfg.run.warm_start_episodes
    with_demos: list[tuple[float, list[tuple[type[Environment], Task]]]] = []
    for share in mix:
        env = share.environment()
        tasks = list(itertools.islice(task_stream(env, cfg.run.seed + 7919), n_tasks))
        if tasks and env.demonstrator(tasks[0], cfg.run.seed) is not None:
            with_demos.append((share.weight, [(env, t) for t in tasks]))
    if not with_demos:
        names = ", ".join(share.env.name for share in mix)
        raise ValueError(f"no demonstrator for {names}: set run.warm_start_episodes=0")
    total = sum(weight for weight, _ in with_demos)
    work = [w for weight, tasks in with_demos for w in tasks[: round(n_tasks * weight / total)]]
    policies = {}
    for i, (env, task) in enumerate(work):
        policy = env.demonstrator(task, cfg.run.seed + i)
        if policy is None:
            raise ValueError(f"{env.name}'s demonstrator has no policy for task {task.id}")
        policies[f"demo-{i}"] = policy
    scripted = ScriptedGenerate(fmt.tokenizer, policies)
    gate = asyncio.Semaphore(16)

    async def play(i: int, env: type[Environment], task: Task) -> Trajectory:
        async with gate:
            sandbox = await pool.create(env.template.name, setup=task.setup, files=task.files)
            try:
                return await run_episode(
                    env(task, sandbox), scripted, fmt, SamplingParams(), limits,
                    f"demo-{i}", f"demo-{i}", task.id,
                )  # fmt: skip
            finally:
                await sandbox.close()

    demos = await asyncio.gather(*(play(i, env, t) for i, (env, t) in enumerate(work)))
    return [d for d in demos if d.finish is not Finish.INFRA]


def imitate(cfg: Config, demos: list[Trajectory], trainer: GRPOTrainer) -> dict[str, Any]:
    """The warm start: imitate the demonstrations, so that RL starts from a policy that knows the
    tool-call format and sometimes succeeds (with no success at all, every group's rewards are
    equal and GRPO has no signal)."""
    started = time.monotonic()
    rng = random.Random(cfg.run.seed)
    demos = list(demos)
    losses = []
    for _ in range(cfg.run.warm_start_epochs):
        rng.shuffle(demos)
        for k in range(0, len(demos), cfg.run.warm_start_batch):
            chunk = demos[k : k + cfg.run.warm_start_batch]
            losses.append(trainer.imitation_step(chunk, lr=cfg.run.warm_start_lr))
    rewards = [d.reward for d in demos if d.reward is not None]
    return {
        "episodes": len(demos),
        "demo_reward_mean": sum(rewards) / max(len(rewards), 1),
        "demo_tokens_mean": sum(len(d.token_ids) for d in demos) / max(len(demos), 1),
        "nll_first": losses[0] if losses else 0.0,
        "nll_last": losses[-1] if losses else 0.0,
        "wall_s": time.monotonic() - started,
    }


def _new_model(
    cfg: Config, model_dir: Path, demos: list[Trajectory], played_with: Tokenizer
) -> list[Trajectory]:
    """Write the from-scratch model of a fresh run. With demonstrations, its tokenizer's merges
    are learnt from their text (a task's own vocabulary: a guess_number episode in ~470 tokens
    instead of ~1,410 byte-level ones), and the demonstrations are returned in its ids."""
    if not demos:
        init_model_dir(model_dir, preset=cfg.run.preset, seed=cfg.run.seed)
        return demos
    vocab_size = PRESETS[cfg.run.preset]["vocab_size"]
    corpus = [played_with.decode(d.token_ids, skip_special_tokens=False) for d in demos]
    hf_tokenizer = build_byte_level_tokenizer(corpus, vocab_size)
    init_model_dir(model_dir, preset=cfg.run.preset, seed=cfg.run.seed, tokenizer=hf_tokenizer)
    new = Tokenizer.load(model_dir)
    assert new is not None
    return [retokenize(d, played_with, new) for d in demos]


def start_policy(cfg: Config, run_dir: Path) -> Path:
    """The model directory of the policy reinforcement learning starts from: the warm-started one
    a fresh run wrote (`start-model/`), else the model the run was given. The KL penalty's
    reference and the learning benchmark's baseline."""
    warm = run_dir / "start-model"
    if _has_weights(warm):
        return warm
    return Path(cfg.model) if cfg.model else run_dir / "initial-model"


def _has_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors").exists()


def write_start_policy(run_dir: Path, trainer: GRPOTrainer, model_dir: Path) -> None:
    tmp, final = run_dir / ".tmp-start-model", run_dir / "start-model"
    shutil.rmtree(tmp, ignore_errors=True)
    write_model_dir(tmp, trainer.model, model_dir)
    # One left by a run stopped before its first step, in this directory started again.
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


async def check_tools(env: type[Environment], pool: SandboxSource) -> None:
    """Refuse, before anything trains, an environment whose template does not define its
    Python tools (a typo in a name): the model would be trained on error answers only."""
    sandbox = await pool.create(env.template.name)
    try:
        missing = await env.undefined_tools(sandbox)
    finally:
        await sandbox.close()
    if missing:
        raise ValueError(
            f"{env.name}: its template's setup defines no function for the tools {missing}"
        )


def reference_policy(cfg: Config, run_dir: Path, device: torch.device) -> CausalLM:
    """The KL penalty's reference, the start policy, read from disk so that a resumed run is
    held to the same one."""
    reference = load_model(start_policy(cfg, run_dir), device)
    reference.requires_grad_(False)
    return reference


def start_fleet(cfg: Config, roles: contextlib.AsyncExitStack) -> RolloutFleet:
    """The run's rollout workers, on the cluster `runtime.address` names (or one started here,
    shut down with the run)."""
    try:
        from venusrl.runtime.cluster.ray_cluster import RayCluster
        from venusrl.runtime.cluster.workers import RolloutFleet
    except ModuleNotFoundError as e:
        raise ValueError(f"runtime.kind=ray needs Ray ({e}): pip install 'venusrl[ray]'") from None
    cluster = RayCluster(cfg.runtime)
    roles.callback(cluster.shutdown)
    cluster.check_room()
    return RolloutFleet(cfg, cluster)


async def train(
    cfg: Config,
    run_dir: Path,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    resume: bool = False,
    on_message: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    torch.manual_seed(cfg.run.seed)
    # The engine and the trainer compute side by side on their own threads, one core each by
    # default: more threads than cores makes both several times slower (MEASURED.md).
    torch.set_num_threads(cfg.engine.threads or 1)
    say = on_message or (lambda message: log.warning("%s", message))
    model_dir, state, wall_s = _prepare_run_dir(cfg, run_dir, resume, say)
    if cfg.rollout.temperature == 0:
        say(
            "rollout.temperature=0 samples greedily: the members of a group act alike wherever"
            " their environment does, and GRPO learns only from groups whose rewards differ"
        )
    fresh = state is None
    state = state or RunState(step=-1, weight_version=0)
    consumed = set(state.consumed_tasks)
    mix = environment_mix(cfg)
    r = cfg.rollout
    limits = LoopLimits(
        max_context=r.max_context,
        max_tokens_per_turn=r.max_tokens_per_turn,
        expected_tool_s=r.tool_wait_pin_s,
    )
    metrics: list[dict[str, Any]] = []
    metrics_file = run_dir / "metrics.jsonl"
    # Trainer work runs on one thread of its own, beside the engine's: asyncio's default pool
    # would spread it over many threads, each with its own malloc arena for torch's buffers.
    trainer_thread = ThreadPoolExecutor(1, thread_name_prefix="venusrl-trainer")

    async def on_trainer(fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(trainer_thread, fn, *args)

    async with contextlib.AsyncExitStack() as roles:
        # One process: a sandbox pool here. Ray: rollout workers, each with an engine, a pool
        # and the agent loops of its groups, that also make the warm start's sandboxes.
        fleet: RolloutFleet | None = None
        local_pool: SandboxPool | None = None
        pool: SandboxSource
        if cfg.runtime.kind == "ray":
            fleet = await roles.enter_async_context(start_fleet(cfg, roles))
            pool = fleet
        else:
            local_pool = SandboxPool(
                int(cfg.sandbox.memory_budget_gib * GiB),
                admission=cfg.sandbox.admission,
                share_pages=cfg.sandbox.share_pages,
            )
            pool = await roles.enter_async_context(local_pool)
        # One per name: environments that share one (a subclass of another) share its sandboxes.
        for template in {share.env.template.name: share.env.template for share in mix}.values():
            await pool.prepare_template(template)
        for share in mix:
            await check_tools(share.env, pool)
        demos: list[Trajectory] = []
        prepare_started = time.monotonic()
        if fresh and not cfg.model and not (model_dir / "config.json").exists():
            byte_level = Tokenizer(
                build_byte_level_tokenizer(), chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>"
            )
            if cfg.run.warm_start_episodes:
                # One token per byte takes several times the context the trained tokenizer will.
                roomy = dataclasses.replace(
                    limits,
                    max_context=8 * limits.max_context,
                    max_tokens_per_turn=8 * limits.max_tokens_per_turn,
                )
                demos = await play_demonstrations(cfg, mix, pool, ChatFormat(byte_level), roomy)
            demos = await asyncio.to_thread(_new_model, cfg, model_dir, demos, byte_level)
        tokenizer = Tokenizer.load(model_dir)
        if tokenizer is None or tokenizer.chat_template is None:
            raise ValueError(
                f"{model_dir} needs a tokenizer with a chat template for agent training"
            )
        fmt = ChatFormat(tokenizer)
        if fresh and cfg.run.warm_start_episodes and not demos:
            demos = await play_demonstrations(cfg, mix, pool, fmt, limits)
        # Playing the demonstrations, and on a fresh run writing the model and its tokenizer.
        prepare_s = time.monotonic() - prepare_started
        sampling = SamplingParams(temperature=r.temperature, seed=None)
        trainer = GRPOTrainer(
            load_model(model_dir, cfg.trainer.device),
            TrainerConfig(
                lr=cfg.trainer.lr,
                clip_eps=cfg.trainer.clip_eps,
                entropy_coef=cfg.trainer.entropy_coef,
                kl_coef=cfg.trainer.kl_coef,
                max_grad_norm=cfg.trainer.max_grad_norm,
                micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                updates_per_batch=cfg.trainer.updates_per_batch,
                loss_aggregation=cfg.trainer.loss_aggregation,
                # The engine records greedy tokens' logprobs under the raw logits.
                temperature=1.0 if sampling.greedy else sampling.temperature,
            ),
            version=state.weight_version,
        )
        if resume:
            trainer.optimizer.load_state_dict(
                torch.load(model_dir / "optimizer.pt", map_location=cfg.trainer.device)
            )
        engine: RolloutEngine
        rollouts: Rollouts
        window = None
        if fleet is not None:
            engine = rollouts = await fleet.start_engines(
                model_dir, state.weight_version, sampling, limits
            )
        else:
            assert local_pool is not None
            local = (
                ServedEngine(cfg.run.engine_url)
                if cfg.run.engine_url
                else LocalEngine(model_dir, cfg, state.weight_version)
            )
            window = admission_window(cfg, local)
            generate = engine_faults(local.generate, cfg.faults, cfg.run.seed)
            engine = local
            rollouts = LocalRollouts(
                local_pool, generate, fmt, sampling, limits, local.end_trajectory, window
            )
        try:
            if demos:
                info = {"prepare_s": prepare_s, **await on_trainer(imitate, cfg, demos, trainer)}
                (run_dir / "warm_start.json").write_text(json.dumps(info))
                if on_message is not None:
                    on_message(
                        f"warm start: {info['episodes']} demonstrations (reward "
                        f"{info['demo_reward_mean']:.2f}, {info['demo_tokens_mean']:.0f} tokens),"
                        f" prepared in {prepare_s:.0f} s; NLL {info['nll_first']:.3f} ->"
                        f" {info['nll_last']:.3f} in {info['wall_s']:.0f} s"
                    )
                await on_trainer(write_start_policy, run_dir, trainer, model_dir)
                await engine.publish(trainer, run_dir, model_dir)
            if cfg.trainer.kl_coef:
                trainer.reference = await on_trainer(reference_policy, cfg, run_dir, trainer.device)
            # Sandbox faults on a cluster: each worker injects them into its own pool.
            injected = sandbox_faults(local_pool, cfg.faults, cfg.run.seed) if local_pool else []
            control = asyncio.create_task(window.control()) if window is not None else None
            coordinator = Coordinator(
                mixed_tasks(mix, cfg.run.seed, consumed),
                rollouts,
                CoordinatorConfig(
                    batch_groups=r.batch_groups,
                    max_staleness=r.max_staleness,
                    max_train_staleness=r.max_train_staleness,
                    max_infra_retries=r.max_infra_retries,
                    group_timeout_s=r.group_timeout_s,
                    priorities=r.priorities,
                ),
                weight_version=lambda: trainer.version,
            )
            coordinator.start()
            started = time.monotonic() - wall_s  # a resumed run's times go on from its last
            # Counters since this run (re)started: a served engine may have counted before.
            counted = await engine.counters()
            try:
                for step in range(state.step + 1, cfg.run.steps):
                    batch = await coordinator.next_batch()
                    rows: list[tuple[Trajectory, float]] = [
                        (t, a)
                        for g in batch
                        for t, a in zip(g.trajectories, g.advantages(), strict=True)
                        if a is not None
                    ]
                    stats = await on_trainer(
                        trainer.step, [t for t, _ in rows], [a for _, a in rows]
                    )
                    await engine.publish(trainer, run_dir, model_dir)
                    coordinator.version_changed()
                    line = step_metrics(
                        step,
                        batch,
                        trainer.version,
                        time.monotonic() - started,
                        {
                            "loss": stats.loss,
                            "entropy": stats.entropy,
                            "kl": stats.kl,
                            "clip_fraction": stats.clip_fraction,
                            # Trainer over engine probability of the sampled tokens: far from 1
                            # when the engine samples from other weights than it says.
                            "ratio_mean": stats.mean_ratio,
                            "grad_norm": stats.grad_norm,
                            "tokens": stats.tokens,
                            "sandboxes_running": pool.sandboxes_running(),
                            "groups_started": coordinator.stats.groups_started,
                            "groups_dropped": coordinator.stats.groups_dropped,
                            "groups_running": coordinator.running_groups,
                            "episodes_resumed": rollouts.resumed_episodes,
                            **admission_metrics(window),
                            "engine": since(counted, await engine.counters()),
                        },
                        by_env=len(mix) > 1,
                    )
                    record.append_records(
                        run_dir,
                        (
                            record.trajectory_record(t, step, g.env, started)
                            for g in batch
                            for t in g.trajectories
                        ),
                    )
                    with metrics_file.open("a") as f:
                        f.write(json.dumps(line) + "\n")
                    metrics.append(line)
                    state.consumed_tasks += [task_key(g.env, g.task.id) for g in batch]
                    state.step, state.weight_version = step, trainer.version
                    last = step == cfg.run.steps - 1
                    if (step + 1) % cfg.run.checkpoint_every == 0 or last:
                        await asyncio.to_thread(
                            save_checkpoint,
                            run_dir,
                            trainer.model,
                            trainer.optimizer,
                            state,
                            model_dir,
                        )
                    if on_step is not None:
                        on_step(line)
            finally:
                for task in [*injected, control]:
                    if task is not None:
                        task.cancel()
                await coordinator.close()
        finally:
            if fleet is not None:  # `cluster.json`: where episodes and groups ran, what restarted
                report = await fleet.report()
                (run_dir / "cluster.json").write_text(json.dumps(report, indent=1))
            await engine.close()
            trainer_thread.shutdown()
    return metrics
