"""The KV window decides the same in the simulator and in `venusrl train`.

One seeded sequence of events (turns asking to run with growing contexts, turns ending, long tool
waits, episodes ending, the ranking changing) goes to both adapters of the one window book: the
simulator's (`sim.kv_windows.KvWindows` over simulated engines) and the runtime's
(`coordinator.admission.TurnWindow`, its turns real asyncio tasks waiting for their place). After
every event the turns each let run, and on which engine, must be the same, and so must each
engine's members and the KV they count, the turns still waiting and the pauses and migrations.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from venusrl.coordinator.admission import TurnWindow
from venusrl.policy.critical_groups import BEST_EFFORT, HIGH
from venusrl.policy.kv_window import CriticalWindow
from venusrl.sim.engine import SimEngine
from venusrl.sim.executor import Simulation
from venusrl.sim.kv_windows import KvWindows
from venusrl.sim.policies import POLICIES
from venusrl.sim.types import SimConfig
from venusrl.workloads import SCENARIOS

GROUPS, MEMBERS, EVENTS = 12, 4, 600


@dataclass(eq=False)
class Played:
    """A trajectory as the simulator's adapter sees it."""

    tid: str
    group_id: str
    context: int = 0
    engine: SimEngine | None = None


def simulated_engines(n: int) -> list[SimEngine]:
    workload = SCENARIOS["swe-short"].scaled_for(name="parity", rollout_gpus=n, train_gpus=1)
    return Simulation(workload, POLICIES["venus"], 0, SimConfig(steps=1)).engines


def replay_both(engines: int, policy: CriticalWindow, seed: int) -> tuple[int, int, int]:
    """Plays the events on both adapters, asserting they agree after each; the pauses,
    migrations and turns that waited, as they counted them."""
    sim_engines = simulated_engines(engines)
    capacity = sim_engines[0].capacity * sim_engines[0].page_size
    rng = random.Random(seed)
    let_go: list[tuple[str, int]] = []
    sim = KvWindows(policy, sim_engines, lambda t, _: let_go.append((t.tid, t.engine.index)))
    played = {
        f"g{g}-m{m}": Played(f"g{g}-m{m}", f"g{g}") for g in range(GROUPS) for m in range(MEMBERS)
    }
    state = dict.fromkeys(played, "new")  # new, asking, running, tool, ended

    async def main() -> None:
        runtime = TurnWindow(policy, [capacity] * engines)
        asking: dict[str, asyncio.Task[int]] = {}

        def ask(tid: str) -> None:
            t = played[tid]
            t.context += rng.randint(capacity // 60, capacity // 8)
            sim.turn(t)
            asking[tid] = asyncio.create_task(runtime.enter(tid, t.group_id, t.context))
            state[tid] = "asking"

        def rank() -> None:
            groups = sorted({t.group_id for tid, t in played.items() if state[tid] != "ended"})
            rng.shuffle(groups)
            priorities = {g: HIGH if rng.random() < 0.4 else BEST_EFFORT for g in groups}
            sim.reranked(priorities)
            runtime.set_ranking(priorities)

        rank()
        for _ in range(EVENTS):
            event = rng.choice(["ask", "ask", "done", "done", "long", "end", "rank"])
            by_state = {s: [tid for tid in played if state[tid] == s] for s in ("new", "tool")}
            running = [tid for tid in played if state[tid] == "running"]
            if event == "ask" and (by_state["new"] or by_state["tool"]):
                ask(rng.choice(by_state["tool"] or by_state["new"]))
            elif event == "done" and running:
                tid = rng.choice(running)
                runtime.turn_done(tid)
                state[tid] = "tool"
            elif event == "long" and by_state["tool"]:
                tid = rng.choice(by_state["tool"])
                sim.tool_wait_over(played[tid])
                runtime.tool_wait_over(tid)
            elif event == "end" and by_state["tool"]:
                tid = rng.choice(by_state["tool"])
                sim.end(played[tid])
                runtime.end(tid)
                state[tid] = "ended"
            elif event == "rank":
                rank()
            for _ in range(4):  # the released turns run on
                await asyncio.sleep(0)
            ran = sorted((tid, task.result()) for tid, task in asking.items() if task.done())
            assert sorted(let_go) == ran, f"event {event}"
            for tid, _ in ran:
                del asking[tid]
                state[tid] = "running"
            let_go.clear()
            a, b = sim.book, runtime.book
            assert a.load == b.load and a.critical_load == b.critical_load
            assert [{s.tid for s in m} for m in a.members] == [
                {s.tid for s in m} for m in b.members
            ]
            assert sorted(asking) == sorted(runtime.waiting)
            assert (a.pauses, a.migrations, a.waits) == (b.pauses, b.migrations, b.waits)
        for task in asking.values():
            task.cancel()

    asyncio.run(main())
    return sim.book.pauses, sim.book.migrations, sim.book.waits


# Tool waits leave only when the events say so: the runtime's own timer never fires here.
OURS = CriticalWindow(leave_after_calls=1e6)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_engine_runs_the_simulators_window_decision_for_decision(seed: int) -> None:
    pauses, migrations, waits = replay_both(1, OURS, seed)
    assert pauses > 0 and waits > 0 and migrations == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_several_engines_run_the_simulators_window_with_its_migrations(seed: int) -> None:
    pauses, migrations, waits = replay_both(3, OURS, seed)
    assert pauses > 0 and waits > 0 and migrations > 0


def test_several_engines_without_migration_keep_each_member_on_its_first_engine() -> None:
    _, migrations, waits = replay_both(3, CriticalWindow(leave_after_calls=1e6, migrate=False), 0)
    assert migrations == 0 and waits > 0
