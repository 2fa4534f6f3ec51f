"""math_python: word problems computed with a Python tool in a real sandbox, scored by the number
the final reply gives; its shipped tasks are what their script writes, each answer checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest

from tests.envs.test_builtin_envs import call, play, with_pool
from venusrl.envs import SandboxPool
from venusrl.envs.builtin.math_python import TASKS, MathPython
from venusrl.envs.environment import Task
from venusrl.envs.task_file import read_task_file

ROOT = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="sandboxes need root for namespaces and cgroups"
)


def test_the_shipped_tasks_are_what_their_script_writes_and_each_program_prints_its_answer():
    # The script computes each answer and refuses a program that prints anything else.
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_math_python_tasks.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    rows = [json.loads(line) for line in TASKS.read_text().splitlines()]
    assert len(rows) == 100 and len({r["question"] for r in rows}) == 100


def test_tasks_play_the_shipped_file_in_epochs_each_in_a_new_seeded_order():
    first_epoch = list(islice(MathPython.tasks(0), 100))
    assert {t.id for t in first_epoch} == {f"math-{i:03d}@0" for i in range(100)}
    second = list(islice(MathPython.tasks(0), 100, 200))
    assert [t.prompt for t in second] != [t.prompt for t in first_epoch]
    assert {t.id.removesuffix("@1") for t in second} == {
        t.id.removesuffix("@0") for t in first_epoch
    }
    assert list(islice(MathPython.tasks(0), 5)) == list(islice(MathPython.tasks(0), 5))
    assert list(islice(MathPython.tasks(1), 5)) != list(islice(MathPython.tasks(0), 5))


@needs_root
def test_the_demonstrator_computes_each_kind_of_problem_in_the_sandbox_and_wins():
    tasks = list(islice(MathPython.tasks(0), 100))
    # Problems of one kind share their second word ("A deposit of", "Mia saves", ...).
    one_per_kind = list({t.prompt.split()[1]: t for t in tasks}.values())
    assert len(one_per_kind) >= 6

    async def body(pool: SandboxPool) -> list[tuple[float, int]]:
        played = []
        for task in one_per_kind:
            sandbox = await pool.create(MathPython.template.name)
            try:
                policy = MathPython.demonstrator(task, 0)
                assert policy is not None
                reward, steps = await play(MathPython(task, sandbox), policy)
            finally:
                await sandbox.close()
            played.append((reward, sum(s.tool_calls for s in steps)))
        return played

    assert with_pool(MathPython, body) == [(1.0, 1)] * len(one_per_kind)


@needs_root
def test_tool_errors_exits_and_oom_are_observations_and_only_the_final_answer_scores():
    task = Task("t", "What is 6 * 7?", reference={"answer": 42})

    async def body(pool: SandboxPool) -> list[object]:
        async def episode(*turns: str) -> tuple[float, list[str | None]]:
            sandbox = await pool.create(MathPython.template.name)
            try:
                env = MathPython(task, sandbox)
                await env.reset()
                seen = []
                for turn in turns:
                    result = await env.step(turn)
                    seen.append(result.observation)
                    if result.done:
                        break
                return await env.reward(), seen

            finally:
                await sandbox.close()

        return [
            # Each call is a program of its own; its exception, its exit or its running out of
            # memory is what the model reads next, not a crash of the sandbox.
            await episode(
                call("python", code="x = 6 * 7"),
                call("python", code="print(x)"),
                call("python", code="import os\nprint(6 * 7, flush=True)\nos._exit(3)"),
                "It is 42.\nAnswer: 42",
            ),
            await episode(call("python", code="x = bytearray(1 << 30)"), "Answer: 41"),
            await episode("The answer is 42."),  # no final-answer line
            # Out of turns while still calling the tool: no answer, whatever was printed.
            await episode(*[call("python", code="print('Answer: 42')")] * MathPython.max_turns),
        ]

    won, wrong, unformatted, truncated = with_pool(MathPython, body)
    assert won[0] == 1.0
    assert (
        won[1][0] == "<tool_response>\n(no output: print() what you want to see)\n</tool_response>"
    )
    assert "NameError: name 'x' is not defined" in won[1][1]
    assert "42\n[exit code 3]" in won[1][2]
    assert "[killed: out of memory]" in wrong[1][0]
    assert wrong[0] == 0.0 and unformatted[0] == 0.0 and truncated[0] == 0.0


def test_a_task_file_whose_answer_is_no_number_is_refused_naming_the_line(tmp_path: Path) -> None:
    rows = [{"prompt": "2 + 2?", "answer": "4"}, {"prompt": "3 + 3?", "answer": "six"}]
    file = tmp_path / "t.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"t.jsonl:2: the answer 'six' is not a number"):
        read_task_file(file, MathPython)
