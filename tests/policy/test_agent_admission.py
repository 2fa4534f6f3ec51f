"""Agent-level admission control: Concur's congestion window on cache signals, and our first
window on the starts of trajectories."""

from __future__ import annotations

import pytest

from venusrl.policy.agent_admission import AimdAdmission, CacheSignal, ConcurAdmission

HEALTHY = CacheSignal(occupancy=0.5, reprefill_tokens=0)


def test_the_window_grows_by_a_constant_while_the_cache_is_healthy() -> None:
    policy = AimdAdmission(initial_window=8, increase=2)
    assert policy.next_window(8, HEALTHY, active=8) == 10
    assert policy.next_window(policy.max_window, HEALTHY, active=8) == policy.max_window


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
    assert policy.next_window(40, signal, active=40) == 20
    assert policy.next_window(3, signal, active=3) == 2  # never below the floor


def test_a_trajectory_starts_only_below_the_window() -> None:
    policy = AimdAdmission()
    assert policy.admits(active=7, window=8)
    assert not policy.admits(active=8, window=8)


def test_bad_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="decrease"):
        AimdAdmission(decrease=1.0)
    with pytest.raises(ValueError, match="min_window"):
        AimdAdmission(initial_window=0)


def concur_signal(occupancy: float, hit_rate: float = 1.0) -> CacheSignal:
    reusable = 10_000
    return CacheSignal(occupancy, round((1 - hit_rate) * reusable), reusable)


def test_concur_admits_fewer_agents_when_occupancy_crosses_its_threshold_more_once_clear() -> None:
    policy = ConcurAdmission(initial_window=8, low_water=0.85, high_water=0.95)
    window, active = 40, 40  # the window binds: as many agents active as it admits
    window = policy.next_window(window, concur_signal(0.97), active)
    assert window == 20 and not policy.admits(active=20, window=window)
    active = 20  # the agents over the window were paused at their turn boundaries
    # Near saturation and healthy: it holds.
    assert policy.next_window(window, concur_signal(0.9), active) == 20
    # Clear: one more agent a period, while the window binds.
    window = policy.next_window(window, concur_signal(0.6), active)
    assert window == 21 and policy.admits(active=20, window=window)
    assert policy.next_window(window, concur_signal(0.6), active=20) == 21  # not binding: holds


def test_concur_halves_what_is_in_use_when_returning_context_is_lost() -> None:
    policy = ConcurAdmission(min_window=2, hit_floor=0.95)
    assert concur_signal(0.5, hit_rate=0.9).hit_rate == pytest.approx(0.9)
    # Thrashing below the occupancy threshold still cuts, from the agents active (RFC 7661).
    assert policy.next_window(64, concur_signal(0.5, hit_rate=0.9), active=30) == 15
    assert policy.next_window(3, concur_signal(0.5, hit_rate=0.5), active=3) == 2  # the floor
    assert policy.next_window(30, concur_signal(0.5, hit_rate=0.96), active=30) == 31
    assert CacheSignal(0.5, 0).hit_rate == 1.0  # nothing reusable: nothing lost


def test_concur_refuses_an_inverted_occupancy_band() -> None:
    with pytest.raises(ValueError, match="low_water <= high_water"):
        ConcurAdmission(low_water=0.96, high_water=0.95)
