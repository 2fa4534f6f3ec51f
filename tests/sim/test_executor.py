"""The simulator: the real policies, driven by virtual time, on small seeded workloads."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable
from typing import Any

import pytest

from venusrl.policy.agent_admission import AimdAdmission, ConcurAdmission
from venusrl.policy.engine_schedule import PriorityScheduler
from venusrl.policy.kv_window import CriticalWindow
from venusrl.sim.cost_model import CostModel
from venusrl.sim.executor import Simulation, simulate
from venusrl.sim.kv import SimKV
from venusrl.sim.policies import POLICIES, TRAIN_BOUND, SimPolicy, sim_policies, sim_policy
from venusrl.sim.types import SimConfig
from venusrl.workloads import SCENARIOS, Constant, LogNormal, ToolLatency, Turns

# swe-short's shape, small enough to simulate in a fraction of a second.
SMALL = SCENARIOS["swe-short"].scaled_for(
    name="swe-small",
    rollout_gpus=2,
    train_gpus=2,
    prompts_per_batch=4,
    group_size=4,
    turns=Turns("lognormal", LogNormal(8, 0.35), sigma=0.35),
    infra_failure_rate=0.0,
)
# KV for about a third of what the trajectories of two batches in flight hold at their longest.
TIGHT = CostModel.preset("qwen3-4b", "h200", reserved_bytes=112.5e9)


# Ours without its KV window (every trajectory admitted at once), and the Concur-like start
# window of `rollout.admission=aimd`: what the window and Concur's pauses are measured against.
UNWINDOWED = dataclasses.replace(POLICIES["venus"], name="venus+none", admission=None)
START_WINDOW = dataclasses.replace(POLICIES["async"], name="async+aimd", admission=AimdAdmission())


def run(policy: str | SimPolicy, workload=SMALL, seed: int = 0, steps: int = 3, cost=None) -> dict:
    chosen = sim_policy(policy) if isinstance(policy, str) else policy
    return Simulation(workload, chosen, seed, SimConfig(steps=steps), cost).run()


def test_the_same_seed_gives_the_same_run() -> None:
    assert run("venus") == run("venus")
    assert run("venus", seed=1) != run("venus")


def test_it_runs_the_engines_own_scheduler_object() -> None:
    sim = Simulation(SMALL, POLICIES["venus"], 0, SimConfig(steps=2))
    assert all(type(engine.scheduler) is PriorityScheduler for engine in sim.engines)
    sim.run()
    assert sim.counters.decisions > 0 and sim.counters.iterations > sim.counters.decisions


def test_the_ranking_learns_its_rates_from_the_turns_the_run_plays_as_the_coordinator_does() -> (
    None
):
    # As `Coordinator` does with each episode that returns: every turn of a trajectory that ended
    # goes to the book's rates (its tokens, the seconds from its request, queueing included, to
    # its last token, and its tool call's seconds where another turn followed).
    sim = Simulation(SMALL, POLICIES["venus"], 0, SimConfig(steps=3))
    assumed = (sim.book.rates.decode_tokens_per_s, sim.book.rates.tool_s_per_turn)
    seen: list[tuple[int, float, float | None]] = []
    observe = sim.book.rates.observe
    sim.book.rates.observe = lambda *turn: (seen.append(turn), observe(*turn))[1]  # type: ignore[method-assign]
    sim.run()
    assert seen and all(tokens > 0 and seconds > 0 for tokens, seconds, _ in seen)
    tools = [tool for _, _, tool in seen if tool is not None][-256:]  # each its own window
    speeds = [tokens / seconds for tokens, seconds, _ in seen][-256:]
    learned = (sim.book.rates.decode_tokens_per_s, sim.book.rates.tool_s_per_turn)
    assert learned == pytest.approx((statistics.median(speeds), statistics.median(tools)))
    assert learned != assumed


def test_synchronous_training_is_on_policy_and_asynchronous_trains_on_older_groups() -> None:
    sync, asyn = run("sync", steps=4), run("async", steps=4)
    assert sync["steps"] == asyn["steps"] == 4
    assert sync["staleness_max"] == 0
    # A group that completes late is still trained within the bound (batches take due groups,
    # by default up to TRAIN_BOUND versions after they started; `@1:1` waits for them).
    assert asyn["staleness_mean"] > 0 and 1 <= asyn["staleness_max"] <= TRAIN_BOUND
    assert run("async@1:1", steps=4)["staleness_max"] == 1
    # Rollout overlaps training and stragglers: asynchronous is faster per step.
    assert asyn["mean_step_s"] < sync["mean_step_s"]


def test_the_trainer_time_per_step_counts_only_the_steps_of_the_run() -> None:
    """The step still training when the run ends is not one of its steps: one trainer, one step
    at a time, cannot train longer per step than a step takes."""
    # The trainer is the bottleneck: a batch is ready whenever a step is published.
    busy_trainer = SCENARIOS["search-short"].scaled_for(
        name="search-small", rollout_gpus=4, train_gpus=1, prompts_per_batch=8, group_size=8
    )
    sync, asyn = (run(p, workload=busy_trainer, steps=4) for p in ("sync", "async"))
    assert 0 < asyn["train_s_per_step"] <= asyn["mean_step_s"]
    # Batches of as many tokens: the trainer takes as long per step under either policy.
    assert asyn["train_s_per_step"] == pytest.approx(sync["train_s_per_step"], rel=0.05)


def test_it_says_how_long_the_trainer_waited_for_batches_and_how_fast_whose_turns_ran() -> None:
    sync = run("sync", steps=4)
    # Synchronous: after publishing, the trainer waits for the whole of the next batch; a step
    # is that wait, the training and the weight sync.
    step = sync["batch_wait_s"] + sync["train_s_per_step"] + sync["weight_sync_s_per_step"]
    assert step == pytest.approx(sync["mean_step_s"], rel=0.05)
    assert set(sync["turns"]) == {"first/best_effort", "waiting/best_effort"}  # fifo ranks none
    ours = Simulation(SMALL, sim_policy("venus"), 0, SimConfig(steps=4), record=True)
    figures = ours.run()
    assert 0 <= figures["batch_wait_s"] < sync["batch_wait_s"]
    # Every turn counted once, by whether the trainer was training, waiting for a batch or
    # before its first, and whether its group was critical when it was sent.
    assert ours.finishes is not None and sum(figures["turns"].values()) == len(ours.finishes)
    assert {"first/critical", "training/critical", "waiting/best_effort"} <= set(figures["turns"])
    assert figures["turns"].keys() == figures["turn_s_per_token"].keys()
    assert all(0 < s < 1 for s in figures["turn_s_per_token"].values())


def test_a_larger_staleness_bound_buys_rollout_time_with_staleness() -> None:
    one_step, two_steps = run("async@1", steps=4), run("async@2", steps=4)
    assert two_steps["policy"] == "async@2" and two_steps["knobs"]["max_staleness"] == 2
    assert (
        two_steps["staleness_max"] == 2 and two_steps["staleness_mean"] > one_step["staleness_mean"]
    )
    assert two_steps["mean_step_s"] < one_step["mean_step_s"]  # rollout-bound: more in flight
    ours, ours_two_steps = run("venus@1", steps=4), run("venus@2", steps=4)
    assert ours_two_steps["staleness_max"] == 2
    assert ours_two_steps["mean_step_s"] < ours["mean_step_s"]


def test_a_train_bound_above_the_start_bound_lets_batches_overtake_stragglers() -> None:
    strict, late = run("venus@1", steps=6), run("venus@1:3", steps=6)
    assert late["knobs"]["max_staleness"] == 1 and late["knobs"]["max_train_staleness"] == 3
    assert strict["staleness_max"] == 1 and 1 < late["staleness_max"] <= 3
    assert late["mean_step_s"] < strict["mean_step_s"]  # no batch waits for a straggler


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("fastest", "unknown policy 'fastest'"),
        ("venus@1:", "after '@' comes a staleness bound"),
        ("venus@2:1", "max_train_staleness must be >= max_staleness (2), got 1"),
        ("", "unknown policy ''"),
        ("@2", "unknown policy '@2'"),
        ("venus@", "after '@' comes a staleness bound"),
        ("venus@-1", "after '@' comes a staleness bound"),
        ("venus@1.5", "after '@' comes a staleness bound"),
        ("venus@\u00b2", "after '@' comes a staleness bound"),
        ("venus@\u0661", "after '@' comes a staleness bound"),
        ("venus@99999999999", "staleness bounds go up to 64"),
        ("venus@1:65", "staleness bounds go up to 64"),
        (
            "venus[foo=1]",
            "foo: not a knob of venus; its knobs: pin_s, release_overtaken, reward_pool, fill",
        ),
        ("venus[lane]", "'lane' is not KEY=VALUE"),
        ("venus[lane=]", "'lane=' is not KEY=VALUE"),
        ("venus[]", "no KNOB=VALUE between the brackets; venus's knobs: pin_s, release"),
        ("venus[lane=0.5,lane=0.6]", "lane set twice"),
        ("venus[lane=x]", "lane: needs float, got 'x'"),
        ("venus[lane=2]", "lane must be in (0, 1], got 2.0"),
        ("venus[head=1.5]", "head: needs int, got '1.5'"),
        ("venus[migrate=1]", "migrate: needs bool, got '1'"),
        ("venus[leave_after_calls=nan]", "leave_after_calls: needs a finite number"),
        ("async[pin_s=-1]", "pin_s must be >= 0"),
        ("async[fill=0.5]", "fill: not a knob of async; its knobs: pin_s"),
        ("venus[lane=0.5", "knobs go in one [KNOB=VALUE,...] before any '@'"),
        ("venus@1[lane=0.5]", "after '@' comes a staleness bound"),
    ],
)
def test_a_bad_policy_name_says_what_is_wrong(name: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        sim_policy(name)


def test_a_policy_s_knobs_are_set_in_its_name_and_reported_with_its_figures() -> None:
    names = "venus[leave_after_calls=2, lane=0.5, migrate=false]@1:4,concur+offload[high_water=0.9]"
    ours, concur = sim_policies(names)
    assert ours.name == "venus[leave_after_calls=2, lane=0.5, migrate=false]@1:4"
    assert ours.admission == CriticalWindow(leave_after_calls=2.0, lane=0.5, migrate=False)
    assert (ours.max_staleness, ours.max_train_staleness) == (1, 4)
    assert concur.admission == ConcurAdmission(high_water=0.9)
    assert concur.retention == "trajectory"  # still the +offload form
    result = run("venus[migrate=false,rebalance=0]")
    assert result["knobs"]["admission"]["migrate"] is False and result["migrations"] == 0
    assert run("venus[rebalance=0]")["migrations"] > 0  # the knob, not the workload


def test_a_straggler_overtaken_by_the_batches_frees_its_start_place_when_released() -> None:
    held, released = run("async", steps=6), run("async[release_overtaken=true]", steps=6)
    assert released["knobs"]["release_overtaken"] is True
    # Its replacement starts at once instead of at the next publish: the trainer waits less,
    # and trains staler groups, never past the train bound.
    assert released["batch_wait_s"] < held["batch_wait_s"]
    assert released["staleness_mean"] > held["staleness_mean"]
    assert released["staleness_max"] <= 4


def test_a_policy_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="async listed more than once"):
        sim_policies("sync,async, async")


def test_a_trajectory_longer_than_the_engines_kv_is_a_workload_error() -> None:
    small_kv = CostModel.preset("qwen3-4b", "h200", reserved_bytes=115e9)
    long = dataclasses.replace(SMALL, name="long", prompt_tokens=LogNormal(100_000, 0.1))
    capacity = small_kv.kv_capacity_tokens
    assert capacity < 90_000  # so no prompt of this workload fits
    with pytest.raises(ValueError, match=r"workload 'long': a trajectory reached .* tokens"):
        Simulation(long, sim_policy("venus"), 0, SimConfig(steps=2), small_kv).run()


def test_under_kv_pressure_keeping_tool_waiting_kv_avoids_reprefill() -> None:
    lru = run("async", cost=TIGHT)
    ours = Simulation(
        SMALL, dataclasses.replace(POLICIES["async"], retention="trajectory"), 0,
        SimConfig(steps=3), TIGHT,
    ).run()  # fmt: skip
    assert lru["evictions"] > 0 and lru["reprefill_tokens"] > 0
    assert ours["reprefill_evicted_tokens"] == 0  # offloaded to host instead
    assert ours["offloaded_bytes"] > 0 and ours["host_hit_tokens"] > 0
    # A turn back from its tool call finds its KV, so it waits less for its first token.
    waits = [r["tool_return_wait_s"] / r["tool_returns"] for r in (lru, ours)]
    assert lru["tool_returns"] > 0 and ours["tool_returns"] > 0 and waits[1] < waits[0]
    # Where rollout time went: shares of it that add up, re-prefill only where KV was lost.
    for result in (lru, ours):
        assert sum(result["rollout_gpu_time"].values()) == pytest.approx(1.0)
        assert result["rollout_gpu_time"]["idle"] == pytest.approx(1 - result["gpu_busy"])
    assert lru["rollout_gpu_time"]["reprefill"] > 0 == ours["rollout_gpu_time"]["reprefill"]
    assert ours["rollout_gpu_time"]["transfers"] > 0 == lru["rollout_gpu_time"]["transfers"]


def test_infrastructure_failures_are_replaced_and_the_run_completes() -> None:
    flaky = dataclasses.replace(SMALL, infra_failure_rate=0.3)
    result = run("venus", workload=flaky)
    assert result["steps"] == 3
    assert result["infra_failures"] > 0


def test_every_policy_gets_speedups_against_the_others() -> None:
    results = simulate(SMALL, [POLICIES[p] for p in ("sync", "async", "venus")], 0,
                       SimConfig(steps=3))  # fmt: skip
    by_name = {r["policy"]: r for r in results}
    ours, sync = by_name["venus"], by_name["sync"]
    assert ours["speedup_vs_sync"] == pytest.approx(sync["mean_step_s"] / ours["mean_step_s"])
    assert "speedup_vs_async" in sync
    # The same ratio over the whole run, to the last step (the first one included).
    assert ours["run_s"] > 2 * ours["mean_step_s"]
    assert ours["run_speedup_vs_sync"] == pytest.approx(sync["run_s"] / ours["run_s"])
    # And per token trained: a batch of longer trajectories takes longer to train.
    per_token = sync["s_per_trained_mtoken"] / ours["s_per_trained_mtoken"]
    assert ours["token_speedup_vs_sync"] == pytest.approx(per_token)


def test_offloading_stops_at_the_host_memory_and_what_does_not_fit_is_dropped() -> None:
    no_host = dataclasses.replace(TIGHT, host_kv_bytes_per_gpu=0.0)
    for policy in (POLICIES["venus"], UNWINDOWED):
        roomy_host = run(policy, cost=TIGHT)
        full_host = run(policy, cost=no_host)
        assert roomy_host["offloaded_bytes"] > 0 and roomy_host["reprefill_tokens"] == 0
        assert full_host["offloaded_bytes"] == 0 and full_host["reprefill_tokens"] > 0
    # Computing the dropped KV again costs GPU time that loading it back did not (with every
    # trajectory admitted: the KV window would pause agents rather than compute theirs again).
    assert full_host["gpu_busy"] > roomy_host["gpu_busy"]


@pytest.mark.parametrize("host", [True, False])
def test_the_simulated_kv_keeps_its_books_through_every_offload_load_and_drop(
    host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = 0

    def checked(method: Callable[..., Any]) -> Callable[..., Any]:
        def run_and_check(kv: SimKV, *args: Any, **kwargs: Any) -> Any:
            nonlocal checks
            out = method(kv, *args, **kwargs)
            kv.check()
            checks += 1
            return out

        return run_and_check

    for name in ("load", "admit", "release", "make_room", "owner_finished"):
        monkeypatch.setattr(SimKV, name, checked(getattr(SimKV, name)))
    cost = TIGHT if host else dataclasses.replace(TIGHT, host_kv_bytes_per_gpu=0.0)
    result = run("venus", cost=cost)
    assert result["steps"] == 3 and checks > 1000
    assert (result["offloaded_bytes"] > 0) == host and result["evictions"] > 0


@pytest.mark.parametrize("policy", [POLICIES["concur"], START_WINDOW], ids=lambda p: p.name)
def test_admission_control_holds_trajectories_back_and_thrashes_less_than_lru_alone(
    policy: SimPolicy,
) -> None:
    sim = Simulation(SMALL, policy, 0, SimConfig(steps=3), TIGHT)
    admitted = sim.run()
    lru = run("async", cost=TIGHT)
    assert admitted["steps"] == 3
    assert 0 < admitted["reprefill_evicted_tokens"] < lru["reprefill_evicted_tokens"]
    assert all(e.window >= 1 for e in sim.engines)
    assert admitted["knobs"]["admission"]["initial_window"] == 8  # its knobs are printed


def test_concur_pauses_agents_over_its_window_at_turn_boundaries_and_resumes_them_all() -> None:
    concur, window = run("concur", cost=TIGHT), run(START_WINDOW, cost=TIGHT)
    assert concur["admission_pauses"] > 0 == window["admission_pauses"]
    # Every paused trajectory came back: the run trained every step's groups.
    assert concur["steps"] == 3 and concur["groups_dropped"] == 0
    assert concur["reprefill_evicted_tokens"] < window["reprefill_evicted_tokens"]


def test_sandbox_memory_counts_every_sandbox_open_until_the_run_ends() -> None:
    """GB s held is each sandbox's memory over the time it is open, those of trajectories still
    running when the last step is published included (counted from the engines' own record:
    with no admission control and sandboxes up at once, a trajectory is open from its first
    request to the end of its last turn)."""
    rss = 2.0
    workload = SMALL.scaled_for(
        sandbox_start_s=Constant(0.0),
        sandbox_rss_gb=Constant(rss),
        reward_s=Constant(0.0),
        trajectory_limit_s=math.inf,
    )
    sim = Simulation(workload, POLICIES["async"], 0, SimConfig(steps=2), record=True)
    result = sim.run()
    assert sim.submissions is not None and sim.finishes is not None
    finished = {rid: time for time, rid in sim.finishes}
    opened: dict[str, float] = {}
    closed: dict[str, float] = {}
    for s in sim.submissions:
        opened.setdefault(s.trajectory_id, s.time)
        if s.expected_wait_s is None and s.request_id in finished:  # its last turn ended
            closed[s.trajectory_id] = finished[s.request_id]
    end = result["simulated_s"]
    assert len(closed) < len(opened)  # some were still running
    expected = sum(rss * (closed.get(t, end) - start) for t, start in opened.items())
    assert result["sandbox_gb_s"] == pytest.approx(expected, rel=1e-9)
    assert result["sandbox_idle_before_first_turn"] == result["sandbox_idle_between_turns"] == 0


@pytest.mark.parametrize("policy", ["concur", "venus"])
def test_sandbox_memory_idle_between_turns_is_each_turn_s_wait_for_a_place(policy: str) -> None:
    """A turn asks for a place when its tool call returns (the engines' record: its previous
    turn's end, plus a tool call of a known length) and waits until it is submitted; the share
    idle between turns is those waits' memory, the waits still pending at the end included."""
    rss, tool_s = 2.0, 3.0
    workload = SMALL.scaled_for(
        sandbox_rss_gb=Constant(rss),
        tool_s=ToolLatency(Constant(tool_s)),
        trajectory_limit_s=math.inf,
    )
    sim = Simulation(workload, POLICIES[policy], 0, SimConfig(steps=3), TIGHT, record=True)
    result = sim.run()
    assert sim.submissions is not None and sim.finishes is not None
    end, finished = result["simulated_s"], {rid: time for time, rid in sim.finishes}
    submitted = {s.request_id: s for s in sim.submissions}
    waited = 0.0
    for s in sim.submissions:
        if s.expected_wait_s is None or s.request_id not in finished:
            continue  # its trajectory's last turn, or still running
        tid, turn = s.request_id.rsplit("-t", 1)
        asked = finished[s.request_id] + tool_s
        after = submitted.get(f"{tid}-t{int(turn) + 1}")
        if asked < end:
            waited += rss * ((after.time if after else end) - asked)
    assert waited > 0  # admission control held turns back
    assert result["sandbox_idle_between_turns"] == pytest.approx(
        waited / result["sandbox_gb_s"], rel=1e-9
    )
    before = result["sandbox_idle_before_first_turn"]
    assert 0 < before < 1 - result["sandbox_idle_between_turns"]


def test_the_kv_window_pauses_agents_instead_of_thrashing_the_cache() -> None:
    windowed, everyone = run("venus", cost=TIGHT), run(UNWINDOWED, cost=TIGHT)
    assert windowed["steps"] == 3 and windowed["groups_dropped"] == 0
    assert windowed["admission_pauses"] > 0 == everyone["admission_pauses"]
    assert windowed["preemptions"] < everyone["preemptions"]


def test_the_window_counts_the_kv_its_waiting_agents_ask_and_lanes_only_while_it_is_short() -> None:
    sim = Simulation(SMALL, sim_policy("venus"), 0, SimConfig(steps=3), TIGHT)
    assert sim.windows is not None
    windows = sim.windows.book
    lanes: set[float] = set()

    def look() -> None:
        ready = [t for agents in windows.ready.values() for t in agents]
        assert windows.waiting == sum(t.context for t in ready)
        lanes.add(windows.policy.lanes(windows.loads(), windows.waiting).lane)
        if len(sim.step_ends) < 3:
            sim.clock.at(sim.clock.now + 1.0, look)

    sim.clock.at(0.0, look)
    sim.run()
    assert lanes == {windows.policy.lane, 1.0}  # short of KV at times, not always


def test_a_member_moves_to_a_lighter_engine_with_its_kv() -> None:
    moved, stays = run("venus", cost=TIGHT), run("venus[migrate=false]", cost=TIGHT)
    assert moved["migrations"] > 0 == stays["migrations"]
    # Its KV went over the host link to the other engine's host tier, not computed again.
    assert moved["moves_dropped"] == 0 and moved["reprefill_tokens"] == 0


def test_a_trajectory_past_the_harness_limit_ends_as_a_failure_and_the_run_goes_on() -> None:
    slow_tools = dataclasses.replace(SMALL.tool_s, body=LogNormal(20, 0.3))
    limited = dataclasses.replace(SMALL, tool_s=slow_tools, trajectory_limit_s=60.0)
    result = run("venus", workload=limited)
    assert result["steps"] == 3 and result["trajectory_timeouts"] > 0
    unlimited = run("venus", workload=dataclasses.replace(limited, trajectory_limit_s=math.inf))
    assert unlimited["trajectory_timeouts"] == 0


@pytest.mark.parametrize("policy", ["sync", "async", "concur+offload", "venus"])
def test_no_policy_steps_faster_than_the_gpu_work_its_samples_need(policy: str) -> None:
    r = run(policy, cost=TIGHT)
    assert 0 < r["work_floor_step_s"] < r["mean_step_s"]
    assert r["gpu_s_per_floor_s"] > 1  # busy for more than the work its finished samples need


def test_the_floor_s_decode_is_the_engines_own_where_nothing_is_computed_twice() -> None:
    # Iterations free of fixed costs and KV for every agent: a synchronous run (nothing in flight
    # when it ends) decodes exactly its finished trajectories' decode work, no more, no less.
    free = {"gpu.t_fix": 0.0, "gpu.bw_weights": math.inf, "gpu.t_per_request": 0.0}
    cost = CostModel.preset("qwen3-4b", "h200").overridden(free)
    sim = Simulation(SMALL, sim_policy("sync"), 0, SimConfig(steps=3), cost)
    result = sim.run()
    assert result["preemptions"] == 0 and result["reprefill_tokens"] == 0
    decode = dataclasses.replace(sim.finished_work, prefill_s=0.0).gpu_s(cost, max_batch=256)
    assert decode == pytest.approx(sum(e.spent["decode"] for e in sim.engines), rel=1e-9)


def test_the_time_per_trained_sample_not_cut_counts_the_cut_samples_as_lost() -> None:
    slow_tools = dataclasses.replace(SMALL.tool_s, body=LogNormal(20, 0.3))
    limited = dataclasses.replace(SMALL, tool_s=slow_tools, trajectory_limit_s=120.0)
    for workload in (limited, dataclasses.replace(limited, trajectory_limit_s=math.inf)):
        r = run("venus", workload=workload)
        # Steps past the warm-up (1 of 3), each a batch of 4 groups of 4.
        uncut = (1 - r["cut_share_trained"]) * 2 * 4 * 4
        assert r["s_per_uncut_sample"] == pytest.approx(r["mean_step_s"] * 2 / uncut)
    assert 0 < run("venus", workload=limited)["cut_share_trained"] < 1
    assert r["cut_share_trained"] == 0


@pytest.mark.parametrize("baseline", ["sync", "async", "concur"])
def test_a_baseline_with_a_host_tier_re_prefills_less_than_without(baseline: str) -> None:
    plain, offload = run(baseline, cost=TIGHT), run(f"{baseline}+offload", cost=TIGHT)
    assert plain["reprefill_evicted_tokens"] > 0 and plain["offloaded_bytes"] == 0
    assert offload["reprefill_tokens"] < plain["reprefill_tokens"]
    assert offload["offloaded_bytes"] > 0 and offload["host_hit_tokens"] > 0
    # A host tier and nothing else: the same priorities, bound and admission.
    knobs = {**offload["knobs"], "name": baseline, "retention": "lru"}
    assert knobs == plain["knobs"] and offload["knobs"]["retention"] == "trajectory"


def test_a_policy_that_already_offloads_takes_no_offload_suffix() -> None:
    assert sim_policy("concur+offload@2").max_staleness == 2
    with pytest.raises(ValueError, match="venus already offloads to the host tier"):
        sim_policy("venus+offload")


def test_policies_run_side_by_side_in_processes_give_the_figures_of_one_process() -> None:
    policies = [POLICIES[p] for p in ("sync", "async", "venus")]
    alone = simulate(SMALL, policies, seed=3, config=SimConfig(steps=3), jobs=1)
    side_by_side = simulate(SMALL, policies, seed=3, config=SimConfig(steps=3), jobs=3)
    assert side_by_side == alone
    assert alone[2]["speedup_vs_sync"] == alone[0]["mean_step_s"] / alone[2]["mean_step_s"]


def test_a_scheduler_that_stops_reading_the_waiting_queue_early_sees_the_same_requests() -> None:
    # The simulator builds waiting views as the scheduler reads them; a scheduler that reads the
    # whole queue, in order or by index, sees what an eagerly built snapshot would hold.
    seen: list[tuple[list, list]] = []

    class ReadsEverything(PriorityScheduler):
        def schedule(self, snap):  # type: ignore[no-untyped-def]
            iterated = list(snap.waiting)
            indexed = [snap.waiting[i] for i in range(len(snap.waiting))]
            seen.append((iterated, indexed))
            assert snap.waiting[-1:] == iterated[-1:] and snap.waiting[:] == iterated
            return super().schedule(snap)

    sim = Simulation(SMALL, POLICIES["venus"], 0, SimConfig(steps=2))
    for engine in sim.engines:
        engine.scheduler = ReadsEverything()
    assert sim.run() == run("venus", steps=2)
    assert any(len(iterated) > 1 for iterated, _ in seen)
    assert all(iterated == indexed for iterated, indexed in seen)


@pytest.mark.parametrize("policy", ["async", "concur", "venus"])
def test_engines_never_hold_more_kv_pages_than_the_device_has(policy: str) -> None:
    # The simulator asserts it before planning every iteration (merged decode iterations once
    # took a page more than there was); here the device must also have filled up.
    assert 0.95 < run(policy, cost=TIGHT)["kv_peak_occupancy"] <= 1


@pytest.mark.parametrize("policy", ["sync", "concur", "venus"])
def test_iterations_run_as_one_event_give_the_figures_of_deciding_every_one(policy: str) -> None:
    # Decode iterations until an action ends and prefill chunks that fill the token budget run
    # without asking the scheduler, in events of many iterations; the figures are the same as
    # when every iteration is a decision (up to float rounding in accumulated seconds).
    def figures(decide_every_iteration: bool) -> dict:
        config = SimConfig(steps=2, decide_every_iteration=decide_every_iteration)
        return Simulation(SMALL, sim_policy(policy), 1, config, TIGHT).run()

    merged, decided = figures(False), figures(True)
    assert merged.pop("decisions") * 10 < decided.pop("decisions")
    assert merged["evictions"] > 0 and merged["preemptions"] > 0
    for key, value in decided.items():
        if isinstance(value, float) or (isinstance(value, dict) and key != "knobs"):
            assert merged[key] == pytest.approx(value, rel=1e-9), key
        else:
            assert merged[key] == value, key


@pytest.mark.parametrize("policy", ["async", "venus"])
def test_draining_engines_for_new_weights_waits_on_the_turns_in_flight(policy: str) -> None:
    """`weight_update=drain`: each engine runs its turns in flight to their end, admitting none,
    before the weights load; `keep` loads between two iterations. Same work, same weights."""
    # Long enough episodes, and rewards short enough, that turns are in flight when a step's
    # weights are published.
    workload = SMALL.scaled_for(
        name="swe-small-long",
        turns=Turns("lognormal", LogNormal(30, 0.35)),
        reward_s=LogNormal(0.5, 0.5),
    )
    runs = {
        mode: Simulation(
            workload, sim_policy(policy), 0, SimConfig(steps=4, weight_update=mode)
        ).run()
        for mode in ("keep", "drain")
    }
    keep, drain = runs["keep"], runs["drain"]
    assert keep["drain_s_per_step"] == 0 < drain["drain_s_per_step"]
    assert drain["steps"] == keep["steps"] == 4 and drain["groups_dropped"] == 0
    assert drain["weight_sync_s_per_step"] == keep["weight_sync_s_per_step"]
    assert drain["mean_step_s"] != keep["mean_step_s"]


def test_flushing_the_cache_for_new_weights_makes_agents_between_turns_compute_it_again() -> None:
    """`weight_update=flush` (vLLM's and SGLang's cache reset after an update): the KV of
    trajectories waiting on a tool is gone, and their next turns compute it again; `keep`
    keeps it. Both load at the same moments."""
    workload = SMALL.scaled_for(
        name="swe-small-long", turns=Turns("lognormal", LogNormal(30, 0.35))
    )
    runs = {
        mode: Simulation(
            workload, sim_policy("venus"), 0, SimConfig(steps=4, weight_update=mode)
        ).run()
        for mode in ("keep", "flush")
    }
    keep, flush = runs["keep"], runs["flush"]
    assert flush["reprefill_evicted_tokens"] > keep["reprefill_evicted_tokens"]
    assert flush["drain_s_per_step"] == keep["drain_s_per_step"] == 0
    assert flush["steps"] == keep["steps"] == 4 and flush["groups_dropped"] == 0


def test_an_unknown_weight_update_mode_is_refused() -> None:
    with pytest.raises(
        ValueError, match="weight_update must be one of keep, flush, drain, got 'pause'"
    ):
        SimConfig(weight_update="pause")


def test_the_graders_bound_holds_and_reward_workers_grade_the_critical_groups_first() -> None:
    # One grader for minute-long rewards: grading is where the batch waits. The reward pool
    # takes the most critical group's trajectory first, so those wait less than the best-effort
    # groups' (inline, every policy of RL frameworks, each waits in the order its turns ended).
    workload = SMALL.scaled_for(reward_workers=1, reward_s=LogNormal(30, 0.5))
    pool = run("venus", workload, steps=4)
    assert pool["graders_peak"] == 1
    waits = pool["grader_wait_s"]
    assert waits["critical"] * 1.2 < waits["best_effort"]
    assert pool["reward_p50_s"] > 30  # a reward's latency counts its wait for the grader
    unbounded = run("venus", SMALL.scaled_for(reward_workers=None), steps=4)
    assert unbounded["graders_peak"] > 1 and max(unbounded["grader_wait_s"].values()) == 0


def test_a_trajectory_waiting_for_a_grader_holds_no_sandbox_unless_its_reward_reads_it() -> None:
    # Off the rollout's path the episode's sandbox closes as its turns end and the grader opens
    # a fresh one (SWE-bench's grading); inline, or when the reward reads the episode's sandbox,
    # the sandbox waits with it.
    workload = SMALL.scaled_for(reward_workers=1, reward_s=LogNormal(30, 0.5))
    inline = run("venus[reward_pool=false]", workload, steps=4)
    pool = run("venus", workload, steps=4)
    reads = run("venus", workload.scaled_for(reward_reads_sandbox=True), steps=4)
    per_step = {k: r["sandbox_gb_s"] / r["simulated_s"] for k, r in
                (("inline", inline), ("pool", pool), ("reads", reads))}  # fmt: skip
    assert per_step["pool"] < 0.8 * per_step["inline"]
    assert per_step["pool"] < 0.8 * per_step["reads"]
