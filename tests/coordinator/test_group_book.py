"""The group book the coordinator and the simulator keep: which groups open, which complete, in
which order the trainer gets them, and how they rank, on hand-told events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from venusrl.coordinator.group_book import GroupBook
from venusrl.policy.critical_groups import HIGH
from venusrl.policy.staleness import StalenessBound
from venusrl.types import Progress


def book(batch: int, staleness: int, start_version: int = 0) -> GroupBook[None]:
    return GroupBook(StalenessBound(batch, staleness), "critical", start_version=start_version)


def open_groups(b: GroupBook[None], n: int, size: int = 2, version: int = 0) -> list[str]:
    ids = [f"g{b.groups_started + i}" for i in range(n)]
    for gid in ids:
        b.start_group(gid, f"prompt-{gid}", size, version, None)
    return ids


def ranked(b: GroupBook[None], version: int, now: float = 0.0) -> tuple[str, ...]:
    """The open groups, most critical first, as ranked at `version` and `now`."""
    b.rank(version, now)
    return b.order


def finish(b: GroupBook[None], gid: str, scored: int, masked: int = 0) -> bool:
    """The group's members end, `scored` then `masked` of them; close it."""
    for i in range(scored + masked):
        b.member_finished(gid, i, scored=i < scored, final=Progress(100, 2, 1, 1.0))
    return b.close(gid)


def test_a_dropped_group_gives_its_place_in_a_batch_back() -> None:
    b = book(batch=2, staleness=0)  # synchronous: only the batch the trainer waits for runs
    g0, g1 = open_groups(b, b.startable(0))
    assert b.startable(0) == 0
    b.drop(g0)  # it timed out
    assert b.startable(0) == 1
    open_groups(b, 1)
    assert not finish(b, g1, scored=1, masked=1)  # one reward teaches GRPO nothing: dropped
    assert b.startable(0) == 1 and b.groups_dropped == 2
    b.check()


def test_a_resumed_run_counts_the_groups_of_the_batches_it_trained() -> None:
    fresh, resumed = book(batch=2, staleness=1), book(batch=2, staleness=1, start_version=3)
    assert fresh.startable(3) == 10  # batches 0 to 4: nothing was started yet
    assert resumed.startable(3) == 4  # batches 3 and 4
    open_groups(resumed, 4, version=3)
    with pytest.raises(ValueError, match="staleness bound"):
        open_groups(resumed, 1, version=3)


def test_a_group_with_fewer_than_two_scored_members_is_dropped_not_batched() -> None:
    b = book(batch=1, staleness=1)
    (g0,) = open_groups(b, 1, size=3)
    assert not finish(b, g0, scored=1, masked=2)
    assert b.take_batch(0) is None and (b.groups_completed, b.groups_dropped) == (0, 1)
    b.check()


def test_the_batch_takes_complete_groups_in_completion_order_but_waits_for_a_due_one() -> None:
    b = book(batch=2, staleness=1)
    g0, g1, g2, g3 = open_groups(b, b.startable(0))
    assert finish(b, g3, scored=2) and finish(b, g2, scored=2)
    batch = b.take_batch(0)
    assert batch is not None and [g.group_id for g in batch] == [g3, g2]
    assert finish(b, g1, scored=2)
    # At version 1 the groups started at 0 must be trained: the batch waits for g0.
    assert b.take_batch(1) is None
    assert finish(b, g0, scored=2)
    batch = b.take_batch(1)
    assert batch is not None and [g.group_id for g in batch] == [g1, g0]
    b.check()


def test_measured_slow_tools_put_a_group_with_many_turns_left_behind_one_with_many_tokens() -> None:
    b = book(batch=1, staleness=1)
    chatty, tooly = open_groups(b, 2)
    # One member of each has finished: the prompts' lengths to come are known.
    b.member_finished(chatty, 0, scored=True, final=Progress(2000, 1, 0, 0.0))
    b.member_finished(tooly, 0, scored=True, final=Progress(100, 10, 9, 4.5))
    # Before any turn is seen, 50 tok/s and 0.5 s a tool call: 2000 tokens (40 s) take longer
    # than 100 tokens and 10 tool calls (7 s).
    assert ranked(b, 0) == (tooly, chatty)
    for _ in range(5):  # the run's engine turns out fast and its tools slow
        b.rates.observe(tokens=1000, generation_s=1.0, tool_s=20.0)
    snap = b.snapshot(0)
    assert (snap.decode_tokens_per_s, snap.tool_s_per_turn) == (1000.0, 20.0)
    # 2 s + 20 s against 10 calls of 9.7 s (the run's 20 s weighed with its member's 0.5 s)
    assert ranked(b, 0) == (chatty, tooly)


def test_a_group_whose_tool_calls_ran_slow_ranks_behind_one_whose_ran_fast() -> None:
    b = book(batch=1, staleness=1)
    slow, fast = open_groups(b, 2)
    for gid, seconds in ((slow, 30.0), (fast, 0.5)):
        b.progress(gid, 0, Progress(100, 1, 0, 0.0), now=0.0)
        b.progress(gid, 0, Progress(100, 1, 1, seconds), now=seconds)
    # The same prompt lengths and progress: only the tool calls each group has seen differ.
    assert ranked(b, 0, now=0.0) == (fast, slow)
    assert b.snapshot(0).groups[0].members[0].tool_calls == 1


def test_a_finished_member_s_tool_calls_count_toward_its_group_s_tool_time() -> None:
    # Its reports while it ran may never have come (a cluster relays them only beside
    # another episode's end): the finished trajectory's own count is the one kept.
    b = book(batch=1, staleness=1)
    slow, fast = open_groups(b, 2)
    for gid, seconds in ((slow, 30.0), (fast, 0.5)):
        b.member_finished(gid, 0, scored=True, final=Progress(100, 2, 1, seconds))
        b.progress(gid, 1, Progress(100, 1, 0, 0.0), now=31.0)  # its 2nd member in a call
    finished = {g.group_id: g.members[0] for g in b.snapshot(0).groups}
    assert (finished[slow].tool_calls, finished[slow].tool_s) == (1, 30.0)
    assert b.tool_calls_seen == 2
    # Both still-running members look alike: only their finished siblings' calls differ.
    assert ranked(b, 0, now=31.0) == (fast, slow)


def test_a_member_long_in_its_tool_call_makes_its_group_rank_as_slow() -> None:
    b = book(batch=1, staleness=1)
    stuck, moving = open_groups(b, 2)
    b.progress(stuck, 0, Progress(100, 1, 0, 0.0), now=0.0)  # its call started at 0
    b.progress(moving, 0, Progress(100, 1, 0, 0.0), now=99.0)
    assert ranked(b, 0, now=100.0) == (moving, stuck)
    assert b.order == (moving, stuck)


def test_a_report_repeated_during_one_tool_call_keeps_when_the_call_started() -> None:
    # A rollout worker relays a member's latest report with every episode that ends beside it:
    # the same report may come several times, and late.
    b = book(batch=1, staleness=1)
    (g,) = open_groups(b, 1)
    b.progress(g, 0, Progress(100, 1, 0, 0.0), now=10.0)
    b.progress(g, 0, Progress(100, 1, 0, 0.0), now=50.0)  # relayed again
    member = b.snapshot(0).groups[0].members[0]
    assert member.waiting_on_tool and member.tool_since == 10.0
    b.progress(g, 0, Progress(100, 1, 1, 42.0), now=52.0)  # the call returned
    b.progress(g, 0, Progress(100, 1, 1, 42.0), now=60.0)
    member = b.snapshot(0).groups[0].members[0]
    assert not member.waiting_on_tool and member.tool_since is None
    assert (member.tool_calls, member.tool_s) == (1, 42.0)
    assert b.tool_calls_seen == 1  # counted once, however often it was told


def test_a_replacement_attempt_starts_from_nothing_and_a_late_report_is_ignored() -> None:
    b = book(batch=1, staleness=1)
    (g,) = open_groups(b, 1)
    b.progress(g, 0, Progress(100, 2, 1, 5.0), now=10.0)  # in the tool call of its 2nd turn
    b.progress(g, 0, Progress(60, 1, 1, 5.0), now=11.0)  # an older report, relayed late
    member = b.snapshot(0).groups[0].members[0]
    assert (member.turns, member.generated_tokens, member.tool_since) == (2, 100, 10.0)
    # The attempt failed there; its replacement's own call of its 2nd turn starts later.
    b.restart_member(g, 0)
    b.progress(g, 0, Progress(30, 1, 0, 0.0), now=40.0)
    b.progress(g, 0, Progress(30, 1, 1, 2.0), now=42.0)
    b.progress(g, 0, Progress(70, 2, 1, 2.0), now=50.0)
    member = b.snapshot(0).groups[0].members[0]
    assert (member.turns, member.tool_calls, member.tool_s) == (2, 1, 2.0)
    assert member.tool_since == 50.0  # not the failed attempt's 10.0
    assert b.tool_calls_seen == 2


def test_a_turn_reported_after_its_group_was_dropped_changes_nothing() -> None:
    b = book(batch=1, staleness=0)
    (g0,) = open_groups(b, 1)
    b.drop(g0)
    b.progress(g0, 0, Progress(10, 1, 0, 0.0))  # the member's last report, on its way when it ended
    assert g0 not in b.open and b.startable(0) == 1
    b.check()


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 3), staleness=st.integers(0, 2), events=st.data())
def test_the_books_balance_whatever_happens(
    batch: int, staleness: int, events: st.DataObject
) -> None:
    b, version = book(batch, staleness), 0
    for _ in range(40):
        action = events.draw(st.sampled_from(["open", "member", "drop", "train"]))
        running = [g for g in b.open.values() if not g.finished]
        if action == "open" and b.startable(version):
            open_groups(b, 1, size=events.draw(st.integers(2, 4)), version=version)
        elif action == "member" and running:
            g = events.draw(st.sampled_from(running))
            index = next(i for i, m in enumerate(g.members) if not m.done)
            b.progress(g.group_id, index, Progress(50, 1, 0, 0.0))
            if b.member_finished(
                g.group_id, index, events.draw(st.booleans()), Progress(100, 2, 1, 1.0)
            ):
                b.close(g.group_id)
        elif action == "drop" and running:
            b.drop(events.draw(st.sampled_from(running)).group_id)
        elif action == "train" and (taken := b.take_batch(version)) is not None:
            assert len(taken) == batch
            assert all(version - g.started_version <= staleness for g in taken)
            version += 1
        b.rank(version)
        b.check()


@pytest.mark.parametrize("release", [False, True])
def test_an_overtaken_straggler_frees_its_start_place_only_when_released(release: bool) -> None:
    bound = StalenessBound(2, max_staleness=1, max_train_staleness=4, release_overtaken=release)
    b: GroupBook[None] = GroupBook(bound, "critical")
    g0, g1, g2, g3 = open_groups(b, b.startable(0))  # batches 0 and 1 of the start bound
    for gid in (g1, g2):
        assert finish(b, gid, scored=2)
    batch = b.take_batch(0)  # g0 straggles: g2, started after it, takes its place
    assert batch is not None and [g.group_id for g in batch] == [g1, g2]
    # AReaL's count: g0 still holds one of batch 1's places until new weights are out.
    assert b.startable(0) == (1 if release else 0)
    if release:
        (g4,) = open_groups(b, 1)
        assert finish(b, g3, scored=2) and finish(b, g4, scored=2)
        batch = b.take_batch(1)  # batch 1 completes before g0 does
        assert batch is not None and [g.group_id for g in batch] == [g3, g4]
    assert finish(b, g0, scored=2)  # once complete it counts again, as any group does
    assert b.startable(0) == 0
    b.check()


@given(
    batch=st.integers(1, 3),
    start=st.integers(0, 2),
    slack=st.integers(0, 2),
    events=st.lists(st.integers(0, 1_000), min_size=1, max_size=80),
)
@settings(max_examples=200, deadline=None)
def test_released_places_never_push_a_group_past_its_train_bound(
    batch: int, start: int, slack: int, events: list[int]
) -> None:
    """Groups open whenever they may and complete in an arbitrary order; every batch trained is
    within the train bound, with overtaken stragglers' places given back."""
    bound = StalenessBound(batch, start, start + slack, release_overtaken=True)
    b: GroupBook[None] = GroupBook(bound, "critical")
    version = 0
    for pick in events:
        open_groups(b, b.startable(version), version=version)
        running = sorted(b.open)
        if running:  # one group completes: any of those running
            assert finish(b, running[pick % len(running)], scored=2)
        taken = b.take_batch(version)
        if taken is not None:
            assert all(version - g.started_version <= start + slack for g in taken)
            version += 1
    b.check()


def test_a_group_nearing_the_time_limit_from_its_opening_ranks_among_the_critical() -> None:
    # Two groups alike but for when they opened: the older ranks first once its cut is near.
    b: GroupBook[None] = GroupBook(StalenessBound(1, 1), "critical", time_limit_s=600.0)
    b.start_group("old", "prompt-old", 2, 0, None, now=0.0)
    b.start_group("new", "prompt-new", 2, 0, None, now=500.0)
    b.member_finished("new", 0, scored=True, final=Progress(100, 2, 1, 1.0))
    assert ranked(b, 0, now=500.0) == ("new", "old")  # the more complete first, while it can
    assert ranked(b, 0, now=599.0) == ("old", "new")
    assert b.priority("old") == HIGH
    with pytest.raises(ValueError, match="time_limit_s"):
        GroupBook(StalenessBound(1, 1), "critical", time_limit_s=0.0)
