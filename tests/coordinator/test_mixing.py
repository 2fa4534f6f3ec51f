"""Several environments in one run: groups draw them by weight, each with its K and turn cap."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import pytest

from venusrl.coordinator.mixing import EnvShare, mixed_tasks, task_key
from venusrl.envs.builtin import GuessNumber, SweMini
from venusrl.envs.builtin.math_python import MathPython
from venusrl.envs.environment import Task


def draw(mix: list[EnvShare], n: int, seed: int = 0, skip: set[str] | None = None) -> list:
    return list(itertools.islice(mixed_tasks(mix, seed, skip or set()), n))


def test_groups_draw_environments_in_proportion_to_their_weights() -> None:
    mix = [EnvShare(GuessNumber, 3.0, 8), EnvShare(SweMini, 1.0, 4)]
    work = draw(mix, 4000)
    counts = Counter(w.env.name for w in work)
    assert counts["guess_number"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert {w.group_size for w in work if w.env.name == "swe_mini"} == {4}
    assert {w.group_size for w in work if w.env.name == "guess_number"} == {8}
    # Each environment's tasks come from its own stream, in order.
    guess_ids = [w.task.id for w in work if w.env.name == "guess_number"][:3]
    assert guess_ids == [t.id for t in itertools.islice(GuessNumber.tasks(0), 3)]


def test_the_same_seed_gives_the_same_sequence_and_skipped_tasks_are_left_out() -> None:
    mix = [EnvShare(GuessNumber, 1.0, 8), EnvShare(SweMini, 1.0, 4)]
    first = [task_key(w.env.name, w.task.id) for w in draw(mix, 50)]
    assert first == [task_key(w.env.name, w.task.id) for w in draw(mix, 50)]
    resumed = [task_key(w.env.name, w.task.id) for w in draw(mix, 40, skip=set(first[:10]))]
    assert resumed == first[10:50]  # a resumed run continues where the trained tasks end


def test_a_share_with_a_task_file_plays_its_tasks_in_epochs_and_a_resume_continues_there() -> None:
    file_tasks = tuple(Task(f"q{i}", f"{i} + 1?", reference={"answer": i + 1}) for i in range(5))
    mix = [EnvShare(MathPython, 1.0, 2, tasks=file_tasks), EnvShare(GuessNumber, 1.0, 2)]
    work = draw(mix, 60)
    from_file = [w.task.id for w in work if w.env is MathPython]
    assert len(from_file) > 10  # past the first epoch
    assert {i.partition("@")[0] for i in from_file} == {f"q{i}" for i in range(5)}  # not shipped
    assert sorted(from_file[:5]) == [f"q{i}@0" for i in range(5)]  # each once per epoch
    keys = [task_key(w.env.name, w.task.id) for w in work]
    resumed = [task_key(w.env.name, w.task.id) for w in draw(mix, 50, skip=set(keys[:10]))]
    assert resumed == keys[10:60]


def test_a_share_caps_turns_without_changing_the_environment_class() -> None:
    capped = EnvShare(GuessNumber, 1.0, 8, max_turns=3).environment()
    assert capped.max_turns == 3 and issubclass(capped, GuessNumber)
    assert capped.name == GuessNumber.name and GuessNumber.max_turns == 8
    assert EnvShare(GuessNumber, 1.0, 8).environment() is GuessNumber


@pytest.mark.parametrize(
    ("mix", "words"),
    [
        ([], "at least one environment"),
        ([EnvShare(GuessNumber, 1.0, 8), EnvShare(GuessNumber, 2.0, 4)], "appears twice"),
    ],
)
def test_a_bad_mix_is_refused(mix: list[EnvShare], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        draw(mix, 1)


def test_a_bad_share_is_refused_naming_the_environment() -> None:
    with pytest.raises(ValueError, match="guess_number: a mix weight"):
        EnvShare(GuessNumber, 0.0, 8)
    with pytest.raises(ValueError, match="K >= 2"):
        EnvShare(GuessNumber, 1.0, 1)


class Repeating(GuessNumber):
    """A task stream whose ids come round again (a dataset read twice, ids kept)."""

    name = "repeating"

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        return itertools.cycle(list(itertools.islice(GuessNumber.tasks(seed), 3)))


class Finite(GuessNumber):
    name = "finite"

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        return itertools.islice(GuessNumber.tasks(seed), 2)


class Dicts(GuessNumber):
    name = "dicts"

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        return iter([{"id": "a", "prompt": "p"}])  # type: ignore[list-item]


def test_a_task_stream_that_repeats_an_id_ends_or_yields_no_task_is_an_error_naming_it() -> None:
    # A resumed run skips the ids it trained on: a repeated id would be skipped for ever.
    with pytest.raises(ValueError, match="repeating: task id 'guess-0-0' came twice"):
        draw([EnvShare(Repeating, 1.0, 8)], 4)
    with pytest.raises(ValueError, match="finite: tasks\\(seed\\) ended"):
        draw([EnvShare(Finite, 1.0, 8)], 3)
    with pytest.raises(ValueError, match="dicts: tasks\\(seed\\) yielded dict, not a Task"):
        draw([EnvShare(Dicts, 1.0, 8)], 1)
    # Unique within an environment: a subclass of another draws the same ids, told apart.
    twin = type("Twin", (GuessNumber,), {"name": "twin"})
    work = draw([EnvShare(GuessNumber, 1.0, 8), EnvShare(twin, 1.0, 8)], 100)
    assert {w.env.name for w in work if w.task.id == "guess-0-0"} == {"guess_number", "twin"}
