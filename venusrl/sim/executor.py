"""A discrete-event executor of venusrl's scheduling policies at cluster scale.

Time is virtual: engine iterations, tool calls, sandbox starts, rewards, trainer steps and weight
syncs take what the cost model and the workload say, and nothing runs for real. What decides is
real: the coordinator's books of its groups (`coordinator.group_book`, with the group ranking of
`policy.critical_groups` and the staleness bound of `policy.staleness`), the engines' batch
scheduler (`policy.engine_schedule.PriorityScheduler`, the object the engine runs) and the KV
retention policy (`policy.kv_retention`), each called with snapshots built from the simulated
state (DESIGN.md contract 1).

Each rollout engine is a `venusrl.sim.engine.SimEngine`: `venusrl.engine.Engine`'s scheduling
and KV bookkeeping on this clock, checked against the real engine by
`tests/sim/test_engine_parity.py`.

Simplifications (each a bias the same for every policy): a group's members do not share their
prompt's KV (it is 3 % of a swe-long context); a trajectory's KV survives weight updates (as on
the engine, whose version salt only keeps trajectories started later from reading it);
sandboxes are charged their whole RSS, unshared.
"""

from __future__ import annotations

import functools
import itertools
import math
import multiprocessing
import os
import signal
import statistics
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from venusrl.coordinator.group_book import GroupBook
from venusrl.policy.agent_admission import (
    AgentAdmission,
    AimdAdmission,
    CacheSignal,
    ConcurAdmission,
)
from venusrl.policy.critical_groups import TurnRates, critical, reward_rank
from venusrl.policy.engine_schedule import (
    PriorityScheduler,
)
from venusrl.policy.kv_retention import (
    LruRetention,
    RetentionPolicy,
    TrajectoryRetention,
)
from venusrl.policy.kv_window import CriticalWindow
from venusrl.policy.placement import least_loaded
from venusrl.policy.staleness import StalenessBound
from venusrl.sim.cost_model import CostModel
from venusrl.sim.engine import SPENT_ON, SimEngine
from venusrl.sim.kv_windows import KvWindows
from venusrl.sim.policies import SimPolicy
from venusrl.sim.report import quantile, speedups
from venusrl.sim.types import Clock, Counters, SimConfig, SimRequest
from venusrl.sim.work_floor import Work, floor_step_s, trajectory_work
from venusrl.types import Progress
from venusrl.workloads import PromptPlan, TrajectoryPlan, Workload, WorkloadSampler


@dataclass(frozen=True)
class TrainedBatch:
    """A trainer step's batch: how long it trained, each group's staleness, its tokens and
    sequences, and of those the ones the harness cut at its time limit."""

    seconds: float
    staleness: list[int]
    tokens: int
    sequences: int
    cut: int
    work: Work  # the least rollout GPU work its samples need (`work_floor`)


@dataclass
class SandboxTime:
    """Sandbox memory held over the run, GB s: in all, and of it idle while a turn waited for a
    place in admission control, before a trajectory's first turn and between later ones."""

    held: float = 0.0
    before_first_turn: float = 0.0
    between_turns: float = 0.0

    def waited(self, turn: int, gb_s: float) -> None:
        if turn == 0:
            self.before_first_turn += gb_s
        else:
            self.between_turns += gb_s


@dataclass(eq=False)
class SimGroup:
    """What the simulator keeps of a GRPO group beside its books (`GroupBook`): the prompt and
    its members' attempts, each retried on an infrastructure failure."""

    gid: str
    prompt: PromptPlan
    started_at: float
    attempts: list[int]
    tokens: int = 0  # of the finished trajectories, for the trainer's cost
    sequences: int = 0
    cut: int = 0  # of them, those the harness cut at its time limit
    work: Work = field(default_factory=Work)  # of them, the least GPU work (`work_floor`)


@dataclass(eq=False)
class SimTrajectory:
    """One attempt at a member's episode: its plan drawn from the workload, played turn by turn
    on the engine it was routed to."""

    tid: str
    group: SimGroup
    index: int
    plan: TrajectoryPlan
    started_at: float
    turn: int = 0
    context: int = 0  # tokens of the record so far (a running request's, when it lets go)
    generated: int = 0
    tool_s: float = 0.0  # its tool calls' seconds so far
    engine: SimEngine | None = None
    expected_cached: int = 0  # tokens of its context the engine cached when it last let go of it
    # When its latest turn went to the engine, and in which `Simulation._phase`.
    submitted: tuple[float, str] = (0.0, "")
    asked_at: float | None = None  # when its turn asked for a place (None: not asking now)
    requested_at: float = 0.0  # when its current turn was asked for (the agent loop's request)
    # Each turn played as the coordinator's rates read it: the model's tokens, the seconds from
    # the request to the last of them, the tool call's seconds where another turn followed.
    played: list[tuple[int, float, float | None]] = field(default_factory=list)
    turns_over_at: float | None = None  # when its last turn ended (its reward since)
    critical_at_end: bool = False  # its group was critical then
    graded_from: float | None = None  # when a grader took it
    # When its sandbox closed before its reward (a reward worker grades it in a fresh one).
    sandbox_closed_at: float | None = None
    let_go: bool = False  # it gave up its engine's count and its KV-window place

    @property
    def group_id(self) -> str:
        return self.group.gid

    def progress(self) -> Progress:
        """Its report after its current turn's tokens (its tool call not returned yet)."""
        return Progress(self.generated, self.turn + 1, self.turn, self.tool_s)


@dataclass(frozen=True)
class Submission:
    """A request as an engine receives it, for replaying a simulated run on a real engine."""

    time: float
    engine: int
    request_id: str
    trajectory_id: str
    context_tokens: int  # the prompt: the trajectory's whole record so far
    action_tokens: int  # tokens to generate
    priority: int
    expected_wait_s: float | None  # the tool wait after it (None: the trajectory ends with it)


class Simulation:
    def __init__(
        self,
        workload: Workload,
        policy: SimPolicy,
        seed: int = 0,
        config: SimConfig | None = None,
        cost: CostModel | None = None,
        record: bool = False,
    ) -> None:
        """`record`: keep every request the engines receive (`submissions`) and when each
        finished (`finishes`), to replay the run on a real engine."""
        w = self.workload = workload
        self.policy = policy
        self.config = config or SimConfig()
        self.cost = cost or workload_cost(w)
        self.clock = Clock()
        self.sampler = WorkloadSampler(w, seed)
        bound = StalenessBound(
            w.prompts_per_batch,
            policy.max_staleness,
            policy.max_train_staleness,
            policy.release_overtaken,
        )
        if w.rollout_gpus % w.tp:
            raise ValueError(f"rollout_gpus {w.rollout_gpus} is not a multiple of tp {w.tp}")
        self.counters = Counters()
        self.engines = [self._engine(i) for i in range(w.rollout_gpus // w.tp)]
        self.submissions: list[Submission] | None = [] if record else None
        self.finishes: list[tuple[float, str]] | None = [] if record else None
        self.version = 0
        self.trainer_busy = False
        self._training: TrainedBatch | None = None  # the step in flight
        self.trained: list[TrainedBatch] = []  # of each step published
        self.weight_sync_s = 0.0  # engines paused for new weights, all steps
        self.drain_s = 0.0  # of which: waiting for turns in flight (weight_update=drain)
        self.step_ends: list[float] = []
        self.batch_waits: list[float] = []  # from new weights out to the next batch taken
        # Turns by when and for whom they ran (`_phase`): count, seconds and tokens.
        self.turn_speed: dict[str, list[float]] = {}
        self.group_completion_s: list[float] = []
        self.sandboxes = SandboxTime()
        self._open: dict[str, SimTrajectory] = {}  # trajectories started and not ended, by id
        self.infra_failures = 0
        self.timeouts = 0  # trajectories cut at the workload's trajectory_limit_s
        self.finished_work = Work()  # of every trajectory finished (`work_floor`)
        # Trajectories whose turns are over, waiting for a grader; graders busy; each reward's
        # seconds from the last turn (queue and grading).
        self._to_grade: list[SimTrajectory] = []
        self._grading = 0
        self.graders_peak = 0
        self.reward_s: list[float] = []
        # Seconds each waited for a grader, by whether its group was critical as its turns ended.
        self.grader_waits: dict[str, list[float]] = {}
        self._arrivals = itertools.count()
        # First turns held back by admission control, and per engine the trajectories it paused
        # at a turn boundary (oldest first).
        self._not_admitted: deque[SimTrajectory] = deque()
        self._paused: list[deque[SimTrajectory]] = [deque() for _ in self.engines]
        self.admission_pauses = 0
        self._control_due = False  # a control period of admission control is scheduled
        # What the group ranking assumes of a trajectory until the run's own turns and rewards
        # say otherwise (learned as the coordinator learns them, `_end_trajectory`): its decode
        # speed on a loaded engine (a batch of its share of the trajectories, each at half its
        # final context on average), the median tool call and reward, from draws of the workload.
        probe = WorkloadSampler(w, seed=-1)
        plans = [probe.trajectory(probe.next_prompt(), 0) for _ in range(64)]
        contexts = [
            p.prompt_tokens + sum(t.action_tokens + t.observation_tokens for t in p.turns) / 2
            for p in plans
        ]
        batch = max(1, round(w.prompts_per_batch * w.group_size / len(self.engines)))
        step_s = self.cost.decode_step_s(batch, batch * statistics.fmean(contexts))
        tools = [t.tool_s for p in plans for t in p.turns[:-1]]
        rates = TurnRates(
            1.0 / step_s,
            statistics.median(tools) if tools else 0.0,
            reward_s=statistics.median(p.reward_s for p in plans),
        )
        self.book: GroupBook[SimGroup] = GroupBook(
            bound, policy.priorities, rates, time_limit_s=w.trajectory_limit_s
        )
        # Admission by count (Concur's window, the AIMD start window) or by KV (ours).
        self.windows: KvWindows[SimTrajectory] | None = None
        self.counting: AgentAdmission | None = None
        if isinstance(policy.admission, CriticalWindow):
            self.windows = KvWindows(policy.admission, self.engines, self._submit_turn)
        else:
            self.counting = policy.admission

    def _engine(self, index: int) -> SimEngine:
        """A rollout engine on this run's clock, cost model and counters, with its own scheduler
        and retention policy, as each real engine has."""
        policy, admission = self.policy, self.policy.admission
        retention: RetentionPolicy = (
            TrajectoryRetention() if policy.retention == "trajectory" else LruRetention()
        )
        window = (
            admission.initial_window
            if isinstance(admission, AimdAdmission | ConcurAdmission)
            else 0
        )
        return SimEngine(index, self.clock, self.cost, self.config, PriorityScheduler(),
                         retention, self.counters, window)  # fmt: skip

    # --- the run -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self._launch()
        self._schedule_control()
        self.clock.run(until=lambda: len(self.step_ends) >= self.config.steps)
        if len(self.step_ends) < self.config.steps:
            self._refuse_oversized()
            waiting = sum(len(e.waiting) for e in self.engines)
            raise RuntimeError(
                f"{self.policy.name}: the simulation stalled at t={self.clock.now:.0f} s after"
                f" {len(self.step_ends)} steps, with {waiting} requests waiting and nothing"
                " scheduled (a policy that never admits them)"
            )
        return self.result()

    def _refuse_oversized(self) -> None:
        """A turn whose context is larger than an engine's whole device KV can never run: say so
        as the workload's error, not as a stalled policy."""
        for engine in self.engines:
            requests = [*engine.waiting, *engine.running.values()]
            largest = max((r.traj.context + r.decode_left for r in requests), default=0)
            capacity = engine.capacity * engine.page_size
            if largest > capacity:
                raise ValueError(
                    f"workload {self.workload.name!r}: a trajectory reached {largest:,} tokens of"
                    f" context, more than one engine's KV holds ({capacity:,} tokens for"
                    f" {self.cost.model.name} on tp={self.cost.tp} x {self.cost.gpu.name}):"
                    " lower context_cap (or prompt, action and observation sizes) or raise tp"
                )

    def _launch(self) -> None:
        n = self.book.startable(self.version)
        for _ in range(n):
            self._open_group()
        if n:
            self._rerank()

    def _open_group(self) -> None:
        prompt, k = self.sampler.next_prompt(), self.workload.group_size
        g = SimGroup(f"g{self.book.groups_started}", prompt, self.clock.now, [0] * k)
        self.book.start_group(g.gid, prompt.prompt_id, k, self.version, g, self.clock.now)
        for i in range(k):
            self._start_member(g, i)

    def _start_member(self, g: SimGroup, index: int) -> None:
        if g.attempts[index]:
            self.book.restart_member(g.gid, index)
        plan = self.sampler.trajectory(g.prompt, index, g.attempts[index])
        now = self.clock.now
        t = SimTrajectory(
            f"{g.gid}-m{index}-a{g.attempts[index]}", g, index, plan, now, 0, plan.prompt_tokens
        )
        self._open[t.tid] = t
        self.clock.at(now + plan.sandbox_start_s, lambda: self._request_turn(t))

    def _request_turn(self, t: SimTrajectory) -> None:
        if t.asked_at is None:  # not when admission control asks it again
            t.asked_at = t.requested_at = self.clock.now
        if self.windows is not None:
            self.windows.turn(t)
            return
        if t.engine is None:  # sticky: every later turn goes where its KV is
            engine = self._route()
            if engine is None:
                self._not_admitted.append(t)  # starts when a trajectory ends or a window grows
                self._schedule_control()
                return
            t.engine = engine
            t.engine.trajectories += 1
        elif self._over_window(t.engine):  # paused at this turn boundary, resumed with room
            self._paused[t.engine.index].append(t)
            self.admission_pauses += 1
            return
        self._submit_turn(t)

    def _tool_started(self, t: SimTrajectory) -> None:
        """Under the KV window, a member still in this tool call after the window's
        `leave_after_s` gives its place up."""
        windows, turn = self.windows, t.turn
        if windows is None:
            return

        def expire() -> None:
            if t.turn == turn:
                windows.tool_wait_over(t)

        self.clock.at(self.clock.now + windows.leave_after_s(), expire)

    def _submit_turn(self, t: SimTrajectory, resumed: bool = False) -> None:
        """The turn's request goes to its engine (`resumed`: after admission control paused
        its trajectory)."""
        assert t.engine is not None
        self._admitted(t)
        action = t.plan.turns[t.turn].action_tokens
        priority = self.book.priority(t.group.gid)
        t.submitted = (self.clock.now, self._phase(priority))
        req = SimRequest(f"{t.tid}-t{t.turn}", t, next(self._arrivals), priority, action,
                         lambda: self.turn_done(t))  # fmt: skip
        if t.turn:
            req.tool_returned_at = self.clock.now
        req.in_cache_signal = not resumed
        if self.submissions is not None:
            last = t.turn in (len(t.plan.turns) - 1, t.plan.infra_failure_turn)
            self.submissions.append(
                Submission(self.clock.now, t.engine.index, req.rid, t.tid, t.context, action,
                           priority, None if last else self.policy.pin_s)
            )  # fmt: skip
        t.engine.submit(req)

    def turn_done(self, t: SimTrajectory) -> None:
        """The engine decoded the turn's action."""
        assert t.engine is not None
        now = self.clock.now
        if self.finishes is not None:
            self.finishes.append((now, f"{t.tid}-t{t.turn}"))
        g = t.group
        submitted, phase = t.submitted
        turns = self.turn_speed.setdefault(phase, [0, 0.0, 0])
        turns[0] += 1
        turns[1] += now - submitted
        turns[2] += t.plan.turns[t.turn].action_tokens
        t.played.append((t.plan.turns[t.turn].action_tokens, now - t.requested_at, None))
        self.book.progress(g.gid, t.index, t.progress(), now)
        if t.plan.infra_failure_turn == t.turn:
            self._end_trajectory(t)
            self.infra_failures += 1
            g.attempts[t.index] += 1
            if g.attempts[t.index] <= self.config.max_infra_retries:
                self._start_member(g, t.index)  # a replacement member runs the same prompt
            else:
                self._member_finished(t, scored=False)
            return
        if t.turn == len(t.plan.turns) - 1:
            self._turns_over(t)
            return
        deadline = t.started_at + self.workload.trajectory_limit_s
        if now + t.plan.turns[t.turn].tool_s > deadline:  # the harness cuts it at its limit
            t.engine.wait_on_tool(t.tid, now)
            self.clock.at(max(now, deadline), lambda: self._timed_out(t))
            return
        t.engine.wait_on_tool(t.tid, now + self.policy.pin_s)
        self._tool_started(t)
        self.clock.at(now + t.plan.turns[t.turn].tool_s, lambda: self._tool_returned(t))

    def _tool_returned(self, t: SimTrajectory) -> None:
        turn = t.plan.turns[t.turn]
        t.tool_s += turn.tool_s
        tokens, generation_s, _ = t.played[-1]
        t.played[-1] = (tokens, generation_s, turn.tool_s)
        if self.windows is not None:
            self.windows.tool_returned(turn.tool_s)
        done = Progress(t.generated, t.turn + 1, t.turn + 1, t.tool_s)
        self.book.progress(t.group.gid, t.index, done, self.clock.now)
        t.context += turn.observation_tokens + self.workload.template_tokens
        t.turn += 1
        self._request_turn(t)

    def _turns_over(self, t: SimTrajectory) -> None:
        """`t`'s last turn is decoded: it waits for one of the workload's graders. With reward
        workers its places go first and the book learns that only its reward is left (the
        runtime's `LocalGroup._score`); inline it holds them until its reward is in."""
        assert t.engine is not None
        now = t.turns_over_at = self.clock.now
        t.critical_at_end = critical(self.book.priority(t.group.gid))
        if self.policy.reward_pool:
            self._let_go(t)  # its KV with its places
            if not self.workload.reward_reads_sandbox:
                t.sandbox_closed_at = now
            self.book.progress(t.group.gid, t.index, t.progress()._replace(grading=True), now)
            self._rerank()
        else:
            t.engine.finish_trajectory(t.tid)  # its KV goes; its places wait for its reward
        self._to_grade.append(t)
        self._grade()

    def _grade(self) -> None:
        """Free graders take waiting trajectories: inline, in the order their turns ended (each
        episode grades itself); reward workers take the most critical group's first, in the
        ranking's order (`RewardPool`)."""
        most = self.workload.reward_workers or math.inf
        while self._to_grade and self._grading < most:
            queue, first = self._to_grade, 0
            if self.policy.reward_pool and len(queue) > 1:
                ranking, place = self.book.priorities, {g: i for i, g in enumerate(self.book.order)}
                ranks = [reward_rank(t.group.gid, ranking, place) for t in queue]
                first = min(range(len(queue)), key=lambda i: (ranks[i], i))
            t = queue.pop(first)
            t.graded_from = self.clock.now
            self._grading += 1
            self.graders_peak = max(self.graders_peak, self._grading)
            self.clock.at(self.clock.now + t.plan.reward_s, functools.partial(self._graded, t))

    def _graded(self, t: SimTrajectory) -> None:
        """`t`'s reward is in; its latency (queue and grading) is the coordinator's to learn."""
        assert t.turns_over_at is not None and t.graded_from is not None
        self._grading -= 1
        reward_s = self.clock.now - t.turns_over_at
        self.book.rates.observe_reward(reward_s)
        self.reward_s.append(reward_s)
        whose = "critical" if t.critical_at_end else "best_effort"
        self.grader_waits.setdefault(whose, []).append(t.graded_from - t.turns_over_at)
        self._scored(t)
        self._grade()

    def _let_go(self, t: SimTrajectory) -> None:
        """`t` gives up its engine's count and its KV-window place; waiting agents come in."""
        if t.let_go:
            return
        t.let_go = True
        assert t.engine is not None
        t.engine.finish_trajectory(t.tid)
        t.engine.trajectories -= 1
        if self.windows is not None:
            self.windows.end(t)
        else:
            self._admit_waiting()

    def _end_trajectory(self, t: SimTrajectory) -> None:
        """`t` is over: the ranking's rates learn from its turns, as the coordinator's do from
        each episode that returns (`coordinator.turns_played`)."""
        for turn in t.played:
            self.book.rates.observe(*turn)
        self._let_go(t)
        assert t.asked_at is None, "a trajectory ends at a turn it ran, never while it asks"
        self.sandboxes.held += self._sandbox_gb_s(t)
        del self._open[t.tid]

    def _admitted(self, t: SimTrajectory) -> None:
        """`t`'s turn has a place: its wait for it was sandbox memory held idle."""
        if t.asked_at is not None:
            self.sandboxes.waited(t.turn, t.plan.sandbox_rss_gb * (self.clock.now - t.asked_at))
            t.asked_at = None

    def _sandbox_gb_s(self, t: SimTrajectory) -> float:
        """The sandbox memory `t` has held so far: its episode's sandbox, and, where that closed
        as its turns ended, the fresh one a reward worker grades it in."""
        now, rss = self.clock.now, t.plan.sandbox_rss_gb
        if t.sandbox_closed_at is None:
            return rss * (now - t.started_at)
        grading = 0.0 if t.graded_from is None else now - t.graded_from
        return rss * (t.sandbox_closed_at - t.started_at + grading)

    def _sandbox_figures(self) -> dict[str, float]:
        """The sandbox memory held, the trajectories still open at the end of the run included
        (a policy that keeps more of them waiting would look cheaper without), and the shares of
        it idle while a turn waited for a place: before the first turn (what opening a
        sandbox only once its trajectory is admitted would save) and between turns."""
        now, books = self.clock.now, replace(self.sandboxes)
        for t in self._open.values():
            books.held += self._sandbox_gb_s(t)
            if t.asked_at is not None:
                books.waited(t.turn, t.plan.sandbox_rss_gb * (now - t.asked_at))
        held = books.held
        return {
            "sandbox_gb_s": held,
            "sandbox_idle_before_first_turn": books.before_first_turn / held if held else 0.0,
            "sandbox_idle_between_turns": books.between_turns / held if held else 0.0,
        }

    def _active(self, engine: SimEngine) -> int:
        """Trajectories routed to `engine`, not finished and not paused."""
        return engine.trajectories - len(self._paused[engine.index])

    def _over_window(self, engine: SimEngine) -> bool:
        admission = self.counting
        return admission is not None and admission.pauses and self._active(engine) > engine.window

    def _route(self) -> SimEngine | None:
        """The engine a new trajectory goes to: the least loaded, if admission control admits
        one more trajectory there (None: it waits). A controller that pauses agents (Concur's)
        sends it to the least loaded of those with room."""
        engines, admission = self.engines, self.counting
        if admission is not None and admission.pauses:
            engines = [e for e in engines if admission.admits(self._active(e), e.window)]
            if not engines:
                return None
        engine = engines[least_loaded([e.trajectories for e in engines])]
        if admission is not None and not admission.admits(self._active(engine), engine.window):
            return None
        return engine

    def _admit_waiting(self) -> None:
        """Paused trajectories resume, oldest first, while their engines have room; then those
        held back before their first turn start, oldest first, while they fit."""
        admission = self.counting
        if admission is None:
            return
        for engine, paused in zip(self.engines, self._paused, strict=True):
            while paused and admission.admits(self._active(engine), engine.window):
                self._submit_turn(paused.popleft(), resumed=True)
        while self._not_admitted and self._route() is not None:
            self._request_turn(self._not_admitted.popleft())

    def _schedule_control(self) -> None:
        admission = self.counting
        if admission is not None and not self._control_due:
            self._control_due = True
            self.clock.at(self.clock.now + admission.period_s, self._control_admission)

    def _control_admission(self) -> None:
        """One control period of agent-level admission: each engine's window follows its cache.
        Periods run while any trajectory is active or waits to start."""
        admission = self.counting
        assert admission is not None
        self._control_due = False
        for e, paused in zip(self.engines, self._paused, strict=True):
            # The KV of the agents it admits: a paused trajectory's is only cached (evictable).
            idle = e.kv.idle
            paused_tokens = sum(idle[t.tid].device for t in paused if t.tid in idle)
            occupancy = (e.live_pages() - paused_tokens // e.page_size) / max(e.capacity, 1)
            signal = CacheSignal(occupancy, e.reprefill_evicted_tokens, e.reusable_tokens)
            e.window = admission.next_window(e.window, signal, self._active(e))
            e.reprefill_evicted_tokens = e.reusable_tokens = 0
        self._admit_waiting()
        if self._not_admitted or any(e.trajectories for e in self.engines):
            self._schedule_control()

    def _timed_out(self, t: SimTrajectory) -> None:
        """The trajectory ran past the harness's limit: it ends, scored as a failure (no
        reward to run), and trains as the others do."""
        self.timeouts += 1
        t.group.cut += 1
        self._scored(t)

    def _scored(self, t: SimTrajectory) -> None:
        self._end_trajectory(t)
        t.group.tokens += t.context
        t.group.sequences += 1
        w = self.workload
        work = trajectory_work(t.plan, t.turn + 1, w.template_tokens, w.group_size, self.cost)
        t.group.work += work
        self.finished_work += work
        self._member_finished(t, scored=True)

    def _member_finished(self, t: SimTrajectory, scored: bool) -> None:
        g = t.group
        if self.book.member_finished(g.gid, t.index, scored, t.progress()):
            if self.book.close(g.gid):
                self.group_completion_s.append(self.clock.now - g.started_at)
            else:
                self._launch()  # a dropped group gives its place back
            self._maybe_train()
        self._rerank()

    def _rerank(self) -> None:
        self.book.rank(self.version, self.clock.now)
        if self.windows is not None:
            self.windows.reranked(self.book.priorities)

    def _maybe_train(self) -> None:
        if self.trainer_busy:
            return
        batch = self.book.take_batch(self.version)
        if batch is None:
            return
        self._launch()  # as the coordinator does: the groups it overtook may free places
        tokens = sum(g.data.tokens for g in batch)
        sequences = sum(g.data.sequences for g in batch)
        self.trainer_busy = True
        if self.step_ends:
            self.batch_waits.append(self.clock.now - self.step_ends[-1])
        seconds = self.cost.train_s(tokens, tokens / sequences, self.workload.train_gpus)
        # Counted when the step is published: a step still training when the run ends is not one
        # of its steps.
        staleness = [self.version - g.started_version for g in batch]
        cut = sum(g.data.cut for g in batch)
        work = sum((g.data.work for g in batch), Work())
        self._training = TrainedBatch(seconds, staleness, tokens, sequences, cut, work)
        self.clock.at(self.clock.now + seconds, self._sync_weights)

    def _sync_weights(self) -> None:
        """The new weights go to every engine; they pause while they load them, after running
        their requests in flight to the end of their turns when they drain
        (`SimConfig.weight_update`)."""
        if self.config.weight_update != "drain":
            self._load_weights()
            return
        draining, began = set(range(len(self.engines))), self.clock.now

        def drained(i: int) -> None:
            draining.discard(i)
            if not draining:
                self.drain_s += self.clock.now - began
                self._load_weights()

        for i, e in enumerate(self.engines):
            e.drain(functools.partial(drained, i))

    def _load_weights(self) -> None:
        self.weight_sync_s += self.cost.weight_sync_s()
        done = self.clock.now + self.cost.weight_sync_s()
        flush = self.config.weight_update == "flush"
        for e in self.engines:
            e.pause(done, flush)
        self.clock.at(done, self._published)

    def _phase(self, priority: int) -> str:
        """When a turn runs, for whom: while the trainer trains or while it waits for a batch
        (before the first one: `first`), for a critical group or best effort."""
        when = "training" if self.trainer_busy else "waiting" if self.step_ends else "first"
        return f"{when}/{'critical' if critical(priority) else 'best_effort'}"

    def _published(self) -> None:
        batch = self._training
        assert batch is not None  # weights are published after a step trained
        self.trained.append(batch)
        self.version += 1
        self.step_ends.append(self.clock.now)
        self.trainer_busy = False
        self._launch()
        self._maybe_train()

    # --- figures ------------------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        cfg, ends = self.config, self.step_ends
        warm = min(cfg.warmup_steps, len(ends) - 1)
        measured = ends[warm:]
        span = measured[-1] - (ends[warm - 1] if warm else 0.0) if measured else None
        step_s = span / len(measured) if span is not None else None
        now = max(self.clock.now, 1e-9)
        completion = sorted(self.group_completion_s)
        engine_s = len(self.engines) * now
        # Where rollout GPU time went, as shares of all of it: busy (`SPENT_ON`) or idle
        # (waiting on tools, on admission control, on the trainer's new weights).
        breakdown = {w: sum(e.spent[w] for e in self.engines) / engine_s for w in SPENT_ON}
        busy_s = sum(e.busy_s for e in self.engines)
        breakdown["idle"] = 1 - busy_s / engine_s
        steps = max(len(ends), 1)
        staleness = [s for b in self.trained for s in b.staleness]  # of every group trained
        trained = self.trained[warm:]
        tokens = sum(b.tokens for b in trained)
        sequences, cut = sum(b.sequences for b in trained), sum(b.cut for b in trained)
        floor_s = self.finished_work.gpu_s(self.cost, self.config.max_running)
        return {
            "policy": self.policy.name,
            "knobs": asdict(self.policy),
            "steps": len(ends),
            "mean_step_s": step_s,
            # To the last step, the first included: where a step varies several-fold (a
            # straggler's tools), the window of the steps after the first is set by where each
            # policy's first step ended as much as by the policy.
            "run_s": ends[-1] if ends else None,
            # Step time alone flatters a policy whose batches are mostly trajectories cut at the
            # harness's time limit (short, failed samples): the seconds per trained sample that
            # ran to its end, and the share of trained samples cut, over the measured steps.
            "s_per_uncut_sample": span / (sequences - cut) if span and sequences > cut else None,
            "cut_share_trained": cut / sequences if sequences else 0.0,
            # Where the trainer sets the pace, a step is as long as its batch's tokens take:
            # which groups fill the batches moves it, not only how fast rollout is.
            "s_per_trained_mtoken": span / (tokens / 1e6) if span and tokens else None,
            # The step if the engines did only the GPU work the measured steps' samples need
            # (`work_floor`): no schedule's throughput-bound step is shorter.
            "work_floor_step_s": floor_step_s(
                sum((b.work for b in trained), Work()).gpu_s(self.cost, self.config.max_running),
                len(trained),
                len(self.engines),
                self.cost.weight_sync_s(),
            )
            if trained
            else None,
            "gpu_busy": busy_s / engine_s,
            # Rollout GPU seconds busy per second of the work floor of every trajectory finished
            # in the run, trained or not: how much a policy's engines add to the work, whatever
            # the steps' window (work in flight at the end counts against it).
            "gpu_s_per_floor_s": busy_s / floor_s if floor_s else None,
            # The fullest any engine's device KV was when an iteration was planned.
            "kv_peak_occupancy": max(e.peak_pages / e.capacity for e in self.engines),
            "rollout_gpu_time": breakdown,
            "train_s_per_step": sum(b.seconds for b in self.trained) / steps,
            "weight_sync_s_per_step": self.weight_sync_s / steps,
            "drain_s_per_step": self.drain_s / steps,
            # How long the trainer waited for each batch after publishing weights (the first
            # batch excluded): the part of a step that rollout alone decides.
            "batch_wait_s": statistics.fmean(self.batch_waits) if self.batch_waits else None,
            # Turns by phase and priority: how many, and their seconds from the request to the
            # last token per token generated (queueing and prefill included).
            "turns": {k: int(v[0]) for k, v in sorted(self.turn_speed.items())},
            "turn_s_per_token": {
                k: v[1] / v[2] if v[2] else None for k, v in sorted(self.turn_speed.items())
            },
            # From a trajectory's last turn to its reward: the wait for a grader and the grading.
            "reward_p50_s": quantile(sorted(self.reward_s), 0.5),
            "reward_p95_s": quantile(sorted(self.reward_s), 0.95),
            "grader_wait_s": {k: statistics.fmean(v) for k, v in sorted(self.grader_waits.items())},
            "graders_peak": self.graders_peak,
            "group_completion_p50_s": quantile(completion, 0.5),
            "group_completion_p99_s": quantile(completion, 0.99),
            "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
            "staleness_max": max(staleness, default=0),
            **self._sandbox_figures(),
            "infra_failures": self.infra_failures,
            "trajectory_timeouts": self.timeouts,
            "groups_dropped": self.book.groups_dropped,
            # turns admission control held back
            "admission_pauses": self.admission_pauses
            + (self.windows.book.pauses if self.windows else 0),
            "migrations": self.windows.book.migrations if self.windows else 0,
            **asdict(self.counters),
            "simulated_s": self.clock.now,
        }


def workload_cost(workload: Workload, cost: Mapping[str, float] | None = None) -> CostModel:
    """The workload's model on its GPUs (`CostModel.preset`), with the constants `cost` sets
    (`CostModel.overridden`; ValueError names a bad one)."""
    return CostModel.preset(workload.model, workload.gpu, workload.tp).overridden(cost or {})


def simulate(
    workload: Workload,
    policies: list[SimPolicy],
    seed: int = 0,
    config: SimConfig | None = None,
    jobs: int | None = None,
    cost: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Each policy on the same seeded workload, with its speedups over every other
    (`report.SPEEDUPS`). The policies run side by side in `jobs` processes (default: one per
    policy, even beyond the cores: the OS shares them, so no policy waits for a slower one to
    free a core, and the command ends close to total work / cores); each run is deterministic,
    so the figures do not depend on it. `cost`: constants of the workload's cost model set
    otherwise (`CostModel.overridden`)."""
    jobs = min(len(policies), jobs or len(policies))
    model = workload_cost(workload, cost)
    if jobs > 1:
        fork = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(jobs, mp_context=fork, initializer=_quiet_on_interrupt) as pool:
            futures = [pool.submit(_run, workload, p, seed, config, model) for p in policies]
            results = [f.result() for f in futures]
    else:
        results = [_run(workload, p, seed, config, model) for p in policies]
    speedups(results)
    return results


def _quiet_on_interrupt() -> None:
    """In a worker: Ctrl-C (sent to the whole process group) ends it without a traceback of its
    own; the parent reports the interruption once."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))


def _run(
    workload: Workload, policy: SimPolicy, seed: int, config: SimConfig | None, cost: CostModel
) -> dict[str, Any]:
    return Simulation(workload, policy, seed, config, cost).run()
