"""A step's line of `metrics.jsonl`: the batch's rewards, staleness, failures and timings, the
trainer's figures, and what the engine and the sandbox pool did meanwhile."""

from __future__ import annotations

from collections import Counter
from typing import Any

from venusrl.coordinator.admission import AdmissionWindow, TurnWindow
from venusrl.coordinator.coordinator import GroupResult
from venusrl.sim.report import quantile
from venusrl.types import Trajectory


def won(traj: Trajectory) -> bool:
    """A win, as training (`wins`) and `venusrl eval` count one: scored, reward > 0."""
    return traj.reward is not None and traj.reward > 0


def admission_metrics(window: AdmissionWindow | TurnWindow | None) -> dict[str, int]:
    """The window's state when a step ends (nothing without `rollout.admission`)."""
    if window is None:
        return {}
    if isinstance(window, TurnWindow):
        return {
            "window_kv_tokens": window.load,
            "episodes_active": window.members,
            "episodes_held_back": len(window.waiting),
            **window.book.counters(),
        }
    return {
        "admission_window": window.window,
        "episodes_active": window.active,
        "episodes_held_back": window.waiting,
        "window_waits": window.waits,
    }


def reward_wait_s(batch: list[GroupResult], waited_from: float, waited_to: float) -> float:
    """How long of the trainer's wait for `batch` (from `waited_from` to `waited_to`,
    `time.monotonic()`) came after every one of its episodes had ended its turns: a wait on
    rewards alone."""
    if not batch:
        return 0.0
    rolled_out = max(g.rolled_out_at for g in batch)
    completed = max(g.completed_at for g in batch)
    return max(min(waited_to, completed) - max(waited_from, rolled_out), 0.0)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def step_metrics(
    step: int,
    batch: list[GroupResult],
    version: int,
    wall_s: float,
    extra: dict[str, Any],
    by_env: bool = False,
) -> dict[str, Any]:
    """The `metrics.jsonl` line of a step; `by_env` adds each environment's mean reward and group
    count (a mixed run)."""
    trajectories = [t for g in batch for t in g.trajectories]
    scored = [t.reward for t in trajectories if t.reward is not None]
    wins = [t for t in trajectories if won(t)]
    model_versions = [v for t in trajectories for v, m in zip(t.versions, t.mask, strict=True) if m]
    durations = sorted(g.duration_s for g in batch)
    reward_s = sorted(t.reward_s for t in trajectories if t.reward_s is not None)
    return {
        "step": step,
        "reward_mean": sum(scored) / len(scored) if scored else None,
        "weight_version": version,
        "staleness_mean": (
            sum(version - 1 - v for v in model_versions) / len(model_versions)
            if model_versions
            else 0.0
        ),
        "staleness_max": max((version - 1 - v for v in model_versions), default=0),
        # Weight versions that sampled one trajectory's tokens: more than 1 when it ran across
        # a publish (every token keeps the version that sampled it).
        "versions_per_trajectory_max": max((_versions(t) for t in trajectories), default=0),
        "groups": len(batch),
        "group_s": [round(d, 3) for d in durations],  # open to last member's end, sorted
        "infra_failures": sum(g.infra_failures for g in batch),
        "env_failures": sum(g.env_failures for g in batch),  # of them, the environment's bugs
        "masked": sum(g.masked for g in batch),
        # From a trajectory's last turn to its reward (the reward workers' queue and scoring).
        "reward_p50_s": _rounded(quantile(reward_s, 0.5)),
        "reward_p95_s": _rounded(quantile(reward_s, 0.95)),
        "tool_calls_mean": sum(t.tool_calls for t in trajectories) / max(len(trajectories), 1),
        # How the batch's episodes ended: done, turn_cap, context_cap, time_cap, token_cap, infra.
        "finishes": dict(Counter(str(t.finish) for t in trajectories)),
        "wins": len(wins),
        "tool_calls_per_win": sum(t.tool_calls for t in wins) / len(wins) if wins else None,
        "wall_s": wall_s,
        **extra,
        **({"by_env": _by_env(batch)} if by_env else {}),
    }


def _versions(traj: Trajectory) -> int:
    return len({v for v, m in zip(traj.versions, traj.mask, strict=True) if m})


def since(before: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """Counters from `before` to `now` (a counter `before` lacks counts from zero)."""
    return {k: v - before.get(k, 0) for k, v in now.items()}


def _by_env(batch: list[GroupResult]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({g.env for g in batch}):
        groups = [g for g in batch if g.env == name]
        scored = [t.reward for g in groups for t in g.trajectories if t.reward is not None]
        out[name] = {
            "groups": len(groups),
            "reward_mean": sum(scored) / len(scored) if scored else None,
        }
    return out
