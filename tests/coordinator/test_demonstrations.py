"""Warm-start demonstrations: scripted policies played in real sandboxes, then re-expressed in the
ids of a tokenizer learnt from them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from venusrl.coordinator.agent_loop import ChatFormat, run_episode
from venusrl.coordinator.config import RolloutConfig
from venusrl.coordinator.demonstrations import ScriptedGenerate, retokenize
from venusrl.engine.tokenizer import (
    CHATML_TEMPLATE,
    Tokenizer,
    build_byte_level_tokenizer,
    write_byte_level_tokenizer,
)
from venusrl.envs import SandboxPool
from venusrl.envs.builtin.guess_number import BinarySearchExpert, GuessNumber
from venusrl.types import Finish, SamplingParams, Trajectory

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


def play(tokenizer: Tokenizer, seeds: range) -> list[Trajectory]:
    """Expert episodes of GuessNumber, played with `tokenizer` through the agent loop."""
    tasks = [next(GuessNumber.tasks(seed)) for seed in seeds]
    scripted = ScriptedGenerate(tokenizer, {t.id: BinarySearchExpert() for t in tasks})
    fmt = ChatFormat(tokenizer)

    async def main() -> list[Trajectory]:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            await pool.prepare_template(GuessNumber.template)
            out = []
            for task in tasks:
                sandbox = await pool.create(GuessNumber.template.name, setup=task.setup)
                env = GuessNumber(task, sandbox)
                out.append(
                    await run_episode(
                        env,
                        scripted,
                        fmt,
                        SamplingParams(),
                        RolloutConfig(max_context=8192, max_tokens_per_turn=256),
                        task.id,
                        task.id,
                        task.id,
                    )
                )
                await sandbox.close()
            return out

    return asyncio.run(main())


def test_demonstrations_retokenised_equal_demonstrations_played_with_the_new_tokenizer(
    tmp_path: Path,
) -> None:
    byte_level = Tokenizer(
        build_byte_level_tokenizer(), chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>"
    )
    demos = play(byte_level, range(3))
    assert all(d.finish is Finish.DONE and d.reward == 1.0 for d in demos)
    corpus = [byte_level.decode(d.token_ids, skip_special_tokens=False) for d in demos]
    write_byte_level_tokenizer(tmp_path, 4096, build_byte_level_tokenizer(corpus, 512))
    trained = Tokenizer.load(tmp_path)
    assert trained is not None

    replayed = play(trained, range(3))
    for demo, direct in zip(demos, replayed, strict=True):
        converted = retokenize(demo, byte_level, trained)
        assert converted.token_ids == direct.token_ids
        assert converted.mask == direct.mask
        assert converted.turn_starts == direct.turn_starts
        assert (converted.reward, converted.tool_calls) == (direct.reward, direct.tool_calls)
        # the point of training it: a word, a run of punctuation or a digit a token
        assert len(converted.token_ids) < len(demo.token_ids) / 2.5
