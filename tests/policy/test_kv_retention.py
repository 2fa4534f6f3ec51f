"""Which idle KV leaves the device first, and whether it is dropped or offloaded."""

from __future__ import annotations

from venusrl.policy.critical_groups import BEST_EFFORT, HIGH
from venusrl.policy.kv_retention import IdleKV, LruRetention, TrajectoryRetention, eviction_order


def kv(key: str, priority: int = HIGH, last_use: float = 0.0, pin: float | None = None,
       finished: bool = False) -> IdleKV:  # fmt: skip
    return IdleKV(key, 1000, priority, last_use, pin, finished)


def test_lru_evicts_the_least_recently_used_and_always_drops() -> None:
    idle = [kv("new", last_use=5.0, pin=100.0), kv("old", last_use=1.0), kv("mid", last_use=3.0)]
    policy = LruRetention()
    assert [e.key for e in eviction_order(policy, idle, now=6.0)] == ["old", "mid", "new"]
    assert not any(policy.offload(e, now=6.0) for e in idle)


def test_tool_waiting_high_priority_kv_leaves_last_and_is_offloaded_not_dropped() -> None:
    now = 10.0
    idle = [
        kv("pinned-high", HIGH, last_use=1.0, pin=now + 5),  # oldest, but its owner returns soon
        kv("expired-high", HIGH, last_use=8.0, pin=now - 1),
        kv("pinned-low", BEST_EFFORT, last_use=9.0, pin=now + 5),
        kv("low", BEST_EFFORT, last_use=9.5),
        kv("finished", HIGH, last_use=9.9, finished=True),
    ]
    policy = TrajectoryRetention()
    order = [e.key for e in eviction_order(policy, idle, now)]
    assert order == ["finished", "low", "pinned-low", "expired-high", "pinned-high"]
    by_key = {e.key: e for e in idle}
    assert policy.offload(by_key["pinned-high"], now)
    assert not policy.offload(by_key["finished"], now)  # nobody reads it again


def test_among_pinned_kv_the_owner_due_back_last_leaves_first() -> None:
    idle = [kv("soon", pin=11.0), kv("late", pin=30.0)]
    order = eviction_order(TrajectoryRetention(), idle, now=10.0)
    assert [e.key for e in order] == ["late", "soon"]


def test_only_pinned_high_priority_kv_is_reserved_from_best_effort_work() -> None:
    policy, now = TrajectoryRetention(), 10.0
    assert policy.reserved(kv("pinned-high", priority=1, pin=20.0), now)
    assert not policy.reserved(kv("expired", priority=1, pin=5.0), now)
    assert not policy.reserved(kv("pinned-low", priority=0, pin=20.0), now)
    assert not policy.reserved(kv("finished", priority=1, pin=20.0, finished=True), now)
    assert not LruRetention().reserved(kv("pinned-high", priority=1, pin=20.0), now)
