import pytest

from intervaltools import coverage, gaps, intersect, merge


def test_merge_overlapping():
    assert merge([(1, 3), (2, 6), (8, 10)]) == [(1, 6), (8, 10)]


def test_merge_sorts_first():
    assert merge([(8, 10), (1, 2)]) == [(1, 2), (8, 10)]


def test_merge_nested():
    assert merge([(1, 10), (2, 3)]) == [(1, 10)]


def test_merge_empty():
    assert merge([]) == []


def test_reversed_interval_is_an_error():
    with pytest.raises(ValueError):
        merge([(3, 1)])


def test_intersect():
    assert intersect([(1, 5), (8, 12)], [(4, 9)]) == [(4, 5), (8, 9)]


def test_intersect_disjoint():
    assert intersect([(1, 2)], [(3, 4)]) == []


def test_coverage_counts_overlaps_once():
    assert coverage([(0, 4), (2, 6)]) == 6


def test_gaps():
    assert gaps([(2, 3), (5, 6)], 0, 10) == [(0, 2), (3, 5), (6, 10)]
