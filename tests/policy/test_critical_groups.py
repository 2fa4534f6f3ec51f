"""Critical-group ranking and the staleness bound, on hand-made snapshots."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from venusrl.policy.critical_groups import (
    BEST_EFFORT,
    HIGH,
    LATE,
    CoordinatorSnapshot,
    CriticalGroups,
    FifoGroups,
    GroupView,
    LengthPredictor,
    MemberView,
    Prediction,
    RollingMedian,
    TurnRates,
    slowest_remaining_s,
)
from venusrl.policy.staleness import StalenessBound

# The groups the batch needs and no spare: the rule the tests below are about.
EXACT = CriticalGroups(spares=0)


def group(gid: str, done: int, k: int = 8, arrival: int = 0, tokens: int = 0) -> GroupView:
    members = tuple(MemberView(done=i < done, generated_tokens=tokens) for i in range(k))
    return GroupView(gid, f"prompt-{gid}", arrival, members)


def snapshot(groups: list[GroupView], batch: int = 1, waiting: int = 0, **preds: Prediction):
    return CoordinatorSnapshot(groups, batch, waiting, preds, 100.0, tool_s_per_turn=0.5)


def remaining(*members: MemberView, now: float = 0.0) -> float:
    view = GroupView("g", "prompt-g", 0, members)
    snap = CoordinatorSnapshot([view], 1, 0, {}, 100.0, tool_s_per_turn=0.5, now=now)
    return slowest_remaining_s(view, Prediction(1000, 10), snap)


def test_a_member_past_its_prediction_still_has_a_share_of_its_work_ahead() -> None:
    past = MemberView(False, generated_tokens=4000, turns=40)
    # 0.25 of 4,000 tokens at 100 tokens/s, 0.25 of 40 turns at the median 0.5 s
    assert remaining(past) == pytest.approx(10.0 + 10 * 0.5)


def test_a_group_whose_tools_run_slow_is_predicted_slow() -> None:
    median = MemberView(False, tool_s=8 * 0.5, tool_calls=8)
    slow = MemberView(False, tool_s=8 * 20.5, tool_calls=8)
    # 10 turns at (8 calls of 20.5 s + 8 of the median's 0.5 s) / 16 = 10.5 s a call
    assert remaining(slow) - remaining(median) == pytest.approx(10 * (10.5 - 0.5))


def test_a_tool_call_that_runs_long_counts_what_it_ran_past_the_expected() -> None:
    waiting = MemberView(False, turns=9, waiting_on_tool=True, tool_since=100.0)
    assert remaining(waiting, now=130.0) - remaining(waiting, now=100.0) == pytest.approx(29.5)


def test_a_member_being_graded_has_only_its_reward_left_and_what_it_ran_past_it() -> None:
    graded = MemberView(False, generated_tokens=10, turns=1, reward_since=100.0)
    view = GroupView("g", "prompt-g", 0, (graded,))
    snap = CoordinatorSnapshot([view], 1, 0, {}, 100.0, 0.5, now=101.0, reward_s=4.0)
    assert slowest_remaining_s(view, Prediction(1000, 10), snap) == 4.0  # not 990 tokens to go
    late = replace(snap, now=110.0)  # 10 s in, past the 4 s a reward takes: as long again
    assert slowest_remaining_s(view, Prediction(1000, 10), late) == 10.0


def test_a_group_whose_members_are_all_being_graded_outranks_one_still_rolling_out() -> None:
    graded = MemberView(False, generated_tokens=50, turns=3, reward_since=0.0)
    rolling = MemberView(False, generated_tokens=50, turns=3, waiting_on_tool=True, tool_since=0.0)
    views = [
        GroupView("rolling", "p", 0, (rolling,) * 4),
        GroupView("graded", "p", 1, (graded,) * 4),
    ]
    snap = CoordinatorSnapshot(views, 1, 0, {}, 100.0, 0.5, now=0.0, reward_s=30.0)
    decision = EXACT.decide(snap)
    assert decision.order == ("graded", "rolling")  # nearer done, though its reward is slow
    assert decision.priority["graded"] == HIGH


def test_a_group_with_7_of_8_done_outranks_one_with_1_of_8_done() -> None:
    snap = snapshot([group("early", done=1, arrival=0), group("almost", done=7, arrival=1)])
    decision = EXACT.decide(snap)
    assert decision.order == ("almost", "early")
    assert decision.priority == {"almost": HIGH, "early": BEST_EFFORT}


def test_ties_in_completion_are_broken_by_predicted_remaining_time() -> None:
    slow, fast = group("slow", done=4, arrival=0), group("fast", done=4, arrival=1)
    snap = snapshot(
        [slow, fast],
        **{"prompt-slow": Prediction(2000, 4), "prompt-fast": Prediction(300, 2)},
    )
    assert EXACT.decide(snap).order == ("fast", "slow")
    # Progress counts: the slow prompt's members are nearly through their tokens.
    nearly = group("slow", done=4, arrival=0, tokens=1000)
    snap = snapshot(
        [nearly, fast],
        **{"prompt-slow": Prediction(1100, 0), "prompt-fast": Prediction(300, 2)},
    )
    assert EXACT.decide(snap).order == ("slow", "fast")


def test_only_the_groups_that_fill_the_next_batch_are_high_priority() -> None:
    groups = [group(f"g{i}", done=i, arrival=i) for i in range(6)]
    decision = EXACT.decide(snapshot(groups, batch=4, waiting=1))
    assert [decision.priority[g] for g in decision.order] == [HIGH] * 3 + [BEST_EFFORT] * 3
    assert set(decision.order[:3]) == {"g5", "g4", "g3"}  # the most complete
    full = EXACT.decide(snapshot(groups, batch=4, waiting=4))
    assert set(full.priority.values()) == {BEST_EFFORT}


def test_spares_beside_the_groups_the_batch_needs_are_critical_too() -> None:
    # A batch of 16 needs 3 more groups: an eighth of the batch (2 groups) runs beside them as
    # critical, the next in the ranking; once the batch has all it needs, no group is critical.
    groups = [group(f"g{i}", done=i % 8, arrival=i) for i in range(8)]
    decision = CriticalGroups().decide(snapshot(groups, batch=16, waiting=13))
    assert [decision.priority[g] for g in decision.order] == [HIGH] * 5 + [BEST_EFFORT] * 3
    assert set(decision.order[:3]) == {"g7", "g6", "g5"}  # the most complete are the needed
    assert decision.order[3:5] == ("g4", "g3")
    full = CriticalGroups().decide(snapshot(groups, batch=16, waiting=16))
    assert set(full.priority.values()) == {BEST_EFFORT}
    # At least one spare however small the batch; more spares than open groups mark them all.
    assert set(
        CriticalGroups().decide(snapshot(groups[:2], batch=2, waiting=1)).priority.values()
    ) == {HIGH}
    with pytest.raises(ValueError, match="spares"):
        CriticalGroups(spares=1.5)


def test_the_groups_the_batch_needs_run_longest_remaining_path_first() -> None:
    # The batch needs two groups: the two soonest done of the three, whose last decides when
    # it is complete; so of those two the longer goes first.
    groups = [group(g, done=4, arrival=i) for i, g in enumerate(("long", "short", "longest"))]
    preds = {"prompt-long": Prediction(2000, 4), "prompt-short": Prediction(300, 2),
             "prompt-longest": Prediction(9000, 4)}  # fmt: skip
    decision = EXACT.decide(snapshot(groups, batch=2, **preds))
    assert decision.order == ("long", "short", "longest")
    assert decision.priority == {"long": HIGH, "short": HIGH, "longest": BEST_EFFORT}


def test_fifo_baseline_keeps_arrival_order_and_no_priorities() -> None:
    groups = [group("b", done=7, arrival=1), group("a", done=0, arrival=0)]
    decision = FifoGroups().decide(snapshot(groups))
    assert decision.order == ("a", "b") and set(decision.priority.values()) == {BEST_EFFORT}


def test_length_predictor_starts_from_the_prompt_history_then_the_global_median() -> None:
    pred = LengthPredictor()
    assert pred.predictions(["p"]) == {}
    pred.observe("p", 100, 3)
    pred.observe("p", 300, 5)
    pred.observe("q", 1000, 9)
    assert pred.predictions(["p"])["p"] == Prediction(200, 4)
    assert pred.predictions(["new"])["new"] == Prediction(300, 5)  # median of all three


def test_turn_rates_are_the_given_figures_until_turns_are_seen_then_their_medians() -> None:
    rates = TurnRates(decode_tokens_per_s=50.0, tool_s_per_turn=0.5)
    assert (rates.decode_tokens_per_s, rates.tool_s_per_turn) == (50.0, 0.5)
    rates.observe(tokens=100, generation_s=1.0, tool_s=4.0)
    assert (rates.decode_tokens_per_s, rates.tool_s_per_turn) == (100.0, 4.0)
    rates.observe(tokens=300, generation_s=1.0, tool_s=2.0)
    rates.observe(tokens=200, generation_s=0.1, tool_s=60.0)  # one tool that hung: no outlier
    assert (rates.decode_tokens_per_s, rates.tool_s_per_turn) == (300.0, 4.0)


def test_a_last_turn_tells_no_tool_time_and_a_replayed_turn_no_decode_speed() -> None:
    rates = TurnRates(decode_tokens_per_s=50.0, tool_s_per_turn=0.5)
    rates.observe(tokens=80, generation_s=2.0, tool_s=None)  # the episode ended with it
    assert (rates.decode_tokens_per_s, rates.tool_s_per_turn) == (40.0, 0.5)
    rates.observe(tokens=80, generation_s=0.0, tool_s=3.0)  # acted on again from a record
    assert (rates.decode_tokens_per_s, rates.tool_s_per_turn) == (40.0, 3.0)


def test_turn_rates_follow_the_latest_turns() -> None:
    rates = TurnRates(window=3)
    for _ in range(3):
        rates.observe(tokens=10, generation_s=1.0, tool_s=1.0)
    for _ in range(2):  # the engine got busier, the tools slower
        rates.observe(tokens=5, generation_s=1.0, tool_s=2.0)
    assert (rates.decode_tokens_per_s, rates.tool_s_per_turn) == (5.0, 2.0)


@given(
    window=st.integers(1, 8),
    values=st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=40),
)
def test_the_rolling_median_is_the_median_of_the_latest_window_values(
    window: int, values: list[float]
) -> None:
    rolling = RollingMedian(window)
    for i, value in enumerate(values):
        assert rolling.add(value) == statistics.median(values[max(0, i + 1 - window) : i + 1])


@given(
    batch=st.integers(1, 16),
    staleness=st.integers(0, 4),
    version=st.integers(0, 50),
    started=st.integers(0, 2000),
)
def test_no_group_starts_more_than_max_staleness_versions_ahead(
    batch: int, staleness: int, version: int, started: int
) -> None:
    bound = StalenessBound(batch, staleness)
    ok = bound.may_start(started, version)
    # The group's batch is trained at version started // batch: at most `staleness` ahead.
    assert ok == (started // batch - version <= staleness)
    n = bound.startable(started, version)
    assert all(bound.may_start(started + i, version) for i in range(n))
    assert not bound.may_start(started + n, version)


def test_synchronous_training_runs_only_the_current_batch() -> None:
    bound = StalenessBound(batch_groups=4, max_staleness=0)
    assert bound.startable(0, 0) == 4
    assert not bound.may_start(4, 0)
    assert bound.may_start(4, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBound(4, -1)


def test_a_group_the_staleness_bound_makes_due_outranks_a_more_complete_one() -> None:
    members = tuple(MemberView(done=i < 1) for i in range(8))
    due = GroupView("due", "prompt-due", 0, members, due=True)
    decision = EXACT.decide(snapshot([group("almost", 7, arrival=1), due]))
    assert decision.order == ("due", "almost")
    assert decision.priority == {"due": HIGH, "almost": BEST_EFFORT}


def test_a_group_that_would_run_into_the_time_limit_runs_among_the_critical_ones() -> None:
    # Ranked by completion alone, a long group that has done nothing yet waits behind the groups
    # opened after it until the harness cuts it; once less than LATE times its predicted path
    # is left before the cut, it runs among the critical groups.
    members = tuple(MemberView(done=i < 1) for i in range(8))
    path = slowest_remaining_s(GroupView("g", "prompt-g", 0, members), EXACT.default, snapshot([]))
    for cut_in, late in ((LATE * path * 1.01, False), (LATE * path * 0.99, True)):
        long = GroupView("long", "prompt-long", 0, members, cut_at=100.0 + cut_in)
        snap = replace(snapshot([group("almost", 7, arrival=1), long]), now=100.0)
        decision = EXACT.decide(snap)
        assert decision.order == (("long", "almost") if late else ("almost", "long"))
        assert decision.priority["long"] == (HIGH if late else BEST_EFFORT)


def test_the_batch_takes_due_groups_first_and_waits_for_a_running_due_group() -> None:
    bound = StalenessBound(batch_groups=2, max_staleness=1)
    # At version 2, groups started at version 1 are due; ready in completion order.
    assert bound.batch([2, 1, 2], running=[], weight_version=2) == [1, 0]
    assert bound.batch([2, 2, 2], running=[1], weight_version=2) is None  # wait for it
    assert bound.batch([2, 2], running=[2], weight_version=2) == [0, 1]  # nothing due
    assert bound.batch([1], running=[], weight_version=2) is None  # fewer than B complete


def test_a_train_bound_above_the_start_bound_lets_batches_overtake_a_straggler() -> None:
    # Group started at version 0 still running (its tools hang); later groups complete.
    strict = StalenessBound(batch_groups=2, max_staleness=1)
    late = StalenessBound(batch_groups=2, max_staleness=1, max_train_staleness=3)
    ready, straggler = [0, 1, 1], [0]
    assert strict.batch(ready, straggler, weight_version=1) is None  # waits for it
    assert late.batch(ready, straggler, weight_version=1) == [0, 1]  # takes the next ones
    assert not late.due(0, weight_version=2) and late.due(0, weight_version=3)
    assert late.batch([2, 2], straggler, weight_version=3) is None  # its deadline has come
    with pytest.raises(ValueError, match="max_train_staleness"):
        StalenessBound(2, max_staleness=2, max_train_staleness=1)


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 4),
    staleness=st.integers(0, 3),
    extra_lag=st.one_of(st.none(), st.integers(0, 3)),
    seed=st.integers(0, 2**32),
)
def test_no_group_is_trained_more_than_its_bound_after_it_started(
    batch: int, staleness: int, extra_lag: int | None, seed: int
) -> None:
    # Groups start as the bound allows and complete (or are dropped) in an arbitrary order, as
    # they do when their members' lengths differ; batches form by `StalenessBound.batch`.
    lag = None if extra_lag is None else staleness + extra_lag
    bound = StalenessBound(batch, staleness, lag)
    rng = random.Random(seed)
    placed = 0
    running: list[int] = []  # started versions of the running groups
    ready: list[int] = []
    for version in range(12):
        n = bound.startable(placed, version)
        running += [version] * n
        placed += n
        while (picked := bound.batch(ready, running, version)) is None:
            assert running, "every group is complete and still no batch: the bound deadlocked"
            started = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.1:  # dropped: its place in a batch is given back
                placed -= 1
                running += [version] * bound.startable(placed, version)
                placed += bound.startable(placed, version)
            else:
                ready.append(started)
        assert all(version - ready[i] <= bound.lag for i in picked)
        ready = [v for i, v in enumerate(ready) if i not in set(picked)]
