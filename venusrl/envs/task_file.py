"""Tasks read from a file, for an environment whose tasks are data: JSONL, or Parquet (pyarrow).

Each line (or row) is one task; `fields` maps a task's `id`, `prompt` and each key of `reference`
the environment reads (`Environment.reference_fields`, and those of `optional_fields` a row has)
to the field that holds it (by default the field of the same name); the environment builds the
task from them (`task_from_reference`: treasure_hunt's trail becomes the sandbox setup that hides
it). One that declares no `reference_fields` takes no file. Training plays a file in epochs, each
in a new seeded order (`looped_tasks`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from venusrl.envs.environment import Environment, Task

SUFFIXES = (".jsonl", ".parquet")


def parse_fields(items: Iterable[str]) -> dict[str, str]:
    """`["prompt=question", ...]` as `{"prompt": "question"}`."""
    fields = {}
    for item in items:
        name, sep, column = item.partition("=")
        if not sep or not name or not column:
            raise ValueError(f"--field {item!r} must look like NAME=COLUMN (prompt=question)")
        fields[name] = column
    return fields


def check_fields(env: type[Environment], fields: Mapping[str, str]) -> None:
    """`ValueError` when `env` takes no task file or `fields` maps a name its tasks lack."""
    if env.reference_fields is None:
        raise ValueError(
            f"{env.name} makes its tasks in code (`tasks()`) and reads none from a file: an"
            " environment takes task files when it declares `reference_fields`"
        )
    names = ("id", "prompt", *env.reference_fields, *env.optional_fields)
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(
            f"{unknown[0]!r} is no field of {env.name}'s tasks; they have {', '.join(names)}"
        )


def read_task_file(
    path: Path, env: type[Environment], fields: Mapping[str, str] | None = None
) -> list[Task]:
    """The tasks of `path`, in file order; `ValueError` naming the line (row) and field at fault."""
    fields = fields or {}
    check_fields(env, fields)
    assert env.reference_fields is not None  # check_fields refused None
    columns = {
        name: fields.get(name, env.default_columns.get(name, name))
        for name in ("id", "prompt", *env.reference_fields, *env.optional_fields)
    }
    # A field the mapping names must be there; an id may be left to the line number.
    required = sorted({"prompt", *env.reference_fields, *fields})
    tasks: list[Task] = []
    seen: set[str] = set()
    for where, number, row in _rows(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a task is a JSON object, got {type(row).__name__}")
        for name in required:
            if columns[name] not in row or row[columns[name]] is None:
                raise ValueError(
                    f"{where}: no field {columns[name]!r} (the task's {name}; `task_fields:"
                    f" {{{name}: COLUMN}}` or `--field {name}=COLUMN` reads it from another)"
                )
        given_id = row.get(columns["id"])
        task_id = f"{path.stem}-{number}" if given_id is None else str(given_id)
        if task_id in seen:
            raise ValueError(f"{where}: task id {task_id!r} is taken by an earlier row")
        seen.add(task_id)
        prompt = row[columns["prompt"]]
        if not isinstance(prompt, str):
            raise ValueError(
                f"{where}: the prompt ({columns['prompt']!r}) must be a string, got"
                f" {type(prompt).__name__}"
            )
        reference = env.anchor(
            {
                name: row[columns[name]]
                for name in (*env.reference_fields, *env.optional_fields)
                if row.get(columns[name]) is not None
            },
            path.resolve().parent,
        )
        problem = env.reference_problem(reference)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        tasks.append(env.task_from_reference(task_id, prompt, reference))
    if not tasks:
        raise ValueError(f"task file {path} holds no task")
    return tasks


def looped_tasks(tasks: Sequence[Task], seed: int) -> Iterator[Task]:
    """`tasks` for ever, each epoch in a new order drawn from `seed`; an epoch's ids end in
    `@EPOCH`, so that no id repeats in the stream (a resumed run skips the ids it trained on)."""
    rng = random.Random(seed)
    for epoch in itertools.count():
        for task in rng.sample(list(tasks), len(tasks)):
            yield dataclasses.replace(task, id=f"{task.id}@{epoch}")


def _rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(where, number, row) for each row of `path`; `where` is what an error names."""
    if path.suffix not in SUFFIXES:
        raise ValueError(f"task file {path}: a task file is {' or '.join(SUFFIXES)}")
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read task file {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e})") from None
        yield f"{path}:{number}", number, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise ValueError(
            f"task file {path}: reading Parquet needs pyarrow (pip install 'venusrl[datasets]')"
        ) from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # missing, or not Parquet (pyarrow's ArrowInvalid)
        raise ValueError(f"cannot read task file {path}: {e}") from None
    # Rows are numbered from 1, as a file's lines are.
    for number, row in enumerate(table.to_pylist(), 1):
        yield f"{path} row {number}", number, row
