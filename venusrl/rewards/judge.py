"""A judge model: the episode written into a rubric, the model's score read out of its answer.

Sent to any OpenAI-compatible server (`venusrl serve`, vLLM, SGLang) as a chat completion; the
pool sends up to `reward.service.max_in_flight` at once, so the server's continuous batching
runs them together. The prompt's `{prompt}`, `{response}`, `{output}` and `{reference}` are the
task's prompt, the model's last turn, what the episode produced and the task's ground truth (no
other braces are touched, so a rubric may show JSON). The reward is the last match of
`score_pattern`'s first group over `max_score`; an answer without one, or out of [0, max_score],
is no answer, and is asked again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from venusrl.envs.environment import Environment
from venusrl.rewards.config import JudgeConfig, ServiceConfig
from venusrl.rewards.http import ServiceClient
from venusrl.rewards.pool import RewardJob

RUBRIC = """You are grading an AI agent's work on a task.

The task:
{prompt}

The agent's final answer:
{response}

What the agent produced (a file, a diff; may be empty):
{output}

The reference solution, which the agent never saw:
{reference}

Grade how fully and correctly the agent solved the task, from 0 (not at all) to 10 (fully and
correctly). Explain in one or two sentences, then end with a line of the form "Score: N".
"""


def judge_prompt(template: str, job: RewardJob) -> str:
    turns = job.turns
    fields = {
        "prompt": job.task.prompt,
        "response": turns[-1] if turns else "",
        "output": job.trajectory.output or "",
        "reference": json.dumps(dict(job.task.reference), default=str, ensure_ascii=False),
    }
    return re.sub(r"\{(prompt|response|output|reference)\}", lambda m: fields[m[1]], template)


class JudgeReward:
    def __init__(self, service: ServiceConfig, judge: JudgeConfig) -> None:
        self.service, self.judge = ServiceClient(service), judge
        self.template = RUBRIC if judge.prompt_file is None else Path(judge.prompt_file).read_text()
        self.pattern = re.compile(judge.score_pattern)

    def reads_sandbox(self, env: type[Environment]) -> bool:
        return False  # it reads the record alone

    async def score(self, job: RewardJob) -> float:
        j = self.judge
        body = {
            "model": j.model,
            "messages": [{"role": "user", "content": judge_prompt(self.template, job)}],
            "max_tokens": j.max_tokens,
            "temperature": j.temperature,
        }
        return await self.service.post("/chat/completions", body, self.reward_of)

    def reward_of(self, answer: Any) -> float:
        """The reward in a chat completion; ValueError when its text holds no score."""
        text = answer["choices"][0]["message"]["content"]
        if not isinstance(text, str):
            raise TypeError("the judge's message has no text")
        scores = self.pattern.findall(text)
        if not scores:
            raise ValueError(f"no score matching {self.pattern.pattern!r} in the judge's answer")
        last = scores[-1]
        score = float(last[0] if isinstance(last, tuple) else last)
        if not 0 <= score <= self.judge.max_score:
            raise ValueError(f"score {score:g} is outside [0, {self.judge.max_score:g}]")
        return score / self.judge.max_score

    async def close(self) -> None:
        await self.service.close()
