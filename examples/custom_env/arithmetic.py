"""An environment of your own, to copy: word problems read from a JSONL file, a calculator tool
that runs inside the sandbox, and a reward that checks the answer the model submitted.

    sudo .venv/bin/venusrl train --config examples/custom-environment.yaml
    sudo .venv/bin/venusrl train rollout.env=examples/custom_env/arithmetic.py:Arithmetic

What each part is for:
- `template.setup` is Python that runs once in the template's warm interpreter; every sandbox of
  the run is forked from it. It defines the tools' functions and the state the reward reads.
- `tools` lists what the model may call. A tool without `run` is the function of that name in
  the sandbox: the model's arguments are checked against `parameters`, then it runs there, and
  its return value (or the error it raised) is the observation.
- `tasks(seed)` is an endless stream; each task's `setup` runs in its sandbox after the
  template's, and `reference` is ground truth the model never sees. Ids must be unique in the
  stream: a resumed run skips the ids it has trained on. `reference_fields` lets tasks come
  from a file too (`rollout.tasks=FILE` with `rollout.task_fields={prompt: question}`,
  `venusrl eval --tasks FILE`; `venusrl/envs/task_file.py`).
- `reward()` reads the sandbox's state once the episode ends; `ended()` ends it early.
- `demonstrator` is optional: a scripted policy the warm start imitates (`run.warm_start_episodes`;
  set it to 0 for an environment without one).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from venusrl.envs.environment import Environment, Task, Tool
from venusrl.envs.task_file import looped_tasks, read_task_file
from venusrl.envs.types import MiB, TemplateSpec
from venusrl.model.tool_calls import RESPONSE_CLOSE, RESPONSE_OPEN, format_tool_call

TASKS = Path(__file__).with_name("tasks.jsonl")

# Runs in the sandbox. `calculate` evaluates the arithmetic itself rather than calling eval():
# the expression is the model's text. No power operator, so no 9**9**9 that runs for ever.
_SETUP = """
import ast
import operator

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.USub: operator.neg,
}
submitted = None


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculate(expression):
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    result = _value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if result == int(result) else f"{result:.6g}"


def submit(answer):
    global submitted
    submitted = answer
    return "submitted"
"""


class Arithmetic(Environment):
    name = "arithmetic"
    template = TemplateSpec(name="arithmetic", setup=_SETUP, declared_memory_bytes=256 * MiB)
    instructions = (
        "You are a helpful assistant that solves word problems with a calculator tool."
        " Compute the answer, then submit it."
    )
    tools = (
        Tool(
            "calculate",
            "Evaluate an arithmetic expression with + - * / and parentheses.",
            {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        ),
        Tool(
            "submit",
            "Submit the final answer. The episode ends.",
            {
                "type": "object",
                "properties": {"answer": {"type": "number"}},
                "required": ["answer"],
            },
        ),
    )
    max_turns = 4

    reference_fields = ("expression", "answer")  # what a task of a file gives: --tasks FILE

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        # The file beside this one, over and over, shuffled anew each time; a run given
        # `rollout.tasks=FILE` plays that file the same way instead.
        return looped_tasks(read_task_file(TASKS, cls, {"prompt": "question"}), seed)

    def ended(self, answers: list[str]) -> bool:
        return "submitted" in answers  # the sandbox's own reply: the model cannot forge it

    async def reward(self) -> float:
        r = await self.sandbox.run_python(
            "print(__import__('json').dumps(submitted))", timeout_s=self.tool_timeout_s
        )
        if not r.ok:
            raise RuntimeError(f"{self.name}: reading the submitted answer failed: {r.text()}")
        submitted = json.loads(r.stdout)
        expected = self.task.reference["answer"]
        return float(submitted is not None and abs(submitted - expected) < 1e-6)

    @classmethod
    def demonstrator(cls, task: Task, seed: int) -> Callable[[str], str]:
        """Calculate the reference expression, then submit what the calculator said."""

        def policy(observation: str) -> str:
            if not observation.startswith(RESPONSE_OPEN):  # the prompt: the first turn
                return format_tool_call("calculate", {"expression": task.reference["expression"]})
            value = float(observation.removeprefix(RESPONSE_OPEN).removesuffix(RESPONSE_CLOSE))
            answer = int(value) if value.is_integer() else value  # 588, not 588.0
            return format_tool_call("submit", {"answer": answer})

        return policy
