"""The KV window (`venus`): who runs on which engine, decided by KV and the group ranking."""

from __future__ import annotations

import pytest

from venusrl.policy.critical_groups import BEST_EFFORT, HIGH
from venusrl.policy.kv_window import Agent, CriticalWindow, EngineLoad, GroupRanks, admission_key

CAP = 1_000_000  # device KV of an engine, tokens
WINDOW = CriticalWindow(lane=1.0)  # budget 850K, keep 970K, no lane
LANE = CriticalWindow()  # the default lane of 0.3: 255K


def engine(load: int = 0, critical: int = 0, members: int = 0) -> EngineLoad:
    return EngineLoad(CAP, load, critical, members)


def test_an_agent_joins_only_within_the_budget() -> None:
    assert WINDOW.fits(engine(800_000), Agent(50_000, BEST_EFFORT))
    assert not WINDOW.fits(engine(800_001), Agent(50_000, BEST_EFFORT))


def test_the_agents_of_the_head_groups_may_fill_an_engine_up_to_keep() -> None:
    # The batch waits for its longest paths: their agents take the room between the budget and
    # keep rather than wait for a member to leave (every member may be critical: none yields).
    full = engine(900_000, critical=900_000)
    assert WINDOW.fits(full, Agent(70_000, HIGH, rank=WINDOW.head - 1))
    assert not WINDOW.fits(full, Agent(70_001, HIGH, rank=WINDOW.head - 1))  # past keep
    assert not WINDOW.fits(full, Agent(10_000, HIGH, rank=WINDOW.head))
    assert not WINDOW.fits(full, Agent(10_000, BEST_EFFORT, rank=0))  # best effort: no head
    assert WINDOW.place([full, full], Agent(70_000, HIGH, rank=0)) == 0
    assert WINDOW.place([full, full], Agent(70_000, HIGH, rank=WINDOW.head)) is None
    # A best-effort member makes room for a head agent that fits within keep in its place.
    mixed = [engine(850_000, critical=450_000, members=9)]
    member = Agent(400_000, BEST_EFFORT, home=0, counted=400_000, rank=20)
    for rank, gives_way in ((0, True), (WINDOW.head, False)):
        rival = Agent(450_000, HIGH, home=0, rank=rank)  # 450K + 450K: past fill, within keep
        assert WINDOW.yields(mixed, 450_000, member, rival) is gives_way


def test_best_effort_agents_hold_at_most_the_lane_beside_critical_members() -> None:
    busy = engine(load=200_000, critical=100_000)
    assert LANE.fits(busy, Agent(50_000, BEST_EFFORT))
    assert not LANE.fits(busy, Agent(60_000, BEST_EFFORT))  # 260K > the 255K lane
    assert LANE.fits(busy, Agent(60_000, HIGH))
    assert LANE.fits(engine(200_000), Agent(60_000, BEST_EFFORT))  # no critical member there


def test_the_lane_holds_only_while_the_agents_ask_more_kv_than_the_budgets_hold() -> None:
    engines = [engine(600_000, critical=300_000), engine(600_000)]  # budgets: 1.7M in all
    agent = Agent(60_000, BEST_EFFORT)
    short = LANE.lanes(engines, waiting=600_000)  # 1.8M asked: best effort kept off the lane
    assert short is LANE and not short.fits(engines[0], agent)
    roomy = LANE.lanes(engines, waiting=100_000)  # 1.3M: room for every agent, no lane
    assert roomy.lane == 1.0 and roomy.fits(engines[0], agent)
    assert roomy.fill == LANE.fill and roomy.head == LANE.head  # nothing else changes
    assert WINDOW.lanes(engines, waiting=10**9) is WINDOW


def test_a_new_best_effort_agent_goes_to_the_engine_with_fewest_members() -> None:
    # Every member's context grows to about the same: a new agent's share of an engine's work
    # to come is one member's, whatever the members hold now.
    engines = [engine(500_000, members=9), engine(100_000, members=6), engine(300_000, members=4)]
    assert WINDOW.place(engines, Agent(10_000, BEST_EFFORT)) == 2
    # Among as many members, the least loaded.
    engines = [engine(500_000, members=4), engine(100_000, members=4), engine(300_000, members=4)]
    assert WINDOW.place(engines, Agent(10_000, BEST_EFFORT)) == 1


def test_a_started_best_effort_agent_moves_to_the_least_loaded_engine() -> None:
    engines = [engine(840_000, members=2), engine(100_000, members=9), engine(300_000, members=1)]
    assert WINDOW.place(engines, Agent(50_000, BEST_EFFORT, home=0)) == 1


def test_critical_agents_pack_into_a_fast_lane() -> None:
    engines = [engine(800_000), engine(200_000, critical=150_000), engine(700_000)]
    assert LANE.place(engines, Agent(50_000, HIGH)) == 1
    # The lane is full: the next goes where no critical member is, least loaded first.
    assert LANE.place(engines, Agent(150_000, HIGH)) == 2


def test_critical_agents_spread_when_a_lane_would_hold_more_than_the_mean_load() -> None:
    # Light engines: packing would make the lane the slowest engine, not the fastest.
    engines = [engine(30_000, critical=30_000), engine(10_000), engine(20_000)]
    assert LANE.place(engines, Agent(5_000, HIGH)) == 1


def test_an_agent_stays_home_while_it_fits_there() -> None:
    engines = [engine(300_000), engine(0)]
    assert WINDOW.place(engines, Agent(50_000, BEST_EFFORT, home=0)) == 0


def test_without_migration_an_agent_runs_only_at_home() -> None:
    window = CriticalWindow(migrate=False)
    engines = [engine(840_000), engine(0)]
    assert window.place(engines, Agent(50_000, BEST_EFFORT, home=0)) is None
    assert WINDOW.place(engines, Agent(50_000, BEST_EFFORT, home=0)) == 1


def test_no_place_when_no_engine_has_room() -> None:
    assert WINDOW.place([engine(840_000), engine(849_000)], Agent(20_000, HIGH)) is None


def test_a_member_yields_when_those_ranked_above_it_fill_the_device() -> None:
    me = Agent(100_000, HIGH, home=0, counted=100_000)
    assert WINDOW.yields([engine(990_000)], ahead=880_000, a=me, rival=None)
    assert not WINDOW.yields([engine(900_000)], ahead=600_000, a=me, rival=None)


def test_a_member_yields_to_a_more_critical_agent_with_no_place_elsewhere() -> None:
    me = Agent(100_000, BEST_EFFORT, home=0, counted=100_000)
    rival = Agent(100_000, HIGH)
    full = engine(840_000)
    assert WINDOW.yields([full], ahead=300_000, a=me, rival=rival)
    assert not WINDOW.yields([full, engine(0)], ahead=300_000, a=me, rival=rival)  # room there
    equal = Agent(100_000, BEST_EFFORT)
    assert not WINDOW.yields([full], ahead=300_000, a=me, rival=equal)


def test_a_best_effort_member_over_the_lane_yields_beside_critical_members() -> None:
    me = Agent(100_000, BEST_EFFORT, home=0, counted=100_000)
    lane_full = engine(load=300_000, critical=50_000)
    assert LANE.yields([lane_full], ahead=0, a=me, rival=None)
    assert not LANE.yields([engine(300_000)], ahead=0, a=me, rival=None)


def test_a_member_moves_to_an_engine_lighter_by_the_margin() -> None:
    me = Agent(50_000, BEST_EFFORT, home=0, counted=50_000)
    # home without it: 850K of 1M; the other with it must stay half a device below: under 350K
    assert WINDOW.lighter([engine(900_000), engine(299_000)], me) == 1
    assert WINDOW.lighter([engine(900_000), engine(300_000)], me) is None
    assert CriticalWindow(rebalance=0).lighter([engine(900_000), engine(790_000)], me) == 1
    assert CriticalWindow(migrate=False).lighter([engine(900_000), engine(0)], me) is None


def test_the_rebalance_margin_is_a_share_of_each_device_s_kv() -> None:
    """The same loads as shares move a member alike on a small device and a large one, and
    between devices of different sizes the shares decide, not the tokens."""
    me = Agent(5_000, BEST_EFFORT, home=0, counted=5_000)
    small = [EngineLoad(100_000, 90_000, 0), EngineLoad(100_000, 29_000, 0)]
    assert WINDOW.lighter(small, me) == 1  # 0.34 + 0.5 < 0.85
    unequal = [EngineLoad(100_000, 90_000, 0), EngineLoad(1_000_000, 300_000, 0)]
    assert WINDOW.lighter(unequal, me) == 1  # more tokens than home, but 0.305 of its device
    unequal_full = [EngineLoad(100_000, 90_000, 0), EngineLoad(1_000_000, 350_000, 0)]
    assert WINDOW.lighter(unequal_full, me) is None  # 0.355 + 0.5 > 0.85


def test_waiting_agents_are_admitted_critical_first_then_started_then_by_rank() -> None:
    keys = {
        "critical new": admission_key(HIGH, False, 0, 0),
        "critical started": admission_key(HIGH, True, 5, 0),
        "best effort started": admission_key(BEST_EFFORT, True, 1, 0),
        "best effort new, first group": admission_key(BEST_EFFORT, False, 2, 0),
    }
    assert sorted(keys, key=keys.__getitem__) == [
        "critical started",
        "critical new",
        "best effort started",
        "best effort new, first group",
    ]


@pytest.mark.parametrize(
    "knobs", [{"fill": 0.0}, {"fill": 0.99, "keep": 0.9}, {"lane": 0.0}, {"leave_after_calls": -1}]
)
def test_bad_knobs_are_refused(knobs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CriticalWindow(**knobs)  # type: ignore[arg-type]


def test_a_group_not_ranked_yet_comes_after_every_ranked_one() -> None:
    ranks = GroupRanks(["critical", "next", "last"])
    assert [ranks(g) for g in ("critical", "next", "last", "opened-since")] == [0, 1, 2, 3]
    assert GroupRanks()("any") == 0
