"""Where work goes when a run has several rollout engines and several sandbox pools.

Pure: the Ray runtime (`venusrl.runtime.cluster`) and the simulator call the same functions.

- Trajectories are sticky: every turn after the first goes to the engine that holds the
  trajectory's KV (moving it would mean prefilling its whole context again); a new trajectory
  goes to the engine with the fewest active trajectories.
- A group's K sandboxes live on one node, so that they fork from one warm zygote and share its
  pages; a new group goes to the node with the most memory left to admit sandboxes into.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def least_loaded(loads: Sequence[int], up: Collection[int] | None = None) -> int:
    """The index of the smallest load among the engines that are up (ties: the lowest index)."""
    candidates = [i for i in range(len(loads)) if up is None or i in up]
    if not candidates:
        raise ValueError("no engine is up")
    return min(candidates, key=lambda i: (loads[i], i))


def most_room(free_bytes: Sequence[int]) -> int:
    """The node a new group goes to: the one with the most admissible memory (ties: the lowest
    index, so that placement is reproducible)."""
    if not free_bytes:
        raise ValueError("no sandbox pool to place a group on")
    return min(range(len(free_bytes)), key=lambda i: (-free_bytes[i], i))


class StickyRouter:
    """Engine per trajectory: least loaded for its first turn, the same one after that."""

    def __init__(self, engines: int) -> None:
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        self.active = [0] * engines  # trajectories routed and not yet ended, per engine
        self._engine_of: dict[str, int] = {}

    def route(self, trajectory_id: str, up: Collection[int] | None = None) -> int:
        """The engine of the trajectory's next turn. A trajectory already routed stays where it
        is, even if that engine is not in `up`: the caller decides what a lost engine means."""
        engine = self._engine_of.get(trajectory_id)
        if engine is None:
            engine = least_loaded(self.active, up)
            self._engine_of[trajectory_id] = engine
            self.active[engine] += 1
        return engine

    def engine_of(self, trajectory_id: str) -> int | None:
        return self._engine_of.get(trajectory_id)

    def end(self, trajectory_id: str) -> None:
        engine = self._engine_of.pop(trajectory_id, None)
        if engine is not None:
            self.active[engine] -= 1
