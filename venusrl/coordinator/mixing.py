"""Several environments in one run (multi-task agentic RL): which environment each group draws.

Each environment of the mix has a weight, a group size K and optionally its own turn cap. Groups
draw their environment at random in proportion to the weights, from one seeded stream, so a
resumed run that skips the tasks it already trained on sees the same sequence again. An
environment plays the tasks of a file when its share has them (`rollout.tasks`), else its own
`tasks(seed)`.
"""

from __future__ import annotations

import random
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass

from venusrl.envs.environment import Environment, Task
from venusrl.envs.task_file import looped_tasks


@dataclass(frozen=True)
class EnvShare:
    env: type[Environment]
    weight: float
    group_size: int
    max_turns: int | None = None  # None: the environment's own cap
    tasks: tuple[Task, ...] | None = None  # a task file's, played in epochs; None: env.tasks

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"{self.env.name}: a mix weight must be > 0, got {self.weight}")
        if self.group_size < 2:
            raise ValueError(f"{self.env.name}: a group needs K >= 2, got {self.group_size}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"{self.env.name}: max_turns must be >= 1, got {self.max_turns}")
        if self.tasks is not None and not self.tasks:
            raise ValueError(f"{self.env.name}: a task file must hold a task")

    def environment(self) -> type[Environment]:
        """The environment class with this share's turn cap."""
        if self.max_turns is None or self.max_turns == self.env.max_turns:
            return self.env
        # A subclass, not a changed class attribute: two shares of one environment may differ.
        return type(self.env.__name__, (self.env,), {"max_turns": self.max_turns})


@dataclass(frozen=True)
class GroupTask:
    """One group's work: the environment its K members play and the task they share."""

    env: type[Environment]
    task: Task
    group_size: int


def mixed_tasks(
    mix: Sequence[EnvShare], seed: int, skip: Container[str] = ()
) -> Iterator[GroupTask]:
    """An endless stream of group tasks drawn from `mix`; tasks whose `task_key` is in `skip`
    (trained on before a resume) are drawn but not yielded."""
    if not mix:
        raise ValueError("an environment mix needs at least one environment")
    names = [share.env.name for share in mix]
    if len(set(names)) != len(names):
        raise ValueError(f"an environment appears twice in the mix: {names}")
    rng = random.Random(seed)
    streams = [task_stream(share, seed) for share in mix]
    envs = [share.environment() for share in mix]
    weights = [share.weight for share in mix]
    drawn: set[str] = set()
    while True:
        i = rng.choices(range(len(mix)), weights)[0] if len(mix) > 1 else 0
        task = next(streams[i])
        key = task_key(names[i], task.id)
        # A resume skips the tasks it trained on: an id drawn twice would be skipped for ever.
        if key in drawn:
            raise ValueError(f"{names[i]}: task id {task.id!r} came twice; ids must be unique")
        drawn.add(key)
        if key not in skip:
            yield GroupTask(envs[i], task, mix[i].group_size)


def task_key(env: str, task_id: str) -> str:
    """A task's name in a run: ids are unique within one environment's stream, not across a
    mix (a subclass of an environment draws the same ids)."""
    return f"{env}/{task_id}"


def task_stream(share: EnvShare, seed: int) -> Iterator[Task]:
    """The share's task file in epochs, or its environment's `tasks(seed)`."""
    if share.tasks is not None:
        return looped_tasks(share.tasks, seed)
    return _checked_tasks(share.env, seed)


def _checked_tasks(env: type[Environment], seed: int) -> Iterator[Task]:
    """`env.tasks(seed)`, checked as it is drawn: tasks, and no end."""
    for task in env.tasks(seed):
        if not isinstance(task, Task):
            raise ValueError(f"{env.name}: tasks(seed) yielded {type(task).__name__}, not a Task")
        yield task
    raise ValueError(f"{env.name}: tasks(seed) ended; it must be an endless stream")
