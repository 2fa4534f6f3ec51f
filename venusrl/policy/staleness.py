"""Bounded staleness: when a new group may start, and which complete groups form a batch.

Pure policy (DESIGN.md contract 1), after AReaL's staleness manager. Groups are numbered in the
order they start; the trainer consumes batches of B groups, batch b taking weights from version b
to b + 1. A group's tokens are produced with weights of at least the version current when it
starts, v. Starting is bounded by counting (AReaL's rule):

    n // B  <=  v + max_staleness

That alone does not bound a group's staleness when batches take groups in the order they
complete: a slow group started at v can be overtaken by groups started later and land in batch
v + 2 (measured: 2 versions behind with max_staleness=1). So each group has a deadline, the
version `started + max_train_staleness` by which it must be trained, and a batch takes, earliest
deadline first, as many groups as the deadlines of the coming batches force it to, waiting for
those still running (the critical-group ranking runs *due* groups first); its other places go to
complete groups in completion order, so the batch waits for a slow group only when it must.

`max_train_staleness` defaults to `max_staleness`: no group is trained further behind than the
start bound lets any group run ahead. A larger one lets a straggler (a group whose tools hang for
minutes) be overtaken: the batches take later complete groups in its place and train it when it
completes, at most `max_train_staleness` versions after it started, instead of holding every batch
for it. Its tokens are then that much staler; the trainer's importance ratio corrects them.

A straggler still counts among the started groups after batches took later groups in its place,
so under the start bound it holds one of the next batch's places until it completes: that batch
cannot complete before new weights let one more group start (every step of the CPU example's
`venusrl train` waited for exactly that group; BENCHMARKS.md 2026-12-06 (6)). With
`release_overtaken` a group gives its place back once a group started after it has been
trained: the straggler runs beside the pipeline, still trained within `max_train_staleness`, and
its replacement starts at once. At most (max_train_staleness - max_staleness) x B places are given
back, so the groups started by any version still fit the batches up to their deadlines (with no
slack in the train bound it gives none back). More groups are then in flight and the mean
staleness rises; it is off by default, as AReaL counts.

`max_staleness = 0` is synchronous on-policy training: only the groups of the batch the trainer is
waiting for may run. Each token also records the version that produced it, and the trainer
corrects what is stale with the behaviour logprobs (PPO-style importance ratio).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessBound:
    batch_groups: int
    max_staleness: int = 1
    max_train_staleness: int | None = None  # None: max_staleness
    release_overtaken: bool = False  # an overtaken group stops counting against the start bound

    def __post_init__(self) -> None:
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_train_staleness is not None and self.max_train_staleness < self.max_staleness:
            raise ValueError(
                f"max_train_staleness must be >= max_staleness ({self.max_staleness}), got"
                f" {self.max_train_staleness}: a group may run that far ahead, so it is at least"
                " that stale when trained"
            )

    @property
    def lag(self) -> int:
        """How many versions after it started a group must be trained."""
        return self.max_staleness if self.max_train_staleness is None else self.max_train_staleness

    def may_start(self, started_groups: int, weight_version: int) -> bool:
        """May group number `started_groups` (0-based) start while weights are at this version?"""
        return started_groups // self.batch_groups <= weight_version + self.max_staleness

    def startable(self, started_groups: int, weight_version: int, overtaken: int = 0) -> int:
        """How many more groups may start now; `overtaken`: of the started groups, those still
        running after a group started later was trained (not counted with
        `release_overtaken`)."""
        if self.release_overtaken:
            started_groups -= min(overtaken, (self.lag - self.max_staleness) * self.batch_groups)
        limit = (weight_version + self.max_staleness + 1) * self.batch_groups
        return max(limit - started_groups, 0)

    def due(self, started_version: int, weight_version: int) -> bool:
        """Must a group started at `started_version` be in the batch trained at this version?"""
        return started_version + self.lag <= weight_version

    def batch(
        self, ready: Sequence[int], running: Sequence[int], weight_version: int
    ) -> list[int] | None:
        """The batch to train at `weight_version`, as indexes into `ready` (the started versions
        of the complete groups, in completion order), or None to wait for more groups.
        `running`: the started versions of the groups still running."""
        b, v = self.batch_groups, weight_version
        if len(ready) < b:
            return None
        deadlines = [s + self.lag for s in (*ready, *running)]
        # Batches v .. v+j hold (j+1)B groups; every group due by v+j must be among them, so this
        # batch must take at least (groups due by v+j) - jB of them, for every j.
        must = max(sum(d <= v + j for d in deadlines) - j * b for j in range(self.lag + 1))
        must = min(b, max(must, 0))
        # Earliest deadline first covers every j at once; at equal deadlines a complete group
        # goes before a running one, so the batch waits only when it has to.
        candidates = sorted(
            [(s + self.lag, False, i) for i, s in enumerate(ready)]
            + [(s + self.lag, True, -1) for s in running]
        )[:must]
        if any(is_running for _, is_running, _ in candidates):
            return None  # a group this batch must take is still running
        chosen = [i for _, _, i in candidates]
        taken = set(chosen)
        return chosen + [i for i in range(len(ready)) if i not in taken][: b - must]
