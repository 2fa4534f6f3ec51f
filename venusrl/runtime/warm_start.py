"""The warm start: scripted demonstrations played in real sandboxes through the agent loop, and
imitated before RL, so that RL starts from a policy that knows the tool-call format and sometimes
succeeds (with no success at all, every group's rewards are equal and GRPO has no signal). A
fresh run without a model learns its tokenizer from the demonstrations' text.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from venusrl.config import Config
from venusrl.coordinator.agent_loop import ChatFormat, run_episode
from venusrl.coordinator.config import RolloutConfig
from venusrl.coordinator.demonstrations import ScriptedGenerate, retokenize
from venusrl.coordinator.mixing import EnvShare, task_stream
from venusrl.envs.environment import Environment, Task
from venusrl.envs.service import SandboxSource
from venusrl.model.directory import init_model_dir
from venusrl.model.presets import PRESETS
from venusrl.model.tokenizer import CHATML_TEMPLATE, Tokenizer, build_byte_level_tokenizer
from venusrl.runtime.run_dir import RunStart, write_start_policy
from venusrl.trainer.api import Trainer
from venusrl.types import Finish, SamplingParams, Trajectory


@dataclass
class Prepared:
    """The model a run trains, ready: its chat format, and the demonstrations to imitate (in
    its tokenizer's ids; none on a resumed run or without a warm start)."""

    fmt: ChatFormat
    demos: list[Trajectory]
    prepare_s: float  # playing the demonstrations and writing a fresh model


async def prepare_model(
    cfg: Config, start: RunStart, mix: list[EnvShare], pool: SandboxSource
) -> Prepared:
    """On a fresh run without a model, the demonstrations are played byte by byte, then the
    model is written with a tokenizer learnt from their text; otherwise they are played with
    the model's own tokenizer."""
    r, model_dir = cfg.rollout, start.model_dir
    demos: list[Trajectory] = []
    started = time.monotonic()
    if start.fresh and not cfg.model and not (model_dir / "config.json").exists():
        byte_level = Tokenizer(
            build_byte_level_tokenizer(), chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>"
        )
        if cfg.run.warm_start_episodes:
            # One token per byte takes several times the context the trained tokenizer will.
            roomy = r.model_copy(
                update={
                    "max_context": 8 * r.max_context,
                    "max_tokens_per_turn": 8 * r.max_tokens_per_turn,
                }
            )
            demos = await play_demonstrations(
                cfg, mix, pool, ChatFormat(byte_level, r.tool_parser), roomy
            )
        demos = await asyncio.to_thread(new_model, cfg, model_dir, demos, byte_level)
    tokenizer = Tokenizer.load(model_dir)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{model_dir} needs a tokenizer with a chat template for agent training")
    fmt = ChatFormat(tokenizer, r.tool_parser)
    if start.fresh and cfg.run.warm_start_episodes and not demos:
        demos = await play_demonstrations(cfg, mix, pool, fmt, r)
    return Prepared(fmt, demos, time.monotonic() - started)


OnTrainer = Callable[..., Awaitable[Any]]  # runs a function on the trainer's thread


async def warm_start(
    cfg: Config,
    start: RunStart,
    run_dir: Path,
    prepared: Prepared,
    trainer: Trainer,
    on_trainer: OnTrainer,
    tell: Callable[[str], None] | None,
) -> None:
    """Imitate the demonstrations; the policy this makes is written as `start-model/` and as the
    checkpoint before the first step (`step-start/`): a run killed before its first step's
    checkpoint resumes from it instead of playing and imitating again."""
    info = {"prepare_s": prepared.prepare_s}
    info |= await on_trainer(imitate, cfg, prepared.demos, trainer)
    (run_dir / "warm_start.json").write_text(json.dumps(info))
    if tell is not None:
        tell(
            f"warm start: {info['episodes']} demonstrations (reward"
            f" {info['demo_reward_mean']:.2f}, {info['demo_tokens_mean']:.0f} tokens), prepared"
            f" in {prepared.prepare_s:.0f} s; NLL {info['nll_first']:.3f} ->"
            f" {info['nll_last']:.3f} in {info['wall_s']:.0f} s"
        )
    await on_trainer(write_start_policy, run_dir, trainer, start.model_dir)
    await on_trainer(trainer.save_checkpoint, run_dir, start.state, start.model_dir)


async def play_demonstrations(
    cfg: Config, mix: list[EnvShare], pool: SandboxSource, fmt: ChatFormat, rollout: RolloutConfig
) -> list[Trajectory]:
    """Scripted demonstrations played in real sandboxes through the agent loop. The environments
    of the mix that have a demonstrator share `run.warm_start_episodes` by their weights; the
    others are left to reinforcement learning."""
    n_tasks = cfg.run.warm_start_episodes
    with_demos: list[tuple[float, list[tuple[type[Environment], Task]]]] = []
    for share in mix:
        env = share.environment()
        tasks = list(itertools.islice(task_stream(share, cfg.run.seed + 7919), n_tasks))
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
    scripted = ScriptedGenerate(fmt.tokenizer, policies, fmt.tool_parser)
    gate = asyncio.Semaphore(16)

    async def play(i: int, env: type[Environment], task: Task) -> Trajectory:
        async with gate:
            sandbox = await pool.create(env.template_for(task), setup=task.setup, files=task.files)
            try:
                return await run_episode(
                    env(task, sandbox), scripted, fmt, SamplingParams(), rollout,
                    f"demo-{i}", f"demo-{i}", task.id,
                )  # fmt: skip
            finally:
                await sandbox.close()

    demos = await asyncio.gather(*(play(i, env, t) for i, (env, t) in enumerate(work)))
    return [d for d in demos if d.finish is not Finish.INFRA]


def imitate(cfg: Config, demos: list[Trajectory], trainer: Trainer) -> dict[str, Any]:
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


def new_model(
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
    demos = [retokenize(d, played_with, new) for d in demos]
    longest = max(longest_turn(d) for d in demos)
    if longest > cfg.rollout.max_tokens_per_turn:
        raise ValueError(
            f"a demonstration turn takes {longest} tokens of the learnt tokenizer, more than"
            f" rollout.max_tokens_per_turn={cfg.rollout.max_tokens_per_turn}: reinforcement"
            " learning would cut short the turns the warm start teaches whole; raise"
            " rollout.max_tokens_per_turn"
        )
    return demos


def longest_turn(traj: Trajectory) -> int:
    """The most tokens the model wrote in one turn of `traj`."""
    bounds = [*traj.turn_starts, len(traj.token_ids)]
    return max((sum(traj.mask[a:b]) for a, b in itertools.pairwise(bounds)), default=0)
