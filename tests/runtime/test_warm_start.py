"""The warm start refuses what would make its demonstrations teach something RL cannot do."""

from __future__ import annotations

from pathlib import Path

import pytest

from venusrl.config import load_config
from venusrl.engine.tokenizer import CHATML_TEMPLATE, Tokenizer, build_byte_level_tokenizer
from venusrl.runtime.warm_start import longest_turn, new_model
from venusrl.types import Trajectory


def demonstration(tok: Tokenizer, i: int, action: str) -> Trajectory:
    traj = Trajectory.start(f"demo-{i}", f"demo-{i}", f"task-{i}", tok.encode("find the cell"))
    ids = tok.encode(action)
    traj.add_model_turn(ids, [0.0] * len(ids), [0] * len(ids))
    traj.add_observation(tok.encode("the cell is empty"))
    return traj


def test_demonstration_turns_longer_than_a_turn_may_be_are_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    byte_level = Tokenizer(
        build_byte_level_tokenizer(), chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>"
    )
    action = "I open cell 42, then cell 17, then cell 63, and read what each one says."
    demos = [demonstration(byte_level, i, action) for i in range(8)]
    fits = load_config(None, ["rollout.max_tokens_per_turn=64"])
    kept = new_model(fits, tmp_path / "fits", demos, byte_level)
    longest = max(longest_turn(d) for d in kept)
    assert 4 < longest <= 64  # the learnt tokenizer's ids, fewer than the bytes
    tight = load_config(None, [f"rollout.max_tokens_per_turn={longest - 1}"])
    with pytest.raises(
        ValueError, match=rf"takes {longest} tokens .*rollout.max_tokens_per_turn={longest - 1}:"
    ):
        new_model(tight, tmp_path / "tight", demos, byte_level)
