"""A systems workload in real sandboxes: the shape of an agentic RL episode without its meaning.

Every model turn counts as one tool call, whatever the model wrote: the sandbox runs for the turn's
tool latency (a real process that sleeps) and answers with an observation of the turn's size; the
episode ends after its number of turns. Turns, observation sizes, tool latencies and rewards are
drawn per task from one seeded generator, shaped like WORKLOADS.md's swe-long scenario scaled down
for a CPU: 5-20 turns, observations LN(96, 0.8) characters, and swe-long's whole tool latency
distribution x 0.25: the body LN(0.4 s, 0.8), heavy calls LN(20 s, 1.3) with probability 0.02 m
and hangs of 450 s with probability 0.001 m, where m ~ LN(1, 1.3) per task (some tasks have slow
tests). The heavy calls and hangs are what leave a synchronous batch waiting on its stragglers. A
task carries one draw per group member, so every scheduler that runs the same seed sees the same
work, whatever order the members start in.

It measures schedulers (benchmarks/e2e_scheduler.py), not learning: the reward is drawn, not earned.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from venusrl.envs.environment import Environment, StepResult, Task, Tool
from venusrl.envs.types import MiB, TemplateSpec
from venusrl.model.tool_calls import clip_response, format_tool_response
from venusrl.workloads import SWE_LONG, LogNormal

TIME_SCALE = 0.25
TOOL_S = SWE_LONG.tool_s.scaled(TIME_SCALE)
OBSERVATION_CHARS = LogNormal(96, 0.8, 8, 400)
PROMPT_CHARS = LogNormal(256, 0.3, 64, 512)
MEMBERS_PER_TASK = 64  # draws per task; replacement members take the next ones
_WORDS = ("alpha", "beta", "gamma", "delta", "log", "file", "test", "error", "ok", "line")


@dataclass(frozen=True)
class MemberDraw:
    tool_s: tuple[float, ...]  # one per turn
    observation_chars: tuple[int, ...]
    reward: float


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(_WORDS))
    return " ".join(words)[:chars]


class AgentWorkload(Environment):
    name = "agent_workload"
    # `step` runs every turn as a sleep of its own; the tool is what the prompt shows.
    template = TemplateSpec(
        name="agent-workload", setup="def work():\n    return ''\n", declared_memory_bytes=64 * MiB
    )
    instructions = "You are an agent. Use the tool."
    tools = (Tool("work", "Do one step of work.", {"type": "object", "properties": {}}),)
    max_turns = 20
    tool_timeout_s = TOOL_S.hang_s + 10.0  # a hang runs its drawn length, as a heavy call does
    _next_member: ClassVar[dict[str, Iterator[int]]] = {}

    def __init__(self, task: Task, sandbox: object) -> None:
        super().__init__(task, sandbox)  # type: ignore[arg-type]
        member = next(self._next_member.setdefault(task.id, itertools.count()))
        draws = task.reference["members"]
        self.draw = MemberDraw(**draws[member % len(draws)])

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        for index in itertools.count():
            pass_rate = rng.uniform(0.2, 0.8)
            slowness = TOOL_S.prompt_level(rng)
            members = []
            for _ in range(MEMBERS_PER_TASK):
                turns = rng.randint(5, cls.max_turns)
                members.append(
                    {
                        "tool_s": tuple(TOOL_S.sample(rng, slowness) for _ in range(turns)),
                        "observation_chars": tuple(
                            int(OBSERVATION_CHARS.sample(rng)) for _ in range(turns)
                        ),
                        "reward": float(rng.random() < pass_rate),
                    }
                )
            prompt = _text(rng, int(PROMPT_CHARS.sample(rng)))
            yield Task(id=f"work-{seed}-{index}", prompt=prompt, reference={"members": members})

    async def step(self, action_text: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.name}: step() after the episode ended")
        turn = self.turns
        self.turns += 1
        observation = _text(
            random.Random(f"{self.task.id}/{turn}"), self.draw.observation_chars[turn]
        )
        # A real process in the sandbox, for the turn's tool latency.
        source = (
            f"import time; time.sleep({self.draw.tool_s[turn]!r}); print({json.dumps(observation)})"
        )
        r = await self.sandbox.run_python(source, timeout_s=self.tool_timeout_s)
        text = r.text().removesuffix("\n") if r.ok else f"error: {r.text()}"
        self.done = self.turns >= len(self.draw.tool_s)
        errors = int(not r.ok)
        if self.done:
            return StepResult(None, True, tool_calls=1, tool_errors=errors)
        clipped = clip_response(text, self.max_observation_chars)
        observation = format_tool_response(text, self.max_observation_chars)
        return StepResult(observation, False, 1, errors, tool_responses=(clipped,))

    async def reward(self) -> float:
        return self.draw.reward
