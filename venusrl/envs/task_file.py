"""Tasks read from a JSONL file, for an environment whose tasks are data.

Each line is a JSON object; `fields` maps a task's `id`, `prompt` and each key of `reference`
the environment reads (`Environment.reference_fields`) to the line's field that holds it (by
default the field of the same name). An environment whose tasks are made in code (a secret set up
in its sandbox, as `treasure_hunt`'s) declares no `reference_fields` and takes no file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from venusrl.envs.environment import Environment, Task


def parse_fields(items: Iterable[str]) -> dict[str, str]:
    """`["prompt=question", ...]` as `{"prompt": "question"}`."""
    fields = {}
    for item in items:
        name, sep, column = item.partition("=")
        if not sep or not name or not column:
            raise ValueError(f"--field {item!r} must look like NAME=COLUMN (prompt=question)")
        fields[name] = column
    return fields


def read_task_file(
    path: Path, env: type[Environment], fields: Mapping[str, str] | None = None
) -> list[Task]:
    """The tasks of `path`, in file order; `ValueError` naming the line and field at fault."""
    if env.reference_fields is None:
        raise ValueError(
            f"{env.name} makes its tasks in code (`tasks()`) and reads none from a file: an"
            " environment takes task files when it declares `reference_fields`"
        )
    names = ("id", "prompt", *env.reference_fields)
    unknown = sorted(set(fields or {}) - set(names))
    if unknown:
        raise ValueError(
            f"--field {unknown[0]}: {env.name}'s tasks have the fields {', '.join(names)}"
        )
    columns = {name: (fields or {}).get(name, name) for name in names}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read task file {path}: {e.strerror}") from None
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a task is a JSON object, got {type(row).__name__}")
        for name, column in columns.items():
            if column not in row and not (name == "id" and "id" not in (fields or {})):
                raise ValueError(
                    f"{where}: no field {column!r} (the task's {name}; --field {name}=COLUMN"
                    " reads it from another)"
                )
        task_id = str(row.get(columns["id"], f"{path.stem}-{number}"))
        if task_id in seen:
            raise ValueError(f"{where}: task id {task_id!r} is taken by an earlier line")
        seen.add(task_id)
        prompt = row[columns["prompt"]]
        if not isinstance(prompt, str):
            raise ValueError(
                f"{where}: the prompt ({columns['prompt']!r}) must be a string, got"
                f" {type(prompt).__name__}"
            )
        reference = {name: row[columns[name]] for name in env.reference_fields}
        tasks.append(Task(task_id, prompt, reference=reference))
    if not tasks:
        raise ValueError(f"task file {path} holds no task")
    return tasks
