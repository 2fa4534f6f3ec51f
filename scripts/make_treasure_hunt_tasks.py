"""Write `venusrl/envs/builtin/data/treasure_hunt.jsonl`: treasure_hunt's tasks as a task file.

    python scripts/make_treasure_hunt_tasks.py [--check]

The first rows of `TreasureHunt.tasks(TASK_FILE_SEED)`, each its `id`, `prompt` and `trail` (the
environment derives the rest), so that a run from the file plays what a run from the stream
would. `--check` verifies the shipped file is what this script writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import islice
from pathlib import Path

# This checkout's venusrl, not whichever one is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from venusrl.envs.builtin.treasure_hunt import (
    TASK_FILE,
    TASK_FILE_ROWS,
    TASK_FILE_SEED,
    TreasureHunt,
)


def rows() -> str:
    tasks = islice(TreasureHunt.tasks(TASK_FILE_SEED), TASK_FILE_ROWS)
    return "".join(
        json.dumps({"id": t.id, "prompt": t.prompt, "trail": t.reference["trail"]}) + "\n"
        for t in tasks
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    text = rows()
    if args.check:
        if not TASK_FILE.is_file() or TASK_FILE.read_text() != text:
            print(f"{TASK_FILE} is not what this script writes: run it", file=sys.stderr)
            return 1
        return 0
    TASK_FILE.write_text(text)
    print(f"wrote {TASK_FILE_ROWS} tasks to {TASK_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
