"""Bounded staleness: when a new group may start.

Pure policy (DESIGN.md contract 1), after AReaL's staleness manager. Groups are numbered in the
order they start; group n lands in trainer batch b = n // B, which the trainer consumes to go from
weight version b to b + 1. Its tokens are produced with weights of at least the version current
when it starts, v. For the batch to be at most `max_staleness` versions behind when it is trained:

    n // B  <=  v + max_staleness

`max_staleness = 0` is synchronous on-policy training: only the groups of the batch the trainer is
waiting for may run. Each token also records the version that produced it, and the trainer
corrects what is stale with the behaviour logprobs (PPO-style importance ratio).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessBound:
    batch_groups: int
    max_staleness: int = 1

    def __post_init__(self) -> None:
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def may_start(self, started_groups: int, weight_version: int) -> bool:
        """May group number `started_groups` (0-based) start while weights are at this version?"""
        return started_groups // self.batch_groups <= weight_version + self.max_staleness

    def startable(self, started_groups: int, weight_version: int) -> int:
        """How many more groups may start now."""
        limit = (weight_version + self.max_staleness + 1) * self.batch_groups
        return max(limit - started_groups, 0)
