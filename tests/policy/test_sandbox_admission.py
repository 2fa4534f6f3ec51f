"""Sandbox admission policies, as pure functions of a pool snapshot (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from venusrl.policy.sandbox_admission import (
    FootprintAdmission,
    PeakEstimator,
    PendingSandbox,
    PoolSnapshot,
    QuotaAdmission,
    RunningSandbox,
)

GiB = 1 << 30
MiB = 1 << 20


def pending(n: int, declared: int, template: str = "py", priority: int = 0) -> list[PendingSandbox]:
    return [PendingSandbox(f"p{i}", template, priority, i, declared) for i in range(n)]


@given(budget=st.integers(1 * GiB, 64 * GiB), declared=st.integers(256 * MiB, 8 * GiB))
def test_quota_mode_admits_exactly_budget_over_declared(budget: int, declared: int) -> None:
    want = budget // declared
    snap = PoolSnapshot(running=[], pending=pending(want + 3, declared), budget_bytes=budget)
    assert len(QuotaAdmission().decide(snap).admit) == want


# A workload: templates with a true peak footprint; each sandbox's footprint moves along a path
# that never exceeds its template's true peak.
templates = st.lists(st.integers(16 * MiB, 2 * GiB), min_size=1, max_size=4)


@settings(max_examples=100, deadline=None)
@given(
    true_peaks=templates,
    budget=st.integers(2 * GiB, 32 * GiB),
    arrivals=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=60),
    growth=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=20),
)
def test_conservative_estimates_never_let_the_pool_reach_its_limit(
    true_peaks: list[int], budget: int, arrivals: list, growth: list[float]
) -> None:
    policy = FootprintAdmission(safety_fraction=0.9, high_water_fraction=0.95)
    # Conservative: predictions are at least the true peaks (here: exactly them).
    peaks = {f"t{i}": p for i, p in enumerate(true_peaks)}
    queue = [
        PendingSandbox(f"r{i}", f"t{t % len(true_peaks)}", prio, i, 4 * GiB)
        for i, (t, prio) in enumerate(arrivals)
    ]
    running: list[RunningSandbox] = []
    ages: dict[str, int] = {}
    for tick in range(40):
        snap = PoolSnapshot(running, queue, budget, peaks)
        decision = policy.decide(snap)
        assert decision.preempt == ()  # nothing outgrew its prediction, so nothing is preempted
        admitted = {p.request_id for p in queue if p.request_id in decision.admit}
        running += [
            RunningSandbox(p.request_id, p.template, p.priority, tick, 0, p.declared_bytes)
            for p in queue
            if p.request_id in admitted
        ]
        queue = [p for p in queue if p.request_id not in admitted]
        # Every sandbox grows along its path, finishing after len(growth) ticks.
        grown = []
        for s in running:
            age = ages.get(s.sandbox_id, 0)
            if age >= len(growth):
                continue
            ages[s.sandbox_id] = age + 1
            footprint = int(peaks[s.template] * growth[age])
            grown.append(
                RunningSandbox(
                    s.sandbox_id, s.template, s.priority, s.started, footprint, s.declared_bytes
                )
            )
        running = grown
        assert sum(s.footprint_bytes for s in running) <= 0.9 * budget


def test_footprint_admission_fits_many_more_sandboxes_than_quota() -> None:
    snap = PoolSnapshot(
        running=[],
        pending=pending(100, 4 * GiB),
        budget_bytes=16 * GiB,
        peak_bytes={"py": 300 * MiB},
    )
    assert len(QuotaAdmission().decide(snap).admit) == 4
    assert len(FootprintAdmission().decide(snap).admit) == 49  # floor(0.9 * 16 GiB / 300 MiB)


def test_a_template_without_a_prediction_is_admitted_by_its_declaration() -> None:
    snap = PoolSnapshot(
        running=[], pending=pending(10, 4 * GiB, template="new"), budget_bytes=16 * GiB
    )
    assert len(FootprintAdmission().decide(snap).admit) == 3  # 0.9 * 16 / 4


def test_above_high_water_the_lowest_priority_newest_sandboxes_are_preempted() -> None:
    running = [
        RunningSandbox("old-low", "py", 0, 0, 3 * GiB, 4 * GiB),
        RunningSandbox("new-low", "py", 0, 5, 3 * GiB, 4 * GiB),
        RunningSandbox("high", "py", 9, 6, 4 * GiB, 4 * GiB),
    ]
    snap = PoolSnapshot(
        running, pending(2, 4 * GiB), budget_bytes=10 * GiB, peak_bytes={"py": 1 * GiB}
    )
    decision = FootprintAdmission(safety_fraction=0.9, high_water_fraction=0.95).decide(snap)
    assert decision.preempt == ("new-low",)  # 10 GiB used > 9.5 GiB; 7 GiB after one victim
    assert decision.admit == ()  # predictions proved wrong: admit nothing while preempting


def test_higher_priority_pending_sandboxes_are_admitted_first() -> None:
    queue = [PendingSandbox("low", "py", 0, 0, GiB), PendingSandbox("high", "py", 5, 1, GiB)]
    snap = PoolSnapshot([], queue, budget_bytes=2 * GiB, peak_bytes={"py": GiB})
    assert FootprintAdmission().decide(snap).admit == ("high",)


def test_bad_fractions_are_refused() -> None:
    with pytest.raises(ValueError, match="safety_fraction"):
        FootprintAdmission(safety_fraction=0.99, high_water_fraction=0.9)


def test_peak_estimator_predicts_only_after_enough_finished_sandboxes() -> None:
    est = PeakEstimator(min_samples=2, margin=0.25)
    est.observe_finished("py", 100 * MiB)
    assert est.predictions() == {}
    est.observe_finished("py", 200 * MiB)
    assert est.predictions() == {"py": 250 * MiB}


def test_peak_estimator_quantile_leaves_rare_spikes_to_the_headroom() -> None:
    est = PeakEstimator(min_samples=3, margin=0.0, quantile=0.9)
    for _ in range(19):
        est.observe_finished("py", 100 * MiB)
    est.observe_finished("py", 900 * MiB)  # one spike in twenty
    assert est.predictions() == {"py": 100 * MiB}
    assert PeakEstimator(margin=0.0).predictions() == {}
    est_max = PeakEstimator(margin=0.0)
    for p in (100, 100, 900):
        est_max.observe_finished("py", p * MiB)
    assert est_max.predictions() == {"py": 900 * MiB}


def test_peak_estimator_forgets_beyond_its_window() -> None:
    est = PeakEstimator(min_samples=1, margin=0.0, window=4)
    est.observe_finished("py", 900 * MiB)
    for _ in range(4):
        est.observe_finished("py", 100 * MiB)
    assert est.predictions() == {"py": 100 * MiB}
    with pytest.raises(ValueError, match="quantile"):
        PeakEstimator(quantile=0.0)
