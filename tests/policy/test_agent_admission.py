"""Agent-level admission control (the Concur-like baseline): a window on cache signals."""

from __future__ import annotations

import pytest

from venusrl.policy.agent_admission import AimdAdmission, CacheSignal

HEALTHY = CacheSignal(occupancy=0.5, reprefill_tokens=0)


def test_the_window_grows_by_a_constant_while_the_cache_is_healthy() -> None:
    policy = AimdAdmission(initial_window=8, increase=2)
    assert policy.next_window(8, HEALTHY) == 10
    assert policy.next_window(policy.max_window, HEALTHY) == policy.max_window


@pytest.mark.parametrize(
    "signal",
    [
        CacheSignal(occupancy=0.5, reprefill_tokens=1),
        CacheSignal(occupancy=0.99, reprefill_tokens=0),
    ],
    ids=["thrashing", "congested"],
)
def test_the_window_halves_when_the_cache_thrashes_or_is_full(signal: CacheSignal) -> None:
    policy = AimdAdmission(min_window=2)
    assert policy.next_window(40, signal) == 20
    assert policy.next_window(3, signal) == 2  # never below the floor


def test_a_trajectory_starts_only_below_the_window() -> None:
    policy = AimdAdmission()
    assert policy.admits(active=7, window=8)
    assert not policy.admits(active=8, window=8)


def test_bad_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="decrease"):
        AimdAdmission(decrease=1.0)
    with pytest.raises(ValueError, match="min_window"):
        AimdAdmission(initial_window=0)
