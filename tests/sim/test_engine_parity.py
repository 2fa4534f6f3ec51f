"""The simulator makes the engine's decisions.

One small workload is simulated, and every request the simulated engine received is replayed,
at the same virtual times, on the real engine (a random-weight Qwen3 on CPU) with the same
policies. The plans of the scheduler (who runs how many tokens, who is admitted, who is
preempted), the evictions (whose KV, how much, offloaded or dropped), when each action finished
and the cache counters must be the same: the simulator executes the policy objects on the
state the engine would have, not copies of them. The simulator is checked twice: asking the
scheduler at every iteration, when its plans are the engine's one for one, and as it runs by
default, merging iterations whose plan it knows without asking, when each plan it does ask for
is the engine's at that moment and everything else is the same.

Lockstep: the cost model makes every engine iteration take one virtual second and the replay
advances the engine's clock by one second per forward pass. Tool calls, sandbox starts and
rewards take random fractions of seconds, so no event ties with an iteration boundary.

What the simulator leaves out is left out of the workload: a group's members get distinct
prompts here (the simulator does not model prompt sharing) and weight updates are instant.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine
from venusrl.policy.agent_admission import AimdAdmission, ConcurAdmission
from venusrl.policy.engine_schedule import (
    RETRY_AFTER_S,
    EngineSnapshot,
    PriorityScheduler,
    StepPlan,
)
from venusrl.policy.kv_retention import IdleKV, RetentionPolicy
from venusrl.policy.kv_window import CriticalWindow
from venusrl.sim.cost_model import CostModel, GpuSpec, ModelSpec
from venusrl.sim.executor import Simulation, Submission
from venusrl.sim.policies import POLICIES, SimPolicy
from venusrl.sim.types import Counters, SimConfig
from venusrl.types import SamplingParams, TurnMeta
from venusrl.workloads import LogNormal, ToolLatency, Turns, Workload

PAGE = 4
DEVICE_PAGES = 40  # 160 tokens: about three trajectories at their longest
HOST_PAGES = 24
TOKEN_BUDGET = 24
MAX_RUNNING = 6

WORKLOAD = Workload(
    "parity",
    rollout_gpus=1,
    train_gpus=1,
    prompts_per_batch=2,
    group_size=3,
    turn_cap=5,
    context_cap=120,
    turns=Turns("poisson", mean=2.0),
    prompt_tokens=LogNormal(24, 0.4, 6, 60),
    action_tokens=LogNormal(5, 0.6, 1, 16),
    observation_tokens=LogNormal(10, 0.7, 1, 40),
    template_tokens=3,
    tool_s=ToolLatency(LogNormal(6, 0.7)),
    sandbox_start_s=LogNormal(1.5, 0.5),
    reward_s=LogNormal(1.0, 0.5),
    infra_failure_rate=0.0,
)

# KV of 4 bytes a token, no weights to read, infinite FLOPs and bandwidth: an iteration costs
# its fixed second and nothing else; copies and weight updates are free.
ONE_SECOND_ITERATIONS = CostModel(
    ModelSpec("lockstep", params=0.0, layers=1, q_heads=1, kv_heads=1, head_dim=1),
    GpuSpec("lockstep", hbm_bytes=DEVICE_PAGES * PAGE * 4.0, bw_weights=math.inf,
            bw_kv=math.inf, f_gemm=math.inf, f_attn=math.inf, peak_flops=1e6,
            pcie_h2d=math.inf, pcie_d2h=math.inf, t_fix=1.0),
    reserved_bytes=0.0,
    memory_fraction=1.0,
    transfer_latency_s=0.0,
    host_kv_bytes_per_gpu=HOST_PAGES * PAGE * 4.0,
    weight_sync_fixed_s=0.0,
)  # fmt: skip

SIM_CONFIG = SimConfig(
    steps=3,
    decide_every_iteration=True,
    page_size=PAGE,
    token_budget=TOKEN_BUDGET,
    max_running=MAX_RUNNING,
    waiting_head=2 * MAX_RUNNING,  # the head the engine shows its scheduler
)


class Decisions:
    """What the policies decided, and when: the scheduler's plans and the evictions."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.plans: list[tuple[float, StepPlan]] = []
        self.evictions: list[tuple[float, str, int, bool]] = []

    def plans_before(self, until: float) -> list[tuple[float, StepPlan]]:
        return [(round(t, 6), plan) for t, plan in self.plans if t < until]


class RecordingScheduler(PriorityScheduler):
    def __init__(self, decisions: Decisions) -> None:
        self.decisions = decisions

    def schedule(self, snap: EngineSnapshot) -> StepPlan:
        plan = super().schedule(snap)
        if plan.run or plan.preempt:
            self.decisions.plans.append((self.decisions.now(), plan))
        return plan


class RecordingRetention:
    """The run's retention policy, noting every eviction it is asked about (the engine and the
    simulator ask once per evicted radix node)."""

    def __init__(self, policy: RetentionPolicy, decisions: Decisions) -> None:
        self.policy, self.decisions = policy, decisions

    def rank(self, entry: IdleKV, now: float) -> tuple[int, float]:
        return self.policy.rank(entry, now)

    def reserved(self, entry: IdleKV, now: float) -> bool:
        return self.policy.reserved(entry, now)

    def offload(self, entry: IdleKV, now: float) -> bool:
        offload = self.policy.offload(entry, now)
        # A finished trajectory's KV has no live owner left in the engine's tree to name it.
        owner = "(finished)" if entry.finished else entry.key
        self.decisions.evictions.append((round(now, 6), owner, entry.tokens, offload))
        return offload


# The named policies, and the simulated twins of `venusrl train`'s other admission settings.
TWINS: dict[str, SimPolicy] = {
    **POLICIES,
    "async+aimd": dataclasses.replace(POLICIES["async"], admission=AimdAdmission()),
    "venus+none": dataclasses.replace(POLICIES["venus"], admission=None),
}


def simulate(policy: str, seed: int, merged: bool = False) -> tuple[Simulation, Decisions]:
    """`merged`: as the simulator runs by default, asking the scheduler only when it cannot
    know the plan."""
    # A pin of 4.5 s rather than 5: whole seconds would expire exactly on iteration boundaries.
    # So would Concur's control periods, whose window follows the occupancy they read: whether
    # a period at the time an iteration ends sees it ended depends on when each event was
    # scheduled, which merged iterations change.
    sim_policy = dataclasses.replace(TWINS[policy], pin_s=4.5)
    # And so would the KV window's end of a member's place in a long tool call: 1.1 median
    # calls, a random fraction of seconds (the tools take ~6 s here; with a shorter wait so
    # many members leave that none has to pause at a turn, which the test wants to see).
    admission = sim_policy.admission
    if isinstance(admission, ConcurAdmission):
        admission = dataclasses.replace(admission, period_s=4.7)
    elif isinstance(admission, CriticalWindow):
        admission = dataclasses.replace(admission, leave_after_calls=1.1)
    sim_policy = dataclasses.replace(sim_policy, admission=admission)
    config = dataclasses.replace(SIM_CONFIG, decide_every_iteration=not merged)
    sim = Simulation(WORKLOAD, sim_policy, seed, config, ONE_SECOND_ITERATIONS, record=True)
    decisions = Decisions(lambda: sim.clock.now)
    (engine,) = sim.engines
    engine.scheduler = RecordingScheduler(decisions)
    engine.kv.retention = RecordingRetention(engine.kv.retention, decisions)
    sim.run()
    return sim, decisions


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def forward_pass(self, *_: Any) -> None:
        self.now += 1.0


def replay(
    model_dir: Path, retention: str, submissions: list[Submission], until: float, seed: int
) -> tuple[Engine, Decisions, list[tuple[float, str]]]:
    """Runs the requests on the real engine at their times; returns it, its decisions and when
    each action finished."""
    clock = VirtualClock()
    decisions = Decisions(clock)
    config = EngineConfig(
        page_size=PAGE,
        device_kv_pages=DEVICE_PAGES + 1,  # page 0 is the engine's padding page
        host_kv_pages=HOST_PAGES,
        retention=retention,  # type: ignore[arg-type]
        max_running=MAX_RUNNING,
        token_budget=TOKEN_BUDGET,
        max_context=DEVICE_PAGES * PAGE,
    )
    engine = Engine.from_model_dir(model_dir, config, clock)
    engine.scheduler = RecordingScheduler(decisions)
    engine.cache.retention = RecordingRetention(engine.cache.retention, decisions)
    engine.model.norm.register_forward_hook(clock.forward_pass)  # once per forward pass

    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    records: dict[str, list[int]] = {}
    ends: set[str] = set()
    finishes: list[tuple[float, str]] = []
    pending = deque(submissions)
    while clock.now < until and (pending or engine.has_work()):
        while pending and pending[0].time <= clock.now:
            s = pending.popleft()
            record = list(records.get(s.trajectory_id, []))
            # The prompt, or the observation after the record: fresh tokens up to its length.
            record += [rng.randrange(2, vocab) for _ in range(s.context_tokens - len(record))]
            params = SamplingParams(max_tokens=s.action_tokens, temperature=0, ignore_eos=True)
            engine.add_request(
                record,
                params,
                TurnMeta(
                    priority=s.priority,
                    trajectory_id=s.trajectory_id,
                    expected_wait_s=s.expected_wait_s,
                ),
                request_id=s.request_id,
            )
            if s.expected_wait_s is None:
                ends.add(s.request_id)
        steps, plans = engine.stats.steps, len(decisions.plans)
        for r in engine.step():
            finishes.append((clock.now, r.request_id))
            records[r.trajectory_id or ""] = r.all_ids
            if r.request_id in ends:
                engine.end_trajectory(r.trajectory_id or "")
        engine.check()
        if engine.stats.steps == steps:  # nothing ran: wait as the engine loop does
            later = [pending[0].time] if pending else []
            if len(decisions.plans) > plans:  # what was planned lost its pages: retry soon
                clock.now = min([clock.now + RETRY_AFTER_S, *later])
                continue
            pins = [
                t.pin_deadline
                for t in engine.cache.trajectories.values()
                if t.pin_deadline is not None and t.pin_deadline > clock.now
            ]
            assert later or pins, "the engine stalled with nothing left to wait for"
            clock.now = min(later + pins)
    return engine, decisions, finishes


@pytest.mark.parametrize(
    ("policy", "seed"),
    [
        ("sync", 0),
        ("async", 1),
        ("concur", 2),
        ("async+aimd", 2),
        ("venus", 0),
        ("venus", 3),
        ("venus+none", 0),
    ],
)
def test_the_simulator_decides_what_the_engine_decides_on_the_same_events(
    tiny_qwen3: Path, policy: str, seed: int
) -> None:
    sim, expected = simulate(policy, seed)
    assert sim.submissions is not None and sim.finishes is not None
    end = sim.clock.now
    engine, actual, finishes = replay(
        tiny_qwen3, TWINS[policy].retention, sim.submissions, end, seed
    )

    c = sim.counters
    # The workload puts the policies under pressure: there is something to decide. The KV
    # window admits no more than the device holds, so it preempts nothing: it pauses agents.
    assert c.evictions > 0, c
    if sim.windows is None:
        assert c.preemptions > 0, c
    else:
        assert sim.windows.book.pauses > 0, c
    if TWINS[policy].retention == "trajectory":
        assert c.host_hit_tokens > 0, c

    sim_plans, engine_plans = expected.plans_before(end), actual.plans_before(end)
    for i, (s, e) in enumerate(zip(sim_plans, engine_plans, strict=False)):
        assert s == e, f"decision {i} differs: simulator {s}, engine {e}"
    assert len(sim_plans) == len(engine_plans)
    evictions = [e for e in actual.evictions if e[0] < end]
    assert [e for e in expected.evictions if e[0] < end] == evictions
    # Both before the end: the simulator stops at its last event, which may be a turn's end
    # that the engine's replay, stepping past it, records and the simulator has not yet.
    finished = [(round(t, 6), r) for t, r in finishes if t < end]
    assert [(round(t, 6), r) for t, r in sim.finishes if t < end] == finished

    # By default the simulator asks for fewer plans, each the engine's at that moment; what
    # happens is the same.
    merged, asked = simulate(policy, seed, merged=True)
    assert merged.finishes is not None
    merged_plans = asked.plans_before(end)
    assert len(merged_plans) < len(engine_plans)
    assert not set(merged_plans) - set(engine_plans)
    assert [e for e in asked.evictions if e[0] < end] == evictions
    assert [(round(t, 6), r) for t, r in merged.finishes if t < end] == finished
    assert dataclasses.replace(merged.counters, iterations=0, decisions=0) == dataclasses.replace(
        c, iterations=0, decisions=0
    )
    # The same totals under the same names. Bytes are not compared (the simulator prices KV
    # by its cluster model's size), nor the tool-return wait: the replay's forward passes take
    # no time on its clock, the simulator's take what its cost model says.
    counted = engine.counters()
    for key in ("preemptions", "device_hit_tokens", "host_hit_tokens", "tool_returns",
                "reprefill_evicted_tokens", "reprefill_preempted_tokens"):  # fmt: skip
        assert counted[key] == getattr(c, key), key
    assert c.tool_returns > 0


SIMULATOR_ONLY = {"reprefill_tokens", "evictions", "iterations", "decisions", "moves_dropped"}


def test_the_simulator_names_its_counters_as_the_engine_does(tiny_qwen3: Path) -> None:
    """A simulated run's counters read as a real run's: each shared total under the engine's
    name (`Engine.counters`), so a figure can be compared key by key."""
    engine = Engine.from_model_dir(tiny_qwen3, EngineConfig(page_size=PAGE, device_kv_pages=1024))
    shared = {f.name for f in dataclasses.fields(Counters)} - SIMULATOR_ONLY
    assert shared <= set(engine.counters()), shared - set(engine.counters())
