"""One rollout engine of the simulator, modelled as `venusrl.engine.Engine` runs, on the
simulation's virtual clock and its cost model.

What is modelled, as the engine does it: the same scheduler object deciding on the same
snapshot; continuous batching with chunked prefill under a token budget (the prefill's last
chunk samples the action's first token), KV pages on the device, whole pages cached in a radix
tree (a node per insertion: each prefill chunk and each request's end), idle KV of trajectories
between turns and of finished ones kept until evicted node by node from the end of its path
(offloaded to host or dropped, in the retention policy's order), preemption by priority (the
preempted KV stays idle, evictable), and re-prefill of whatever KV was lost.
`tests/sim/test_engine_parity.py` replays a simulated run on the real engine and checks that
every plan and eviction is the same. The KV bookkeeping is `sim/kv.py`'s.

Iterations that repeat a decision's plan run without asking the scheduler again, many to an
event (`sim/span.py`: decodes until one finishes its action, a prefill chunk that fills the
token budget until that prefill ends, and after an iteration whose prefills end, the decodes
that follow when the plan can be known; an arrival waits for the iteration in flight, as on a
real engine): the figures are those of deciding every iteration
(`SimConfig.decide_every_iteration`, checked by a test), and a scenario of millions of tokens
runs in minutes.

Host memory for offloaded KV is bounded (`CostModel.host_kv_bytes_per_gpu`); when it is full,
host KV ranked below what is offloaded is dropped to make room, else what would be offloaded is
dropped. Copies to host are charged to the iteration that makes them and run beside its compute,
as the engine's side stream runs them (`engine/tier_copies.py`): the iteration waits only for
copying longer than its compute (`SimConfig.overlap_copies`). Loads back to the device are
charged whole to the iteration that admits the request: the engine's compute waits for a page
before it reads it, and nothing loads a trajectory's KV ahead of its return yet.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, overload

from venusrl.policy.critical_groups import HIGH
from venusrl.policy.engine_schedule import (
    RETRY_AFTER_S,
    EngineSnapshot,
    PriorityScheduler,
    RequestView,
    StepPlan,
    queue_order,
)
from venusrl.policy.kv_retention import RetentionPolicy
from venusrl.sim.cost_model import CostModel
from venusrl.sim.kv import IdleEntry, SimKV
from venusrl.sim.span import Span, SpanPlanner
from venusrl.sim.types import Clock, Counters, SimConfig, SimRequest

# What rollout engines spend busy time on (re-prefill: computing KV that was lost again;
# transfers: copying KV between host and device).
SPENT_ON = ("decode", "prefill", "reprefill", "transfers")


class _LazyViews(Sequence[RequestView]):
    """Views of the waiting head, each built when first read. The scheduler stops at the first
    request that does not fit, so in a long queue most are never read (building them all took
    a third of the simulator's time); what it reads is what an eager list would hold."""

    def __init__(self, head: list[SimRequest], view: Callable[[SimRequest], RequestView]) -> None:
        self._head, self._view = head, view
        self._built: list[RequestView] = []

    def __len__(self) -> int:
        return len(self._head)

    def __iter__(self) -> Iterator[RequestView]:
        for i in range(len(self._head)):
            yield self._get(i)

    @overload
    def __getitem__(self, i: int) -> RequestView: ...
    @overload
    def __getitem__(self, i: slice) -> list[RequestView]: ...
    def __getitem__(self, i: int | slice) -> RequestView | list[RequestView]:
        if isinstance(i, slice):
            return [self._get(j) for j in range(*i.indices(len(self._head)))]
        if not -len(self._head) <= i < len(self._head):
            raise IndexError(i)
        return self._get(i % len(self._head))

    def _get(self, i: int) -> RequestView:
        built = self._built
        while len(built) <= i:
            built.append(self._view(self._head[len(built)]))
        return built[i]


def _views(
    running: Iterable[SimRequest], head: list[SimRequest], idle: dict[str, IdleEntry], ps: int
) -> tuple[list[RequestView], Sequence[RequestView]]:
    """The scheduler's snapshot of `running` requests and the waiting `head`, as the engine
    builds it, with `idle` KV and pages of `ps` tokens (called at every decision: kept lean)."""
    views = []
    for r in running:
        v = r.view
        v.num_computed = r.computed
        v.tokens_to_compute = r.prefill_left or 1
        v.pages_held = v.pages_releasable = -(-r.computed // ps)
        views.append(v)

    def waiting(r: SimRequest) -> RequestView:
        entry = idle.get(r.traj.tid)
        cached = entry.device + entry.host if entry is not None else 0
        held = entry.device // ps if entry is not None else 0
        todo = max(r.traj.context - cached, 1)
        return RequestView(r.rid, r.priority, r.arrival, cached, todo, held, 0, pages_idle=held)

    return views, _LazyViews(head, waiting)


class _Decision(NamedTuple):
    """A decision's plan, and what of its moment says whether the plan repeats."""

    plan: StepPlan
    head: list[SimRequest]  # the waiting head the scheduler was shown
    stop: SimRequest | None  # where it stopped reading the queue: the first it did not admit
    reserved: int  # pages in the reserve
    release_at: float | None  # when the first pin of the reserve expires
    seen: tuple[int, int, int]  # what evicting idle KV could change of the next plan
    evictions: int  # evictions counted before the plan ran


class SimEngine:
    """One rollout engine, `index` among the simulation's: `scheduler` plans its iterations on
    `clock`, `cost` says how long they take, its KV (`kv`) follows `retention`, and it adds to
    the run's `counters`. `window`: agent admission control's first congestion window. A
    request's `done` is called when its action is sampled."""

    def __init__(
        self,
        index: int,
        clock: Clock,
        cost: CostModel,
        config: SimConfig,
        scheduler: PriorityScheduler,
        retention: RetentionPolicy,
        counters: Counters,
        window: int,
    ) -> None:
        self.index, self.clock, self.cost, self.config = index, clock, cost, config
        self.scheduler, self.counters = scheduler, counters
        self.kv = SimKV(clock, cost, config.page_size, retention, counters)
        self._planner = SpanPlanner(
            self.kv, cost, config.max_merged_iterations, config.overlap_copies
        )
        self.running: dict[str, SimRequest] = {}
        self.waiting: list[SimRequest] = []  # in the scheduler's queue order (`_enqueue`)
        self.peak_pages = 0  # the most device pages in use when an iteration was planned
        self.trajectories = 0  # routed here and not finished (the router's load)
        # For admission control's cache signal, since its last control period: tokens of
        # evicted KV computed again, and of context admitted requests had cached before.
        self.reprefill_evicted_tokens = self.reusable_tokens = 0
        self.window = window
        self.busy = False  # an iteration is in flight or a decision is due
        self.busy_s = 0.0
        self.spent: dict[str, float] = dict.fromkeys(SPENT_ON, 0.0)  # busy seconds by use
        self.paused_until = 0.0
        self.admitting = True  # False while it drains for new weights
        self._drained: Callable[[], None] | None = None
        self._flush_due = False
        self._epoch = 0
        self._span: Span | None = None  # the iterations in flight

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def capacity(self) -> int:
        """Device KV pages."""
        return self.kv.capacity

    def submit(self, req: SimRequest) -> None:
        # The tool answered: its idle KV is the new request's now.
        unreserved = self.kv.owner_returns(req.traj.tid, req.priority)
        self._enqueue(req)
        if not self.busy:
            self.busy = True
            self.clock.at(self.clock.now, self._step)
            return
        # A real engine's next iteration takes the newcomer into account: it changes the plan
        # unless it queues behind a request the plan left waiting (which waits on) and it
        # gives no pages back to the reserve.
        span = self._span
        head = span.head if span is not None else None
        if unreserved or head is None or queue_order(req) < queue_order(head):
            self._disturb()

    def wait_on_tool(self, tid: str, deadline: float) -> None:
        if self.kv.pin(tid, deadline):
            self._disturb()

    def finish_trajectory(self, tid: str) -> None:
        """No request of it follows: its KV stays until evicted, first of all by policies that
        know it is finished, by its last use with LRU."""
        # The plan reads the owners of idle KV through the reserve only.
        if self.kv.owner_finished(tid):
            self._disturb()

    def pause(self, until: float, flush: bool = False) -> None:
        """New weights load until then: the iteration in flight is the last before. `flush`:
        then every KV no running request holds is dropped, once that iteration has ended (the
        engine's `flush_cache` after a load)."""
        self.paused_until, self.admitting, self._flush_due = until, True, flush
        self._disturb(everything=True)
        if self._span is None:
            self._flush_if_due()
        self.clock.at(until, self._kick)  # an engine idle while it drained has work waiting

    def drain(self, then: Callable[[], None]) -> None:
        """Start no new turn until `pause` (a preempted one goes on); `then` once no turn is in
        flight."""
        self.admitting, self._drained = False, then
        self._disturb(everything=True)
        self._check_drained()

    def _check_drained(self) -> None:
        if self._drained is not None and not self.running:
            if any(r.resumed for r in self.waiting):
                return
            then, self._drained = self._drained, None
            then()

    def _flush_if_due(self) -> None:
        if self._flush_due:
            self._flush_due = False
            self.kv.flush()

    def live_pages(self) -> int:
        """Device pages of live trajectories: running, or idle between turns (the KV of finished
        ones only waits to be evicted: a cache's content, not load)."""
        finished = sum(e.device for e in self.kv.idle.values() if e.finished)
        pages = self._device_pages()
        if self._span is not None:  # as if each iteration so far had been an event of its own
            pages += self._span.pages_opened(self.clock.now, self.page_size)
        return pages - finished // self.page_size

    def _disturb(self, everything: bool = False) -> None:
        """Something the next plan depends on changed (a request arrived, an idle trajectory's
        owner changed; `everything`: the engine pauses): the iterations in flight stop after
        the current one, and the next is decided. A plan that takes the whole token budget
        depends on neither, only on a pause."""
        span = self._span
        if span is None or not span.repeats or (span.budget_bound and not everything):
            return
        span.repeats = False
        k = span.started(self.clock.now)
        if k < len(span.ends):
            self._planner.stop_after(span, k)
            self._end_at(span.ends[-1])

    def _enqueue(self, req: SimRequest) -> None:
        bisect.insort(self.waiting, req, key=queue_order)

    def _device_pages(self) -> int:
        ps = self.page_size
        running = sum(-(-r.computed // ps) for r in self.running.values())
        return running + self.kv.idle_device // ps

    def _reserve(self, head: list[SimRequest]) -> tuple[int, float | None]:
        """The reserve's pages and when its first pin expires, for a scheduler shown `head`."""
        return self.kv.reserved_pages(self.running.values(), head)

    # --- one decision ------------------------------------------------------------------------

    def _step(self) -> None:
        now = self.clock.now
        if now < self.paused_until:  # the weights are being updated
            self.clock.at(self.paused_until, self._step)
            return
        decision = self._decide()
        ran, split, pages = self._run(decision.plan, decision.head)
        if not ran:
            self.busy = False
            self._check_drained()
            if decision.plan.run:  # what was planned lost its pages: the engine loop plans again
                self.clock.at(now + RETRY_AFTER_S, self._kick)
            elif decision.release_at is not None:
                # Nothing fits: KV frees when a tool returns or a trajectory's KV is let go,
                # and reserved KV when its pin expires.
                self.clock.at(decision.release_at, self._kick)
            return
        span, prefilling = self._planner.first(ran, split, pages, now, decision.release_at)
        counters = self.counters
        # A first token is sampled only here: a span's later iterations never end a prefill.
        for req, _ in span.sampling:
            if req.tool_returned_at is not None:
                counters.tool_returns += 1
                counters.tool_return_wait_s += span.ends[0] - req.tool_returned_at
                req.tool_returned_at = None
        hold = self._set_repeats(span, ran, prefilling, decision)
        span.repeats = span.repeats and not self.config.decide_every_iteration
        if span.repeats:  # after the pages this iteration's decodes open
            ps = self.page_size
            opened = sum(1 for r, base in span.sampling if base == r.computed and not base % ps)
            self._planner.decode_on(span, self.running.values(), hold, evict=False, opened=opened)
        self._span = span
        self._end_at(span.ends[-1])

    def _decide(self) -> _Decision:
        """Asks the scheduler for a plan on the snapshot the engine would show it, and preempts
        whom the plan says."""
        cfg, counters = self.config, self.counters
        counters.decisions += 1
        queue = self.waiting if self.admitting else [r for r in self.waiting if r.resumed]
        head = queue[: cfg.waiting_head]
        running, waiting = _views(self.running.values(), head, self.kv.idle, self.page_size)
        # As the engine counts it: free pages plus every idle page (evictable, a waiting request's
        # own cached context included; its `pages_held` keeps it from being asked for twice).
        free = self.capacity - sum(v.pages_held for v in running)
        reserved, release_at = self._reserve(head)
        snap = EngineSnapshot(
            running,
            waiting,
            free,
            cfg.page_size,
            cfg.token_budget,
            cfg.max_running,
            reserved_pages=reserved,
            reserve_priority=HIGH,
        )
        plan = self.scheduler.schedule(snap)
        for rid in plan.preempt:
            self._preempt(self.running.pop(rid))
        # Where the scheduler stopped reading the queue: the first request of the head it does
        # not admit (it admits in order, after planning those running).
        admitted = 0
        for rid, _ in reversed(plan.run):
            if rid in self.running:
                break
            admitted += 1
        stop = head[admitted] if admitted < len(head) else None
        seen = self.kv.seen(reserved, stop)
        return _Decision(plan, head, stop, reserved, release_at, seen, counters.evictions)

    def _set_repeats(
        self,
        span: Span,
        ran: list[tuple[SimRequest, int, bool]],
        prefilling: list[SimRequest],
        decision: _Decision,
    ) -> int:
        """Sets whether the decision's plan repeats after the span's first iteration, and how
        (its prefill and chunk, the waiting request it stopped at). Returns the pages the
        repeats must leave free (the reserve)."""
        cfg, kv, head, stop = self.config, self.kv, decision.head, decision.stop
        if decision.plan.preempt:  # the next iteration is decided
            return decision.reserved
        hold, sampling = decision.reserved, span.sampling
        if not prefilling:
            # Decodes only, the same again unless an eviction changed what the plan reads.
            span.repeats = self.counters.evictions == decision.evictions or (
                decision.seen == kv.seen(self._reserve(head)[0], stop)
            )
            span.head = stop
        elif len(prefilling) == 1 and prefilling[0].prefill_left:
            # A prefill chunk that takes the rest of the token budget, the others decoding:
            # the same again while that prefill lasts, if whoever did not run came after it
            # (and so found no budget left).
            req = span.prefill = prefilling[0]
            span.chunk = next(n for r, n, _ in ran if r is req)
            order = queue_order(req)
            span.budget_bound = sum(n for _, n, _ in ran) == cfg.token_budget
            decoders = len(ran) - len(prefilling)
            span.repeats = (
                span.budget_bound
                and decoders == sum(1 for r in self.running.values() if not r.prefill_left)
                and all(
                    queue_order(r) > order
                    for r in self.running.values()
                    if r.prefill_left and r is not req
                )
            )
            span.undo.append((0, 0, 0, 0))  # iteration 0's state: never restored
        elif len(sampling) == len(self.running) - 1 and prefilling[-1].prefill_left:
            # Prefills ended but the last admitted (its first chunk took what budget was left):
            # from the next iteration on, every other running request decodes and its chunks
            # take the rest of the token budget, as long as its prefill lasts.
            span.prefill, span.chunk = prefilling[-1], cfg.token_budget - len(sampling)
            span.budget_bound = span.repeats = True
            span.undo.append((0, 0, 0, 0))
            hold, span.release_at = self._reserve(self.waiting[: cfg.waiting_head])
        elif len(sampling) == len(self.running) and (
            not self.waiting
            or (
                # The plan stopped at the first request waiting, having token budget left for
                # it (or no room for one more request): it failed for pages, and fails again.
                self.waiting[0] is stop
                and (
                    sum(n for _, n, _ in ran) < cfg.token_budget
                    or len(self.running) >= min(cfg.max_running, cfg.token_budget)
                )
            )
        ):
            # The prefills ended: from the next iteration on, every running request decodes,
            # unless admitting or evicting changed what the plan reads.
            head = self.waiting[: cfg.waiting_head]
            hold, span.release_at = self._reserve(head)
            span.repeats = not head or decision.seen == kv.seen(hold, stop)
            span.head = stop if head else None
        return hold

    def _run(
        self, plan: StepPlan, head: list[SimRequest]
    ) -> tuple[list[tuple[SimRequest, int, bool]], dict[str, float], int]:
        """Admits and runs the plan's requests as the engine does: host KV loaded back, room made
        by eviction, a request the pages ran out for left out. Returns those that run (with
        their tokens and whether they decode), the seconds of the iteration so far, by use, and
        the device pages in use when it was planned."""
        kv, ps, capacity = self.kv, self.page_size, self.capacity
        used = pages = self._device_pages()
        assert used <= capacity, (used, capacity)
        self.peak_pages = max(self.peak_pages, used)
        # "loads": host-to-device copies of requests admitted now, which their compute waits for
        split = {"prefill": 0.0, "reprefill": 0.0, "transfers": 0.0, "loads": 0.0}
        ran: list[tuple[SimRequest, int, bool]] = []
        for rid, n in plan.run:
            req = self.running.get(rid)
            admitted: int | None = None  # tokens loaded from host, when admitted now
            if req is None:  # admitted: near the head's start (the scheduler admits in order)
                req = next(r for r in head if r.rid == rid)
                used, admitted = kv.load(req.traj.tid, used)
                if admitted is None:
                    continue  # its host KV does not fit on the device yet: it waits
                split["loads"] += self.cost.transfer_s(admitted, to_device=True)
                split["loads"] += kv.moved_in.pop(req.traj.tid, 0.0)
                self.waiting.remove(req)
                self.running[rid] = req
                kv.admit(req)
            decodes = not req.prefill_left
            tokens = 1 if decodes else min(n, req.prefill_left)
            c = req.computed  # its new pages: pages_for(c + tokens) - pages_for(c), inlined
            growth = -(-(c + tokens) // ps) - -(-c // ps)
            if growth:  # most decodes stay within their last page
                used = kv.make_room(used, growth)
                if used + growth > capacity:
                    # Earlier requests of the plan took the pages it counted on: it waits a step,
                    # back in the queue if it was just admitted.
                    if admitted is not None:
                        del self.running[rid]
                        kv.release(req)
                        self._enqueue(req)
                    continue
                used += growth
            if admitted is not None:
                lost = kv.count_admission(req, admitted)
                if req.in_cache_signal and not req.resumed:
                    self.reprefill_evicted_tokens += lost
                    self.reusable_tokens += req.traj.expected_cached
            if not decodes:
                prefill, reprefill = self._planner.prefill_seconds(req, tokens, req.computed)
                split["prefill"] += prefill
                split["reprefill"] += reprefill
                req.computed += tokens
                req.prefill_left -= tokens
                if tokens > 1:
                    kv.cache(req)  # the engine hands each prefill chunk's pages to the tree
            ran.append((req, tokens, decodes))
        if ran:  # device-to-host copies made meanwhile, charged to the iteration
            split["transfers"] += kv.transfer_s
            kv.transfer_s = 0.0
        return ran, split, pages

    def _preempt(self, req: SimRequest) -> None:
        """A running request gives its pages up: its KV stays in the tree, idle, where eviction
        may take it; it waits again with the tokens it sampled kept in its context."""
        self.counters.preemptions += 1
        self.kv.release(req)
        req.resumed = True
        self._enqueue(req)

    # --- events ------------------------------------------------------------------------------

    def _end_at(self, t: float) -> None:
        self._epoch += 1
        epoch = self._epoch
        self.clock.at(t, lambda: self._end(epoch))

    def _end(self, epoch: int) -> None:
        if epoch != self._epoch or self._span is None:
            return  # superseded by a disturbance
        span = self._span
        self._span = None
        busy = span.ends[-1] - span.start
        self.busy_s += busy
        prefill, reprefill, transfers = span.spent
        self.spent["prefill"] += prefill
        self.spent["reprefill"] += reprefill
        self.spent["transfers"] += transfers
        self.spent["decode"] += busy - (prefill + reprefill + transfers)  # with fixed costs
        self.peak_pages = max(self.peak_pages, *span.pages)
        self.counters.iterations += len(span.ends)
        span.done += len(span.ends)
        if span.repeats:  # the plan goes on, from an iteration that may evict
            span.start = self.clock.now
            span.ends, span.pages, span.undo = [], [], []
            span.spent = [0.0, 0.0, 0.0]
            if self._planner.iterate(span, self.running.values(), evict=True):
                self._span = span
                self._end_at(span.ends[-1])
                return
        n, sampled = span.done, []
        for req, base in span.sampling:  # the simulator's innermost loop: kept lean
            req.computed = base + n  # with the KV of the token sampled before
            req.decode_left -= n
            if not req.decode_left:
                sampled.append(req)
        if n > 1:  # past a decision's first iteration every request decodes, in queue order
            sampled.sort(key=queue_order)
        for req in sampled:  # their actions are sampled
            del self.running[req.rid]
            self.kv.release(req)
            req.done()
        self._flush_if_due()
        self._check_drained()
        if span.repeats and sampled and self._decodes_go_on(span):
            return
        if self.running or self.waiting:
            self._step()
        else:
            self.busy = False

    def _decodes_go_on(self, span: Span) -> bool:
        """After decodes finished their actions in iterations nothing disturbed, the next plan
        is known without asking the scheduler: the rest decoding, if they were all that ran and
        nothing waits; or, if a prefill's chunks took the rest of the token budget, the rest
        decoding and its chunk taking what they leave (no waiting request is read while the
        budget is spent). Runs it, unless new weights load or it does not fit as it is; says if
        it did. The reserve is as the finished ones left it."""
        now, cfg = self.clock.now, self.config
        req = span.prefill
        if now < self.paused_until or cfg.decide_every_iteration or (req is None and self.waiting):
            return False
        # Every one decodes now: the engine runs them in queue order.
        sampling = sorted(
            ((r, r.computed) for r, _ in span.sampling if r.decode_left),
            key=lambda item: queue_order(item[0]),
        )
        if req is None and (not sampling or len(sampling) != len(self.running)):
            return False
        span = Span(sampling, prefill=req, chunk=cfg.token_budget - len(sampling),
                    budget_bound=req is not None, hold=0, release_at=None, start=now,
                    spent=[0.0] * 3)  # fmt: skip
        hold, span.release_at = self._reserve(self.waiting[: cfg.waiting_head])
        if not self._planner.decode_on(span, self.running.values(), hold, evict=True):
            return False
        self._span = span
        self._end_at(span.ends[-1])
        return True

    def _kick(self) -> None:
        if not self.busy and (self.running or self.waiting):
            self.busy = True
            self._step()
