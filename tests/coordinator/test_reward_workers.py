"""Rewards off the rollout's path: a finished episode gives its KV-window place up and waits for a
reward worker, its group ranked as nearer done; inline, it holds the place until its reward."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.coordinator.test_coordinator import SteadyGuesser
from venusrl.coordinator.admission import AdmissionWindow, TurnWindow
from venusrl.coordinator.agent_loop import ChatFormat
from venusrl.coordinator.config import RolloutConfig
from venusrl.coordinator.coordinator import Coordinator
from venusrl.coordinator.mixing import GroupTask
from venusrl.coordinator.rollouts import LocalRollouts
from venusrl.envs import SandboxPool
from venusrl.envs.builtin.guess_number import GuessNumber
from venusrl.envs.environment import OpenSandbox, Task
from venusrl.model.directory import init_model_dir
from venusrl.model.tokenizer import Tokenizer
from venusrl.policy.agent_admission import AimdAdmission, CacheSignal
from venusrl.policy.kv_window import CriticalWindow
from venusrl.rewards.kinds import EnvironmentReward
from venusrl.rewards.pool import RewardPool
from venusrl.types import SamplingParams

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


class HeldReward(GuessNumber):
    """guess_number whose reward waits until the test lets it in."""

    let_in: asyncio.Event

    async def reward(self) -> float:
        await HeldReward.let_in.wait()
        return await super().reward()


async def no_signal() -> CacheSignal:
    raise AssertionError("the window's control loop does not run in these tests")


async def until(condition: Callable[[], bool], timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


class FreshGraded(HeldReward):
    """Graded from its output alone in a fresh sandbox of its group, as the swe environment is:
    its reward reads nothing of the episode's own."""

    reward_reads_sandbox = False

    @classmethod
    async def grade(cls, task: Task, output: str | None, open_sandbox: OpenSandbox) -> float:
        await HeldReward.let_in.wait()
        grader = await open_sandbox()
        try:
            r = await grader.run_python("print(1 + 1)", timeout_s=30)
        finally:
            await grader.close()
        return 1.0 if r.stdout.strip() == b"2" else 0.0


def run_group(
    tmp_path: Path,
    workers: int | None,
    look: Callable[..., Any],
    aimd: bool = False,
    env: type[HeldReward] = HeldReward,
) -> Any:
    """One group of two members of `env` to a batch; `look(coordinator, window, rewards, pool)`
    runs while their rewards are held, then they are let in. `aimd`: episodes in an admission
    window of one (rollout.admission=aimd), else the KV window (critical)."""
    tokenizer = Tokenizer.load(init_model_dir(tmp_path / "tiny", preset="tiny", seed=0))
    assert tokenizer is not None
    tasks = (GroupTask(env, task, group_size=2) for task in env.tasks(seed=1))
    config = RolloutConfig(batch_groups=1, max_staleness=0, batch_timeout_s=300,
                           max_context=8192, max_tokens_per_turn=256)  # fmt: skip

    async def main() -> Any:
        HeldReward.let_in = asyncio.Event()
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            await pool.prepare_template(env.template)
            window: TurnWindow | AdmissionWindow = TurnWindow(CriticalWindow(), [1 << 20])
            if aimd:
                window = AdmissionWindow(AimdAdmission(initial_window=1), no_signal)
            rewards = RewardPool(EnvironmentReward(), workers, timeout_s=60)
            rollouts = LocalRollouts(pool, SteadyGuesser(tokenizer, 0.01), ChatFormat(tokenizer),
                                     SamplingParams(), config, admission=window,
                                     rewards=rewards)  # fmt: skip
            coordinator = Coordinator(tasks, rollouts, config, weight_version=lambda: 0)
            coordinator.start()
            try:
                seen = await look(coordinator, window, rewards, pool)
                HeldReward.let_in.set()
                batch = await coordinator.next_batch()
            finally:
                await coordinator.close()
            return seen, batch

    return asyncio.run(main())


def test_a_finished_episode_gives_its_window_place_up_and_its_group_ranks_as_nearly_done(
    tmp_path: Path,
) -> None:
    async def look(
        coordinator: Coordinator, window: TurnWindow, rewards: RewardPool, *_: Any
    ) -> Any:
        await until(lambda: rewards.busy + rewards.queued == 2)
        group = next(iter(coordinator.book.open.values()))
        return dict(window.book.seats), (rewards.busy, rewards.queued), list(group.members)

    (agents, load, members), batch = run_group(tmp_path, workers=1, look=look)
    assert agents == {}  # both turned their places in as their turns ended
    assert load == (1, 1)  # one worker: one scored, the other waits
    assert all(m.reward_since is not None and not m.done for m in members)
    trajectories = batch[0].trajectories
    assert all(t.reward is not None and t.reward_s is not None for t in trajectories)
    assert batch[0].completed_at >= batch[0].rolled_out_at


def test_an_inline_reward_keeps_its_window_place_until_it_is_in(tmp_path: Path) -> None:
    async def look(
        coordinator: Coordinator, window: TurnWindow, rewards: RewardPool, *_: Any
    ) -> Any:
        await until(lambda: rewards.busy == 2)
        group = next(iter(coordinator.book.open.values()))
        return sorted(window.book.seats), list(group.members)

    (agents, members), batch = run_group(tmp_path, workers=None, look=look)
    assert len(agents) == 2  # held by the episodes that are being scored
    assert all(m.reward_since is None for m in members)  # the ranking sees them in a tool call
    assert all(t.reward is not None for t in batch[0].trajectories)


def test_an_episode_scored_off_its_path_lets_its_admission_slot_go_to_the_next_member(
    tmp_path: Path,
) -> None:
    async def look(
        coordinator: Coordinator, window: AdmissionWindow, rewards: RewardPool, *_: Any
    ) -> Any:
        await until(lambda: rewards.busy + rewards.queued == 2)  # both played, in one slot
        return window.active

    active, batch = run_group(tmp_path, workers=2, look=look, aimd=True)
    assert active == 0
    assert all(t.reward is not None for t in batch[0].trajectories)


def test_an_inline_reward_holds_its_admission_slot_so_the_next_member_waits(
    tmp_path: Path,
) -> None:
    async def look(
        coordinator: Coordinator, window: AdmissionWindow, rewards: RewardPool, *_: Any
    ) -> Any:
        await until(lambda: rewards.busy == 1 and window.waiting == 1)
        await asyncio.sleep(0.5)  # it stays so while the first member's reward is held
        return rewards.busy, window.active, window.waiting

    held, batch = run_group(tmp_path, workers=None, look=look, aimd=True)
    assert held == (1, 1, 1)
    assert all(t.reward is not None for t in batch[0].trajectories)


@pytest.mark.parametrize("env", [HeldReward, FreshGraded])
def test_a_trajectory_waiting_for_its_reward_holds_a_sandbox_only_if_its_reward_reads_it(
    tmp_path: Path, env: type[HeldReward]
) -> None:
    async def look(
        coordinator: Coordinator, window: TurnWindow, rewards: RewardPool, pool: SandboxPool
    ) -> int:
        await until(lambda: rewards.busy + rewards.queued == 2)
        await asyncio.sleep(0.2)
        return pool.sandboxes_running()

    running, batch = run_group(tmp_path, workers=1, look=look, env=env)
    assert running == (2 if env.reward_reads_sandbox else 0)
    assert all(t.reward is not None for t in batch[0].trajectories)
    if env is FreshGraded:  # graded in a sandbox of its own, opened after the episode's closed
        assert all(t.reward == 1.0 for t in batch[0].trajectories)
