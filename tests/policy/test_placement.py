"""Placement across engines and nodes: least-loaded engines, a group whole on one worker."""

from __future__ import annotations

import pytest

from venusrl.policy.placement import least_loaded, place_group


def test_least_loaded_breaks_ties_by_index_and_needs_an_engine_up() -> None:
    assert least_loaded([3, 1, 1]) == 1
    assert least_loaded([3, 1, 1], up={0, 2}) == 2
    with pytest.raises(ValueError, match="no engine is up"):
        least_loaded([0, 0], up=set())


def test_a_new_group_goes_to_the_least_loaded_worker_then_the_one_with_the_most_room() -> None:
    assert place_group([8, 2, 5], [9, 1, 9]) == 1
    assert place_group([2, 2, 2], [5, 9, 9]) == 1  # equal loads: the most room, lowest index


def test_a_worker_with_no_memory_left_takes_a_group_only_when_every_worker_is_full() -> None:
    assert place_group([0, 8], [0, 1 << 20]) == 1
    assert place_group([0, 8], [-5, -1]) == 0  # all full: the least loaded still


def test_placing_a_group_needs_one_load_and_one_room_per_worker() -> None:
    with pytest.raises(ValueError):
        place_group([], [])
    with pytest.raises(ValueError):
        place_group([0, 1], [5])
