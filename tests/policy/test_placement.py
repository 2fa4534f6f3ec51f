"""Routing and placement across engines and nodes: sticky trajectories, least-loaded engines,
groups to the node with the most room."""

from __future__ import annotations

import pytest

from venusrl.policy.placement import StickyRouter, least_loaded, most_room


def test_a_trajectory_stays_on_the_engine_of_its_first_turn() -> None:
    router = StickyRouter(3)
    first = {tid: router.route(tid) for tid in ("a", "b", "c")}
    assert sorted(first.values()) == [0, 1, 2]  # spread: each went to the least loaded
    for _ in range(3):
        assert {tid: router.route(tid) for tid in first} == first
    assert router.active == [1, 1, 1]


def test_new_trajectories_go_to_the_least_loaded_engine_that_is_up() -> None:
    router = StickyRouter(3)
    for tid in ("a", "b", "c", "d"):
        router.route(tid)
    assert router.active == [2, 1, 1]
    router.end("a")
    router.end("b")
    assert router.active == [1, 0, 1]
    assert router.route("e", up={0, 2}) == 0  # engine 1 is down: the lowest-loaded of the rest
    # A trajectory routed before its engine went down still names it: the caller decides.
    assert router.route("c", up={0}) == router.engine_of("c") == 2


def test_ending_an_unknown_trajectory_changes_nothing() -> None:
    router = StickyRouter(2)
    router.route("a")
    router.end("zzz")
    assert router.active == [1, 0]


def test_least_loaded_breaks_ties_by_index_and_needs_an_engine_up() -> None:
    assert least_loaded([3, 1, 1]) == 1
    assert least_loaded([3, 1, 1], up={0, 2}) == 2
    with pytest.raises(ValueError, match="no engine is up"):
        least_loaded([0, 0], up=set())


def test_a_new_group_goes_to_the_node_with_the_most_room() -> None:
    assert most_room([5, 9, 9, 2]) == 1
    assert most_room([-1, 0]) == 1
    with pytest.raises(ValueError):
        most_room([])
