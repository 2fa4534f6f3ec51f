"""Closed numeric intervals."""

from intervaltools.ops import coverage, gaps, intersect, merge

__all__ = ["coverage", "gaps", "intersect", "merge"]
