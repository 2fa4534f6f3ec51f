"""The coordinator runs groups of real episodes (real sandboxes, the agent loop) into batches."""

from __future__ import annotations

import asyncio
import os
import statistics
from pathlib import Path
from typing import Any

import pytest

from venusrl.coordinator.agent_loop import ChatFormat
from venusrl.coordinator.config import RolloutConfig
from venusrl.coordinator.coordinator import Coordinator
from venusrl.coordinator.mixing import GroupTask
from venusrl.coordinator.rollouts import LocalRollouts
from venusrl.envs import SandboxPool
from venusrl.envs.builtin.guess_number import GuessNumber
from venusrl.model.directory import init_model_dir
from venusrl.model.tokenizer import Tokenizer
from venusrl.model.tool_calls import format_tool_call
from venusrl.policy.critical_groups import TurnRates
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


class SteadyGuesser:
    """An engine of known pace: every turn it takes `generation_s` to guess 1 (a wrong guess but
    for one secret in 63, so episodes run to the game's last guess)."""

    def __init__(self, tokenizer: Tokenizer, generation_s: float) -> None:
        self.generation_s = generation_s
        call = format_tool_call("guess", {"n": 1})
        self.ids = tokenizer.encode(call) + tokenizer.encode("<|im_end|>")

    async def __call__(
        self, prompt_ids: list[int], params: SamplingParams, meta: TurnMeta
    ) -> GenerationOutput:
        await asyncio.sleep(self.generation_s)
        n = len(self.ids)
        return GenerationOutput("r", prompt_ids, self.ids, [-0.5] * n, [0] * n, "stop", 0)


def test_the_ranking_assumes_the_decode_speed_and_tool_time_the_members_turns_show(
    tmp_path: Path,
) -> None:
    tokenizer = Tokenizer.load(init_model_dir(tmp_path / "tiny", preset="tiny", seed=0))
    assert tokenizer is not None
    engine = SteadyGuesser(tokenizer, generation_s=0.1)
    tasks = (GroupTask(GuessNumber, task, group_size=2) for task in GuessNumber.tasks(seed=1))
    # One group of two members, then nothing: synchronous training at version 0.
    config = RolloutConfig(
        batch_groups=1,
        max_staleness=0,
        batch_timeout_s=300,
        max_context=8192,
        max_tokens_per_turn=256,
    )

    async def main() -> Any:
        async with SandboxPool(memory_budget_bytes=2 << 30) as pool:
            await pool.prepare_template(GuessNumber.template)
            fmt = ChatFormat(tokenizer)
            rollouts = LocalRollouts(pool, engine, fmt, SamplingParams(), config)
            coordinator = Coordinator(tasks, rollouts, config, weight_version=lambda: 0)
            coordinator.start()
            try:
                batch = await coordinator.next_batch()
            finally:
                await coordinator.close()
            return batch, coordinator.book.snapshot(version=0)

    batch, snap = asyncio.run(main())
    turns = [t for traj in batch[0].trajectories for t in traj.turn_times]
    assert len(turns) >= 4  # each member took several turns
    # Each turn's tokens took at least the engine's 0.1 s, and on a loaded machine not 4 times
    # that; the defaults (50 tok/s, 0.5 s a tool call) are out of these ranges.
    pace = len(engine.ids) / 0.1
    assert pace / 4 < snap.decode_tokens_per_s <= pace
    tool_s = [t.acted - t.generated for traj in batch[0].trajectories for t in traj.turn_times[:-1]]
    assert min(tool_s) <= snap.tool_s_per_turn <= max(tool_s)
    assert snap.tool_s_per_turn == statistics.median(tool_s)
    assert snap.tool_s_per_turn != TurnRates().tool_s_per_turn
