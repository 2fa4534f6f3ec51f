"""The engine's scheduling policy, as a pure function of a snapshot."""

from __future__ import annotations

import dataclasses

from venusrl.policy.engine_schedule import EngineSnapshot, PriorityScheduler, RequestView


def view(
    rid: str,
    priority: int = 0,
    arrival: int = 0,
    computed: int = 0,
    todo: int = 1,
    held: int = 0,
    releasable: int = 0,
    key: object = None,
    in_flight: bool = False,
) -> RequestView:
    return RequestView(rid, priority, arrival, computed, todo, held, releasable, key, in_flight)


def snap(
    running: list[RequestView],
    waiting: list[RequestView],
    free: int,
    budget: int = 100,
    max_running: int = 8,
) -> EngineSnapshot:
    return EngineSnapshot(
        running, waiting, free, page_size=4, token_budget=budget, max_running=max_running
    )


def test_decodes_run_before_prefill_chunks_within_the_token_budget() -> None:
    plan = PriorityScheduler().schedule(
        snap(
            running=[
                view("prefill", arrival=0, computed=0, todo=50),
                view("decode", arrival=1, computed=10, todo=1, held=3),
            ],
            waiting=[view("new", arrival=2, todo=30)],
            free=100,
            budget=20,
        )
    )
    assert plan.run == (("decode", 1), ("prefill", 19))
    assert plan.preempt == ()


def test_high_priority_arrival_preempts_low_priority_running_work() -> None:
    running = [view("low", priority=0, arrival=0, computed=40, held=10, releasable=10)]
    plan = PriorityScheduler().schedule(
        snap(running, [view("high", priority=5, arrival=1, todo=30)], free=2)
    )
    assert plan.preempt == ("low",)
    assert ("high", 30) in plan.run and all(rid != "low" for rid, _ in plan.run)


def test_equal_priority_arrival_waits_instead_of_preempting() -> None:
    running = [view("a", arrival=0, computed=40, held=10, releasable=10)]
    plan = PriorityScheduler().schedule(snap(running, [view("b", arrival=1, todo=30)], free=2))
    assert plan.preempt == ()
    assert plan.run == (("a", 1),)


def test_running_request_short_of_pages_preempts_a_later_arrival_not_an_earlier_one() -> None:
    # Both need a new page; only one page is free.
    a = view("a", arrival=0, computed=8, todo=1, held=2, releasable=2)
    b = view("b", arrival=1, computed=8, todo=1, held=2, releasable=2)
    plan = PriorityScheduler().schedule(snap([a, b], [], free=1))
    assert plan.run == (("a", 1),) and plan.preempt == ()
    plan = PriorityScheduler().schedule(snap([a, b], [], free=0))
    assert plan.preempt == ("b",) and plan.run == (("a", 1),)


def test_siblings_wait_for_the_prompt_another_request_is_computing() -> None:
    waiting = [
        view("s1", arrival=0, todo=300, key="prompt-A"),
        view("s2", arrival=1, todo=300, key="prompt-A"),
        view("s3", arrival=2, todo=300, key="prompt-A", in_flight=True),
        view("other", arrival=3, todo=20, key="prompt-B"),
    ]
    plan = PriorityScheduler().schedule(snap([], waiting, free=1000, budget=1000))
    assert sorted(rid for rid, _ in plan.run) == ["other", "s1"]


def test_admission_respects_max_running() -> None:
    waiting = [view(f"w{i}", arrival=i, todo=4) for i in range(5)]
    plan = PriorityScheduler().schedule(snap([], waiting, free=100, max_running=3))
    assert [rid for rid, _ in plan.run] == ["w0", "w1", "w2"]


def test_never_more_running_requests_than_decode_tokens_per_step() -> None:
    running = [view(f"r{i}", arrival=i, computed=8, held=2) for i in range(3)]
    waiting = [view(f"w{i}", arrival=10 + i, todo=1) for i in range(5)]
    plan = PriorityScheduler().schedule(snap(running, waiting, free=100, budget=4))
    assert [rid for rid, _ in plan.run] == ["r0", "r1", "r2", "w0"]


def test_best_effort_requests_leave_the_reserved_pages_to_high_priority_ones() -> None:
    reserved = EngineSnapshot(
        running=[],
        waiting=[view("high", priority=1, todo=40)],
        free_pages=12,
        page_size=4,
        token_budget=100,
        max_running=8,
        reserved_pages=6,
        reserve_priority=1,
    )
    plan = PriorityScheduler().schedule(reserved)
    assert dict(plan.run) == {"high": 40}  # 10 pages: it may use the reserved ones
    alone = dataclasses.replace(reserved, waiting=[view("low", priority=0, todo=20)])
    assert dict(PriorityScheduler().schedule(alone).run) == {"low": 20}  # 5 <= 12 - 6
    tight = dataclasses.replace(reserved, waiting=[view("low", priority=0, todo=40)])
    assert PriorityScheduler().schedule(tight).run == ()  # 10 > 12 - 6: it waits


def test_a_waiting_request_does_not_count_its_own_cached_pages_as_free() -> None:
    # 4 free pages, all of them the request's own idle cache (evictable, so counted as free):
    # admitting it locks them, and its 2 new pages must come from elsewhere.
    cached = dataclasses.replace(view("w", computed=16, todo=8, held=4), pages_idle=4)
    assert PriorityScheduler().schedule(snap([], [cached], free=4)).run == ()
    assert PriorityScheduler().schedule(snap([], [cached], free=6)).run == (("w", 8),)
    # Pages another running request already holds locked are not in the free count at all.
    shared = dataclasses.replace(cached, pages_idle=0)
    assert PriorityScheduler().schedule(snap([], [shared], free=2)).run == (("w", 8),)
