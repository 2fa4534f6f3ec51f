"""The warm start refuses what would make its demonstrations teach something RL cannot do."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from venusrl.config import load_config
from venusrl.envs import SandboxPool
from venusrl.envs.builtin.guess_number import GuessNumber
from venusrl.model.tokenizer import CHATML_TEMPLATE, Tokenizer, build_byte_level_tokenizer
from venusrl.runtime.roles import environment_mix
from venusrl.runtime.run_dir import RunStart
from venusrl.runtime.warm_start import Prepared, longest_turn, new_model, prepare_model
from venusrl.trainer.checkpoint import RunState
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


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")
def test_rollout_tool_parser_is_the_format_the_warm_start_demonstrates_and_the_run_parses(
    tmp_path: Path,
) -> None:
    """From the config key to the chat format the run plays with: a fresh CPU model's
    demonstrations call the tool in Qwen3-Coder's XML, and they still win."""
    cfg = load_config(
        None,
        [
            "rollout.env=guess_number",
            "rollout.tool_parser=qwen3_coder",
            "rollout.max_tokens_per_turn=64",
            "run.warm_start_episodes=2",
            "run.preset=tiny",
        ],
    )
    start = RunStart(tmp_path / "model", RunState(-1, 0), 0.0, fresh=True)

    async def main() -> Prepared:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            await pool.prepare_template(GuessNumber.template)
            return await prepare_model(cfg, start, environment_mix(cfg), pool)

    prepared = asyncio.run(main())
    assert prepared.fmt.tool_parser.name == "qwen3_coder"
    assert [d.reward for d in prepared.demos] == [1.0, 1.0]
    tok = prepared.fmt.tokenizer
    first = prepared.demos[0]
    turn = tok.decode(first.token_ids[first.turn_starts[0] : first.turn_starts[1]])
    assert turn.startswith("<tool_call>\n<function=guess>\n<parameter=n>\n32\n</parameter>")
