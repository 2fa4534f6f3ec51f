"""Overlong shaping (`trainer.overlong_*`, `trainer.mask_truncated`): DAPO's soft penalty over
a buffer before the length limit, and trajectories cut at a length limit left out of the loss."""

from __future__ import annotations

import pytest

from venusrl.trainer.grpo import group_advantages
from venusrl.trainer.shaping import Overlong
from venusrl.types import Finish, Trajectory


def trajectory(model_tokens: int, reward: float | None, finish: Finish = Finish.DONE) -> Trajectory:
    traj = Trajectory.start("t", "g", "p", [1, 2, 3])
    traj.add_model_turn([7] * model_tokens, [0.0] * model_tokens, [0] * model_tokens)
    traj.finish, traj.reward = finish, reward
    return traj


def test_the_penalty_is_nothing_before_the_buffer_then_grows_linearly_to_the_limit() -> None:
    shaping = Overlong(limit=1000, buffer=200, penalty=0.5)
    assert [shaping.penalty_of(n) for n in (0, 800, 900, 1000, 1200)] == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -0.5]
    )
    assert Overlong(limit=1000).penalty_of(1000) == 0.0  # off by default


def test_a_long_trajectory_earns_less_advantage_than_a_short_one_with_the_same_reward() -> None:
    shaping = Overlong(limit=1000, buffer=200)
    group = [trajectory(100, 1.0), trajectory(990, 1.0), trajectory(100, 0.0)]
    plain = group_advantages([t.reward for t in group])
    shaped = group_advantages([shaping.reward(t) for t in group])
    assert plain[0] == plain[1]  # without shaping length makes no difference
    short, long_, failed = shaped
    assert short is not None and long_ is not None and failed is not None
    assert short > long_ > failed


def test_a_trajectory_cut_at_a_length_limit_is_masked_only_when_asked() -> None:
    cut = [trajectory(50, 0.0, Finish.TOKEN_CAP), trajectory(50, 0.0, Finish.CONTEXT_CAP)]
    others = [trajectory(50, 1.0), trajectory(50, 0.0, Finish.TURN_CAP), trajectory(50, None)]
    masking = Overlong(mask_truncated=True)
    assert [masking.reward(t) for t in cut] == [None, None]
    assert [masking.reward(t) for t in others] == [1.0, 0.0, None]
    assert [Overlong().reward(t) for t in cut] == [0.0, 0.0]  # off by default: scored as is
