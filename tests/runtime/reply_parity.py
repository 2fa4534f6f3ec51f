"""An environment a random-weight model wins half the time: one turn, scored by whether the
reply's text has an even length. Every step then has groups whose rewards differ, so GRPO trains
tokens in each, which a test of what was trained needs (`test_vllm_backend.py`)."""

from __future__ import annotations

from venusrl.envs.builtin.guess_number import GuessNumber
from venusrl.envs.environment import StepResult


class ReplyParity(GuessNumber):
    name = "reply_parity"
    max_turns = 1

    async def step(self, action_text: str) -> StepResult:
        self.reply, self.done = action_text, True
        return StepResult(None, True)

    async def reward(self) -> float:
        return float(len(self.reply) % 2 == 0)
