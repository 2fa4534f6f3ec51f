"""Tasks read from a JSONL file, their fields mapped onto what the environment reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from venusrl.envs.builtin.treasure_hunt import TreasureHunt
from venusrl.envs.loading import environment_class
from venusrl.envs.task_file import parse_fields, read_task_file

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = environment_class(f"{ROOT}/examples/custom_env/arithmetic.py:Arithmetic")


def write(path: Path, *rows: object) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" if not isinstance(r, str) else r for r in rows))
    return path


def test_a_task_file_maps_its_fields_onto_the_task_id_prompt_and_reference(
    tmp_path: Path,
) -> None:
    file = write(
        tmp_path / "sums.jsonl",
        {"key": "a", "question": "2 + 3?", "expression": "2 + 3", "answer": 5, "extra": 1},
        "\n",  # a blank line is no task
        {"key": "b", "question": "4 * 6?", "expression": "4 * 6", "answer": 24},
    )
    tasks = read_task_file(file, ARITHMETIC, parse_fields(["prompt=question", "id=key"]))
    assert [(t.id, t.prompt) for t in tasks] == [("a", "2 + 3?"), ("b", "4 * 6?")]
    assert tasks[1].reference == {"expression": "4 * 6", "answer": 24}  # only what it reads
    # Lines without an id are named by their line number.
    unnamed = read_task_file(file, ARITHMETIC, {"prompt": "question"})
    assert [t.id for t in unnamed] == ["sums-1", "sums-3"]
    # The example's own stream is its file read this way.
    assert next(iter(ARITHMETIC.tasks(0))).prompt.endswith("?")


def test_a_task_file_that_cannot_be_read_as_tasks_is_refused_naming_the_line(
    tmp_path: Path,
) -> None:
    good = {"id": "a", "prompt": "2 + 3?", "expression": "2 + 3", "answer": 5}
    with pytest.raises(ValueError, match=r"treasure_hunt makes its tasks in code"):
        read_task_file(write(tmp_path / "t.jsonl", good), TreasureHunt)
    bad = {k: v for k, v in good.items() if k != "answer"}
    with pytest.raises(ValueError, match=r"t.jsonl:2: no field 'answer' \(the task's answer;"):
        read_task_file(write(tmp_path / "t.jsonl", good, bad), ARITHMETIC)
    with pytest.raises(ValueError, match=r"t.jsonl:1: no field 'question' \(the task's prompt;"):
        read_task_file(write(tmp_path / "t.jsonl", good), ARITHMETIC, {"prompt": "question"})
    with pytest.raises(ValueError, match=r"t.jsonl:1: not JSON"):
        read_task_file(write(tmp_path / "t.jsonl", "{oops\n"), ARITHMETIC)
    with pytest.raises(ValueError, match=r"t.jsonl:2: task id 'a' is taken by an earlier line"):
        read_task_file(write(tmp_path / "t.jsonl", good, good), ARITHMETIC)
    with pytest.raises(ValueError, match=r"--field answr: arithmetic's tasks have the fields"):
        read_task_file(write(tmp_path / "t.jsonl", good), ARITHMETIC, {"answr": "x"})
    chat = good | {"prompt": [{"role": "user", "content": "2 + 3?"}]}
    with pytest.raises(ValueError, match=r"t.jsonl:1: the prompt \('prompt'\) must be a string"):
        read_task_file(write(tmp_path / "t.jsonl", chat), ARITHMETIC)
    with pytest.raises(ValueError, match=r"holds no task"):
        read_task_file(write(tmp_path / "t.jsonl", "\n"), ARITHMETIC)
    with pytest.raises(ValueError, match=r"cannot read task file"):
        read_task_file(tmp_path / "missing.jsonl", ARITHMETIC)
    with pytest.raises(ValueError, match=r"must look like NAME=COLUMN"):
        parse_fields(["prompt"])
