"""Treasure hunt: follow a trail of clues through the cells of a sandbox.

The sandbox holds CELLS numbered cells. A task hides a trail of 4 to 7 distinct cells there (the
task's setup; the prompt names only the first): opening a cell of the trail says which cell holds
the next clue, the last one holds the treasure, and every other cell is empty. The model calls
`open_cell(cell)` and may open the trail's length plus SLACK cells. Reward: 1 when the treasure
cell was opened, else 0. The episode ends with the game: at the treasure, or when no open is left.

A win takes one tool call per cell of the trail (4 to 7), each reading the number the last
observation names, so the episode is genuinely multi-turn and nothing can be won without reading
the observations: a policy that ignores them finds the treasure with probability about
(1 / CELLS) ** 3. Every turn needs the same skill, so what reinforcement learning improves on one
turn it improves on all of them, and a small gain per turn compounds over the trail: this is the
task of the CPU example (`guess_number`, whose deep decisions are each visited by one secret in
63, stalls there: BENCHMARKS.md). Tasks come from `tasks(seed)` or from a file whose rows give a
`prompt` and a `trail` (`data/treasure_hunt.jsonl`, the stream's first tasks, written by
`scripts/make_treasure_hunt_tasks.py`); both are built by `task_from_reference`.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from venusrl.envs.environment import Environment, SandboxVerbs, Task, Tool
from venusrl.envs.types import MiB, TemplateSpec
from venusrl.model.tool_calls import format_tool_call

TASK_FILE = Path(__file__).with_name("data") / "treasure_hunt.jsonl"
TASK_FILE_SEED, TASK_FILE_ROWS = 20261204, 128  # its rows are the first of tasks(TASK_FILE_SEED)
CELLS = 63
MIN_CELLS, MAX_CELLS = 4, 7  # cells on a trail, the treasure's included
SLACK = 1  # opens beyond the trail's length: room for one wrong cell
# The demonstrator's slip rate. Its demonstrations are deliberately poor (at 0.3 about half of its
# episodes lose: two slips use more than the slack), so the warm start imitates a careless policy
# and the reward RL adds is its own, not imitation's (a perfect demonstrator would leave RL only
# the imitation's errors to fix).
SLIP = 0.3

# Runs in the sandbox's interpreter. The model has no code tool here, so it cannot read `trail`.
_SETUP = f"""
CELLS = {CELLS}
trail = []  # the task's setup sets it: the cells in order, the treasure's last
opens_left = 0
found = False


def open_cell(cell):
    global opens_left, found
    if not 1 <= cell <= CELLS:
        raise ValueError(f"cell must be between 1 and {{CELLS}}, got {{cell}}")
    if opens_left <= 0:
        raise ValueError("no opens left")
    opens_left -= 1
    if cell == trail[-1]:
        found = True
        return f"treasure: cell {{cell}} holds the treasure"
    if cell in trail:
        return f"clue: cell {{cell}} says the next clue is in cell {{trail[trail.index(cell) + 1]}}"
    return f"empty: cell {{cell}} is empty"
"""

_ANSWERS = ("treasure:", "clue:", "empty:")


class TreasureHunt(Environment):
    name = "treasure_hunt"
    template = TemplateSpec(name="treasure-hunt", setup=_SETUP, declared_memory_bytes=256 * MiB)
    instructions = "You are a helpful assistant that solves tasks by calling tools."
    tools = (
        Tool(
            "open_cell",
            "Open a cell. It holds a clue naming another cell, the treasure, or nothing.",
            {
                "type": "object",
                "properties": {"cell": {"type": "integer", "description": f"from 1 to {CELLS}"}},
                "required": ["cell"],
            },
        ),
    )
    max_turns = MAX_CELLS + SLACK + 1  # every open in its own turn, and one malformed turn
    reference_fields = ("trail",)  # a task file's: the cells in order, the treasure's last
    optional_fields = ("opens",)  # default: the trail's length and SLACK

    def __init__(self, task: Task, sandbox: SandboxVerbs) -> None:
        super().__init__(task, sandbox)
        self.opens_left = int(task.reference["opens"])

    def ended(self, answers: list[str]) -> bool:
        """Found, or out of opens: nothing the model does next can change the reward. (The answers
        are the sandbox's own text, never the model's.)"""
        self.opens_left -= sum(a.startswith(_ANSWERS) for a in answers)
        return self.opens_left <= 0 or any(a.startswith("treasure:") for a in answers)

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        for index in itertools.count():
            trail = rng.sample(range(1, CELLS + 1), rng.randint(MIN_CELLS, MAX_CELLS))
            prompt = hunt_prompt(trail[0], len(trail) + SLACK)
            yield cls.task_from_reference(f"hunt-{seed}-{index}", prompt, {"trail": trail})

    @classmethod
    def task_from_reference(cls, task_id: str, prompt: str, reference: Mapping[str, Any]) -> Task:
        trail = list(reference["trail"])
        opens = int(reference.get("opens", len(trail) + SLACK))
        return Task(
            task_id,
            prompt,
            setup=f"trail = {trail}\nopens_left = {opens}",
            reference={"trail": trail, "opens": opens},
        )

    @classmethod
    def reference_problem(cls, reference: Mapping[str, Any]) -> str | None:
        """A trail that `tasks(seed)` could have drawn (so the turn cap and the slack fit it),
        and opens enough to walk it."""
        trail = reference["trail"]
        if not isinstance(trail, list) or not all(_is_int(c) for c in trail):
            return f"the trail must be a list of cell numbers, got {trail!r}"
        if not MIN_CELLS <= len(trail) <= MAX_CELLS:
            return f"the trail must hold {MIN_CELLS} to {MAX_CELLS} cells, got {len(trail)}"
        outside = [c for c in trail if not 1 <= c <= CELLS]
        if outside:
            return f"the trail's cell {outside[0]} is not between 1 and {CELLS}"
        twice = [c for i, c in enumerate(trail) if c in trail[:i]]
        if twice:
            return f"the trail holds cell {twice[0]} twice; its cells must be distinct"
        opens = reference.get("opens", len(trail) + SLACK)
        if not _is_int(opens) or not len(trail) <= opens <= MAX_CELLS + SLACK:
            return (
                f"opens must be an integer from the trail's length ({len(trail)}) to"
                f" {MAX_CELLS + SLACK} (the turn cap leaves room for no more), got {opens!r}"
            )
        return None

    @classmethod
    def demonstrator(cls, task: Task, seed: int) -> TrailFollower:
        return TrailFollower(int(task.reference["trail"][0]), random.Random(seed), slip=SLIP)

    async def reward(self) -> float:
        return await self.flag_reward("found")


def hunt_prompt(first_cell: int, opens: int) -> str:
    return (
        f"A treasure is hidden in one of {CELLS} cells. Start by opening cell {first_cell}: each"
        f" clue names the next cell to open. You may open {opens} cells."
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def open_call(cell: int) -> str:
    return format_tool_call("open_cell", {"cell": cell})


class TrailFollower:
    """A scripted policy that opens the first cell, then the cell each clue names. With
    probability `slip` per clue it copies the wrong number from it, the cell it is reading
    instead of the one it names (which opens that cell again and reads the same clue: room to
    recover within the slack). It is called with each observation, the first time with none (the
    prompt is its task's)."""

    _CLUE = re.compile(r"clue: cell (\d+) says the next clue is in cell (\d+)")

    def __init__(self, first_cell: int, rng: random.Random, slip: float = 0.0) -> None:
        self.named = first_cell
        self.rng = rng
        self.slip = slip

    def __call__(self, observation: str) -> str:
        clue = self._CLUE.search(observation)
        if clue is None:
            return open_call(self.named)  # the first turn, or a cell that was empty: try again
        reading, self.named = int(clue.group(1)), int(clue.group(2))
        return open_call(reading if self.rng.random() < self.slip else self.named)
