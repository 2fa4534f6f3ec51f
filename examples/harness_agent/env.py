"""The harness in `agent.py` as a task family for `venusrl train`: the tasks are sums, the
harness is the agent, and the reward reads the answer it printed.

    .venv/bin/venusrl train --config examples/harness-agent.yaml
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from venusrl.envs.environment import Task
from venusrl.envs.types import TemplateSpec
from venusrl.gateway.harness import HarnessEnvironment, HarnessRun

AGENT = Path(__file__).with_name("agent.py")


class AddingAgent(HarnessEnvironment):
    name = "adding_agent"
    template = TemplateSpec(name="adding_agent")  # unused by the reward; every episode has one

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        for n in range(10**9):
            a, b = rng.randrange(100), rng.randrange(100)
            yield Task(f"add-{seed}-{n}", f"What is {a} + {b}?", reference={"sum": a + b})

    def command(self) -> Sequence[str]:
        return [sys.executable, str(AGENT)]

    async def score(self, run: HarnessRun) -> float:
        words = run.stdout.replace(".", " ").split()
        return 1.0 if str(self.task.reference["sum"]) in words else 0.0
