"""Math with a Python tool: word problems whose answer is a number, computed in the sandbox.

WORKLOADS.md's math-python scenario at a small scale: the model may run Python programs in its
sandbox (each call a program of its own) and ends with a turn without a tool call whose final
line is `Answer: NUMBER` (or `\\boxed{NUMBER}`). Reward: 1 when that
number is the task's `answer` (`envs/numeric_answer.py`: fractions exact, decimals within 1e-6),
else 0. Tasks come from a file (`rollout.tasks`; by default the ~100 shipped in
`data/math_python.jsonl`, made and checked by `scripts/make_math_python_tasks.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from venusrl.envs.environment import Environment, SandboxVerbs, StepResult, Task, Tool
from venusrl.envs.numeric_answer import answer_is_correct, parse_number
from venusrl.envs.task_file import looped_tasks, read_task_file
from venusrl.envs.types import MiB, TemplateSpec
from venusrl.model.tool_calls import RESPONSE_CLOSE, RESPONSE_OPEN, format_tool_call

TASKS = Path(__file__).with_name("data") / "math_python.jsonl"
_MAX_OUTPUT_BYTES = 64 << 10  # per call; the observation is capped further in characters


async def _python(sandbox: SandboxVerbs, arguments: dict[str, Any], timeout_s: float) -> str:
    # A program of its own, not the sandbox's interpreter (`run_python`): code that exits the
    # process or runs out of memory ends that program, which the model reads and fixes, instead
    # of crashing the sandbox, which would count as the platform's failure and be retried.
    r = await sandbox.exec(
        ["python", "-c", arguments["code"]], timeout_s=timeout_s, max_output_bytes=_MAX_OUTPUT_BYTES
    )
    status = (
        "" if r.exit_code == 0 or r.timed_out or r.oom_killed else f"\n[exit code {r.exit_code}]"
    )
    return (r.text().removesuffix("\n") + status) or "(no output: print() what you want to see)"


class MathPython(Environment):
    name = "math_python"
    template = TemplateSpec(name="math-python", declared_memory_bytes=256 * MiB)
    instructions = (
        "You solve math word problems. You may run Python with the python tool to compute;"
        " print() what you want to see. When you know the result, reply without a tool call and"
        " end your reply with a final line `Answer: NUMBER` (an integer, a decimal or a fraction"
        " like 3/4)."
    )
    tools = (
        Tool(
            "python",
            "Run a Python program and return what it prints (and any error). Each call is a"
            " new program: nothing is kept from the one before.",
            {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source"}},
                "required": ["code"],
            },
            _python,
        ),
    )
    max_turns = 4
    reference_fields = ("answer",)
    optional_fields = ("program",)  # Python that prints the answer: the demonstrator runs it

    def __init__(self, task: Task, sandbox: SandboxVerbs) -> None:
        super().__init__(task, sandbox)
        self.final_text: str | None = None

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        return looped_tasks(_shipped_tasks(), seed)

    async def step(self, action_text: str) -> StepResult:
        result = await super().step(action_text)
        if result.done and result.tool_calls == 0:
            self.final_text = action_text  # the answer turn; a truncated episode has none
        return result

    async def reward(self) -> float:
        if self.final_text is None:
            return 0.0
        return float(answer_is_correct(self.final_text, self.task.reference["answer"]))

    @classmethod
    def reference_problem(cls, reference: Mapping[str, Any]) -> str | None:
        answer = reference["answer"]
        if isinstance(answer, bool) or not isinstance(answer, int | float | str):
            return f"the answer must be a number or a string of one, got {answer!r}"
        if isinstance(answer, str) and parse_number(answer) is None:
            return f"the answer {answer!r} is not a number"
        return None

    @classmethod
    def demonstrator(cls, task: Task, seed: int) -> Callable[[str], str] | None:
        """Run the task's program, then answer with what it printed; None for a task without
        one (a file of the user's own that gives only answers)."""
        program = task.reference.get("program")
        return None if program is None else ProgramRunner(str(program))


@functools.cache
def _shipped_tasks() -> list[Task]:
    # The column names of GSM8K-style files; a file of the user's own maps its own.
    return read_task_file(TASKS, MathPython, {"prompt": "question"})


class ProgramRunner:
    """A scripted policy: calls the python tool with a program that prints the answer, then
    answers with the last line the tool printed (so the answer went through the sandbox)."""

    def __init__(self, program: str) -> None:
        self.program = program
        self.ran = False

    def __call__(self, observation: str) -> str:
        if not self.ran:
            self.ran = True
            return format_tool_call("python", {"code": self.program})
        printed = observation.removeprefix(f"{RESPONSE_OPEN}\n").removesuffix(f"\n{RESPONSE_CLOSE}")
        return f"The program printed the result.\nAnswer: {printed.strip().splitlines()[-1]}"
