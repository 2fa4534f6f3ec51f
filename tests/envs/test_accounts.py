"""A fleet's pools read as one pool in the step metrics."""

from __future__ import annotations

import dataclasses

import pytest

from venusrl.envs.accounts import PoolStats

ONE = PoolStats(
    wall_s=10.0,
    budget_bytes=4 << 30,
    sandboxes_created=2,
    sandboxes_running=1,
    mean_concurrent=1.5,
    sandbox_seconds=15.0,
    physical_gb_seconds=3.0,
    node_gb_seconds=40.0,
    peak_physical_bytes=1 << 30,
    mean_create_latency_s=0.1,
    mean_admission_wait_s=0.0,
    max_admission_wait_s=0.0,
    preemptions=1,
    oom_kills=0,
    seccomp=True,
)


def test_pools_merged_sum_their_totals_keep_their_peaks_and_weigh_their_means() -> None:
    other = dataclasses.replace(
        ONE,
        wall_s=12.0,
        sandboxes_created=6,
        peak_physical_bytes=2 << 30,
        mean_create_latency_s=0.5,
        max_admission_wait_s=2.0,
        oom_kills=1,
        seccomp=False,
    )
    merged = PoolStats.merge([ONE, other])
    assert merged.sandboxes_created == 8 and merged.sandboxes_running == 2
    assert merged.sandbox_seconds == 30.0 and merged.budget_bytes == 8 << 30
    assert merged.preemptions == 2 and merged.oom_kills == 1
    assert merged.wall_s == 12.0 and merged.peak_physical_bytes == 2 << 30
    assert merged.max_admission_wait_s == 2.0
    assert merged.mean_create_latency_s == pytest.approx((2 * 0.1 + 6 * 0.5) / 8)
    assert not merged.seccomp  # only where every pool has it
    assert PoolStats.merge([ONE]) == ONE


def test_merging_no_pools_is_refused() -> None:
    with pytest.raises(ValueError, match="no pool"):
        PoolStats.merge([])
