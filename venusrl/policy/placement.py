"""Where work goes when a run has several rollout engines and several sandbox pools.

Pure. The Ray runtime (`venusrl.runtime.cluster`) places whole groups (`place_group`); the
simulator routes each new trajectory to the least loaded engine (`least_loaded`), as its members
share no prompt KV there.

- A trajectory never moves: every turn goes to the engine that holds its KV (moving it would
  mean prefilling its whole context again).
- On a cluster a group is placed whole, on one rollout worker: its K sandboxes fork there from
  one warm zygote and share its pages, and its K trajectories share the engine's cached prompt.
  A new group goes to the worker that holds the fewest open groups (the engine's load to come:
  groups are counted from the moment they open, so that groups opened together spread out),
  among those with memory left to admit sandboxes into.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def least_loaded(loads: Sequence[int], up: Collection[int] | None = None) -> int:
    """The index of the smallest load among the engines that are up (ties: the lowest index)."""
    candidates = [i for i in range(len(loads)) if up is None or i in up]
    if not candidates:
        raise ValueError("no engine is up")
    return min(candidates, key=lambda i: (loads[i], i))


def place_group(loads: Sequence[int], free_bytes: Sequence[int]) -> int:
    """The worker a new group goes to: among those with memory left to admit into (every one,
    when none has), the one with the smallest load; ties: the most room, then the lowest index,
    so that placement is reproducible."""
    if not loads or len(loads) != len(free_bytes):
        raise ValueError(f"need one load and one room per worker, got {loads} and {free_bytes}")
    roomy = [i for i in range(len(loads)) if free_bytes[i] > 0] or range(len(loads))
    return min(roomy, key=lambda i: (loads[i], -free_bytes[i], i))
