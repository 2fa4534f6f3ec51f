"""Tasks read from a JSONL or Parquet file, their fields mapped onto what the environment reads,
and played in epochs."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from venusrl.envs.builtin.guess_number import GuessNumber
from venusrl.envs.builtin.treasure_hunt import TreasureHunt
from venusrl.envs.loading import environment_class
from venusrl.envs.task_file import looped_tasks, parse_fields, read_task_file

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
    with pytest.raises(ValueError, match=r"guess_number makes its tasks in code"):
        read_task_file(write(tmp_path / "t.jsonl", good), GuessNumber)
    bad = {k: v for k, v in good.items() if k != "answer"}
    with pytest.raises(ValueError, match=r"t.jsonl:2: no field 'answer' \(the task's answer;"):
        read_task_file(write(tmp_path / "t.jsonl", good, bad), ARITHMETIC)
    with pytest.raises(ValueError, match=r"t.jsonl:1: no field 'question' \(the task's prompt;"):
        read_task_file(write(tmp_path / "t.jsonl", good), ARITHMETIC, {"prompt": "question"})
    with pytest.raises(ValueError, match=r"t.jsonl:1: not JSON"):
        read_task_file(write(tmp_path / "t.jsonl", "{oops\n"), ARITHMETIC)
    with pytest.raises(ValueError, match=r"t.jsonl:2: task id 'a' is taken by an earlier row"):
        read_task_file(write(tmp_path / "t.jsonl", good, good), ARITHMETIC)
    with pytest.raises(ValueError, match=r"'answr' is no field of arithmetic's tasks; they have"):
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
    with pytest.raises(ValueError, match=r"a task file is .jsonl or .parquet"):
        read_task_file(write(tmp_path / "t.json", good), ARITHMETIC)


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"trail": [5, 9, 12, 70]}, "the trail's cell 70 is not between 1 and 63"),
        ({"trail": [5, 9, 5, 12]}, "the trail holds cell 5 twice; its cells must be distinct"),
        ({"trail": [5, 9, 12]}, "the trail must hold 4 to 7 cells, got 3"),
        ({"trail": [5, 9, 12, "13"]}, "the trail must be a list of cell numbers, got"),
        ({"trail": 5}, "the trail must be a list of cell numbers, got 5"),
        ({"trail": [5, 9, 12, 13], "opens": 3}, r"opens must be an integer from the trail's"),
        ({"path": [5, 9, 12, 13]}, r"no field 'trail' \(the task's trail;"),
    ],
)
def test_a_treasure_hunt_row_whose_trail_could_not_be_played_is_refused_naming_line_and_field(
    tmp_path: Path, row: dict[str, object], problem: str
) -> None:
    good = {"prompt": "Start by opening cell 7.", "trail": [7, 1, 2, 3]}
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: {problem}"):
        read_task_file(write(tmp_path / "t.jsonl", good, {"prompt": "?", **row}), TreasureHunt)


def test_a_parquet_file_is_read_like_a_jsonl_one_and_its_errors_name_the_row(
    tmp_path: Path,
) -> None:
    table = pa.table(
        {
            "question": ["2 + 3?", "4 * 6?"],
            "expression": ["2 + 3", "4 * 6"],
            "solution": [5, 24],
        }
    )
    pq.write_table(table, tmp_path / "sums.parquet")
    fields = {"prompt": "question", "answer": "solution"}
    tasks = read_task_file(tmp_path / "sums.parquet", ARITHMETIC, fields)
    assert [(t.id, t.prompt, t.reference) for t in tasks] == [
        ("sums-1", "2 + 3?", {"expression": "2 + 3", "answer": 5}),
        ("sums-2", "4 * 6?", {"expression": "4 * 6", "answer": 24}),
    ]
    # A null is a missing field: a Parquet column has a value in every row, or a null.
    table = table.set_column(2, "solution", pa.array([5, None]))
    pq.write_table(table, tmp_path / "holes.parquet")
    with pytest.raises(ValueError, match=r"holes.parquet row 2: no field 'solution' \(the task's"):
        read_task_file(tmp_path / "holes.parquet", ARITHMETIC, fields)
    (tmp_path / "not.parquet").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"cannot read task file .*not.parquet"):
        read_task_file(tmp_path / "not.parquet", ARITHMETIC, fields)


def test_a_treasure_hunt_parquet_file_with_a_list_column_gives_the_tasks_its_jsonl_gives(
    tmp_path: Path,
) -> None:
    rows = [
        {"id": "a", "prompt": "Open cell 7 first.", "trail": [7, 1, 2, 3]},
        {"id": "b", "prompt": "Open cell 9 first.", "trail": [9, 4, 5, 6, 8], "opens": 5},
    ]
    # A row without `opens` has a null there, which is no value.
    columns = {key: [r.get(key) for r in rows] for key in ("id", "prompt", "trail", "opens")}
    pq.write_table(pa.table(columns), tmp_path / "hunts.parquet")
    from_parquet = read_task_file(tmp_path / "hunts.parquet", TreasureHunt)
    assert from_parquet == read_task_file(write(tmp_path / "hunts.jsonl", *rows), TreasureHunt)
    assert [t.setup for t in from_parquet] == [
        "trail = [7, 1, 2, 3]\nopens_left = 5",  # the default: the trail and the slack
        "trail = [9, 4, 5, 6, 8]\nopens_left = 5",
    ]


def test_a_task_file_is_played_in_epochs_each_a_new_seeded_order_with_ids_that_never_repeat(
    tmp_path: Path,
) -> None:
    rows = [{"id": f"t{i}", "question": "?", "expression": "1", "answer": 1} for i in range(20)]
    tasks = read_task_file(write(tmp_path / "t.jsonl", *rows), ARITHMETIC, {"prompt": "question"})
    drawn = list(islice(looped_tasks(tasks, seed=0), 60))
    epochs = [drawn[i : i + 20] for i in range(0, 60, 20)]
    for epoch, played in enumerate(epochs):
        assert sorted(t.id for t in played) == sorted(f"t{i}@{epoch}" for i in range(20))
    orders = [[t.id.partition("@")[0] for t in played] for played in epochs]
    assert len({tuple(order) for order in orders}) == 3  # each epoch shuffled anew
    assert list(islice(looped_tasks(tasks, seed=0), 60)) == drawn  # a resume draws the same
    assert list(islice(looped_tasks(tasks, seed=1), 20)) != drawn[:20]
