"""Warm-start demonstrations: scripted policies played in real sandboxes, then re-expressed in the
ids of a tokenizer learnt from them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests import chat_templates
from venusrl.coordinator.agent_loop import ChatFormat, run_episode
from venusrl.coordinator.config import RolloutConfig
from venusrl.coordinator.demonstrations import ScriptedGenerate, in_format, retokenize
from venusrl.envs import SandboxPool
from venusrl.envs.builtin.guess_number import BinarySearchExpert, GuessNumber
from venusrl.model.tokenizer import (
    CHATML_TEMPLATE,
    Tokenizer,
    build_byte_level_tokenizer,
    write_byte_level_tokenizer,
)
from venusrl.model.tool_calls import format_tool_call
from venusrl.model.tool_formats import tool_parser
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


@pytest.mark.parametrize("model", ["qwen3", "qwen3_coder"])
def test_demonstrations_are_written_in_the_models_own_tool_call_format(model: str) -> None:
    """The expert writes Hermes calls; on Qwen3-Coder's template they reach the environment as
    its XML calls, and the episode is won as in the CPU example's format."""
    tok = chat_templates.tokenizer(model)
    fmt = ChatFormat(tok)
    task = next(GuessNumber.tasks(7))

    async def main() -> tuple[Trajectory, str]:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            await pool.prepare_template(GuessNumber.template)
            sandbox = await pool.create(GuessNumber.template.name, setup=task.setup)
            scripted = ScriptedGenerate(tok, {"d": BinarySearchExpert()}, fmt.tool_parser)
            limits = RolloutConfig(max_context=16384, max_tokens_per_turn=512)
            traj = await run_episode(
                GuessNumber(task, sandbox), scripted, fmt, SamplingParams(), limits, "d", "d", "p"
            )
            return traj, tok.decode(traj.token_ids[traj.turn_starts[0] :])

    traj, played = asyncio.run(main())
    assert traj.finish is Finish.DONE and traj.reward == 1.0
    assert played.startswith(fmt.tool_parser.format_call("guess", {"n": 32}))


def test_a_demonstration_turn_is_rewritten_call_by_call_in_the_models_format() -> None:
    hermes = format_tool_call("guess", {"n": 5}) + "\n" + format_tool_call("guess", {"n": 6})
    llama = tool_parser("llama3_json")
    assert in_format("Two guesses.\n" + hermes, llama) == (
        'Two guesses.\n{"name": "guess", "parameters": {"n": 5}}; '
        '{"name": "guess", "parameters": {"n": 6}}'
    )
    coder = tool_parser("qwen3_coder")
    assert in_format(hermes, coder) == "\n".join(
        coder.format_call("guess", {"n": n}) for n in (5, 6)
    )
    assert in_format("No call.", coder) == "No call."
