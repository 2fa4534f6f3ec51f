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
every plan and eviction is the same.

Iterations that repeat a decision's plan run without asking the scheduler again, many to an
event (`_Span`: decodes until one finishes its action, a prefill chunk that fills the token
budget until that prefill ends, and after an iteration whose prefills end, the decodes that
follow when the plan can be known; an arrival waits for the iteration in flight, as on a real
engine): the figures are those of deciding every iteration
(`SimConfig.decide_every_iteration`, checked by a test), and a scenario of millions of tokens
runs in minutes.

Host memory for offloaded KV is bounded (`CostModel.host_kv_bytes_per_gpu`); when it is full,
host KV ranked below what is offloaded is dropped to make room, else what would be offloaded is
dropped. Copies to host are charged to the iteration that makes them, loads to the one that
admits the request (neither is overlapped with compute: conservative for the policies that
offload).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from venusrl.policy.critical_groups import HIGH
from venusrl.policy.engine_schedule import (
    RETRY_AFTER_S,
    EngineSnapshot,
    RequestView,
    StepPlan,
    queue_order,
)
from venusrl.policy.kv_retention import IdleKV, eviction_key

if TYPE_CHECKING:
    from venusrl.sim.executor import SimTrajectory, Simulation

# What rollout engines spend busy time on (re-prefill: computing KV that was lost again;
# transfers: copying KV between host and device).
SPENT_ON = ("decode", "prefill", "reprefill", "transfers")


@dataclass(eq=False)
class SimRequest:
    """One turn's request, as the engine holds it: the trajectory's record so far as its prompt,
    the action to sample."""

    rid: str
    traj: SimTrajectory
    arrival: int
    priority: int  # sent with the request, as the coordinator does: fixed from then on
    decode_left: int  # tokens of the action still to sample
    recorded: int = 0  # tokens sampled and added to the trajectory's record (when it lets go)
    computed: int = 0  # tokens of the context with KV on the device for this request
    prefill_left: int = 0
    cached: int = 0  # of `computed`, the whole pages handed to the radix tree
    segments: list[int] = field(default_factory=list)  # its tree nodes, in tokens, root first
    resumed: bool = False  # it ran before and was preempted: KV it lost is a preemption's
    # When it arrived, for a turn after a tool call, until its first token is sampled.
    tool_returned_at: float | None = None
    lost_until: int = 0  # its prefill below this recomputes KV that was lost (a re-prefill)
    # The scheduler's view of it while it runs, updated in place at every decision (building
    # one for every running request at every decision was a tenth of the simulator's time).
    view: RequestView = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.view = RequestView(self.rid, self.priority, self.arrival, 0, 0, 0, 0)


@dataclass(eq=False)
class _Idle:
    """A trajectory's KV between its requests, as the engine's radix tree holds it: one node per
    insertion (`segments`, in tokens, root first), of which the last `on_host` are offloaded.
    The tree evicts a path from its end, node by node."""

    tid: str
    segments: list[int]
    device: int  # tokens in the device segments
    priority: int  # of the trajectory's latest request
    last_use: int  # the tree's access tick
    pin_deadline: float | None = None
    on_host: int = 0
    host: int = 0  # tokens in the host segments
    finished: bool = False
    # The retention policy's view of its root node, read at every decision: built once per
    # change of owner state (`set_owner`, the only writer of the owner's fields).
    _view: IdleKV | None = field(default=None, init=False, repr=False)

    def view(self, segment: int = 0) -> IdleKV:
        """The policy's view of one of its nodes (the owner's state, that node's tokens)."""
        if segment == 0 and self._view is not None:
            return self._view
        view = IdleKV(self.tid, self.segments[segment], self.priority, self.last_use,
                      self.pin_deadline, self.finished)  # fmt: skip
        if segment == 0:
            self._view = view
        return view

    def set_owner(self, *, priority: int, pin_deadline: float | None, finished: bool) -> None:
        self.priority, self.pin_deadline, self.finished = priority, pin_deadline, finished
        self._view = None


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


@dataclass(eq=False)
class _Span:
    """Engine iterations that repeat one plan, run as one event.

    After a decision, the iterations that would plan the same again (the same requests, as many
    tokens each) run without asking the scheduler: decodes until one finishes its action, a
    prefill chunk that takes the rest of the token budget until that prefill ends, and after an
    iteration where prefills end, every running request decoding (with one whose first chunk
    took the budget left taking it all, while its prefill lasts). Each is
    planned as the decision would plan it: its pages, its cost. Only the first iteration of an
    event evicts (it starts when the event does, on the state of that moment), so an event ends
    before an iteration that needs an eviction and the next event starts with it. An arrival or
    an owner's change that could change the plan, or a weight update, stops the iterations after
    the one in flight; the next is decided. So the figures are those of deciding every
    iteration (a test checks it; seconds summed by use differ by float rounding), in far fewer
    events."""

    # Those that sample, in the engine's order, each with the KV position its token of iteration
    # g goes to, less g (a prefill that ends in iteration 0 decodes from iteration 1 on).
    sampling: list[tuple[SimRequest, int]]
    prefill: SimRequest | None  # whose chunk takes the rest of the token budget every iteration
    chunk: int
    budget_bound: bool  # the plan takes the whole token budget: nothing waiting can change it
    hold: int  # pages that must stay free after an iteration's growth (the reserve)
    release_at: float | None  # no iteration starts from then on (a retention pin expires)
    # Decodes only: the first request the decision left waiting (it would fail again first).
    head: SimRequest | None = None
    repeats: bool = True  # nothing changed since the decision: the plan still repeats
    # The current event: its start; per iteration its end, the device pages in use when it was
    # planned and the prefill request's state before it (to stop early); the seconds of its
    # first iteration spent on prefill, re-prefill and transfers, and of all of them.
    start: float = 0.0
    ends: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    undo: list[tuple[int, int, int, int]] = field(default_factory=list)
    first: tuple[float, float, float] = (0.0, 0.0, 0.0)
    spent: list[float] = field(default_factory=list)
    # From the decision on: iterations that ended in earlier events (the decodes' state is
    # brought up to date when the span ends), the decodes whose token of iteration i opens a
    # page (`crossing[-i % page_size]`), their contexts and the iterations before one of them
    # finishes its action, at the decision; the pages running requests hold now.
    done: int = 0
    crossing: list[int] = field(default_factory=list)
    context: int = 0
    most: int = 0
    running_pages: int = 0

    def started(self, now: float) -> int:
        """Iterations of the current event begun by `now`."""
        return min(len(self.ends), bisect.bisect_right(self.ends, now) + 1)


class SimEngine:
    """One rollout engine of `sim` (its clock, cost model, policies and counters); `index`: its
    place among the simulation's engines."""

    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim, self.index = sim, index
        self.page_size = sim.config.page_size
        self.capacity = sim.cost.kv_capacity_tokens // self.page_size
        self.host_capacity = sim.cost.host_capacity_tokens  # tokens
        self.host_used = 0
        self._transfer_s = 0.0  # device-to-host copies made while planning this iteration
        self.running: dict[str, SimRequest] = {}
        self.waiting: list[SimRequest] = []  # in the scheduler's queue order (`_enqueue`)
        self.idle: dict[str, _Idle] = {}  # trajectory id -> its KV between requests
        self.idle_device = 0  # tokens of `idle` on the device
        self.peak_pages = 0  # the most device pages in use when an iteration was planned
        self.trajectories = 0  # routed here and not finished (the router's load)
        self.reprefill_evicted_tokens = 0  # tokens, for admission control's cache signal
        admission = sim.policy.admission
        self.window = admission.initial_window if admission is not None else 0
        self.busy = False  # an iteration is in flight or a decision is due
        self.busy_s = 0.0
        self.spent: dict[str, float] = dict.fromkeys(SPENT_ON, 0.0)  # busy seconds by use
        self.paused_until = 0.0
        self._epoch = 0
        self._span: _Span | None = None  # the iterations in flight

    def submit(self, req: SimRequest) -> None:
        entry = self.idle.get(req.traj.tid)
        unreserved = False
        if entry is not None:  # the tool answered: its KV is the new request's now
            unreserved = self._reserves(entry)
            entry.set_owner(priority=req.priority, pin_deadline=None, finished=entry.finished)
        self._enqueue(req)
        if not self.busy:
            self.busy = True
            self.sim.clock.at(self.sim.clock.now, self._step)
            return
        # A real engine's next iteration takes the newcomer into account: it changes the plan
        # unless it queues behind a request the plan left waiting (which waits on) and it
        # gives no pages back to the reserve.
        span = self._span
        head = span.head if span is not None else None
        if unreserved or head is None or queue_order(req) < queue_order(head):
            self._disturb()

    def wait_on_tool(self, tid: str, deadline: float) -> None:
        entry = self.idle.get(tid)
        if entry is not None:
            entry.set_owner(priority=entry.priority, pin_deadline=deadline, finished=entry.finished)
            self._disturb()

    def finish_trajectory(self, tid: str) -> None:
        """No request of it follows: its KV stays until evicted, first of all by policies that
        know it is finished, by its last use with LRU."""
        entry = self.idle.get(tid)
        if entry is not None and not entry.finished:  # (its reward's end says it again)
            unreserved = self._reserves(entry)
            entry.set_owner(priority=entry.priority, pin_deadline=entry.pin_deadline, finished=True)
            if unreserved:  # the plan reads the owners of idle KV through the reserve only
                self._disturb()

    def pause(self, until: float) -> None:
        """New weights load until then: the iteration in flight is the last before."""
        self.paused_until = until
        self._disturb(everything=True)

    def _disturb(self, everything: bool = False) -> None:
        """Something the next plan depends on changed (a request arrived, an idle trajectory's
        owner changed; `everything`: the engine pauses): the iterations in flight stop after
        the current one, and the next is decided. A plan that takes the whole token budget
        depends on neither, only on a pause."""
        span = self._span
        if span is None or not span.repeats or (span.budget_bound and not everything):
            return
        span.repeats = False
        k = span.started(self.sim.clock.now)
        if k < len(span.ends):
            del span.ends[k:], span.pages[k:]
            if span.prefill is not None:  # its chunks after the one in flight are not computed
                req, spent = span.prefill, list(span.first)
                for computed, *_ in span.undo[1:k]:
                    prefill, reprefill = self._prefill_seconds(req, span.chunk, computed)
                    spent[0] += prefill
                    spent[1] += reprefill
                req.computed, req.prefill_left, req.cached, segments = span.undo[k]
                del req.segments[segments:], span.undo[k:]
                span.spent = spent
            self._end_at(span.ends[-1])

    def _enqueue(self, req: SimRequest) -> None:
        bisect.insort(self.waiting, req, key=queue_order)

    # --- one decision ------------------------------------------------------------------------

    def _device_pages(self) -> int:
        ps = self.page_size
        running = sum(-(-r.computed // ps) for r in self.running.values())
        return running + self.idle_device // ps

    def live_pages(self) -> int:
        """Device pages of live trajectories: running, or idle between turns (the KV of finished
        ones only waits to be evicted: a cache's content, not load)."""
        finished = sum(e.device for e in self.idle.values() if e.finished)
        pages = self._device_pages()
        span = self._span
        if span is not None:  # as if each iteration so far had been an event of its own
            k = span.started(self.sim.clock.now)
            ps, ended = self.page_size, span.done + k - 1
            for r, base in span.sampling:
                pages += -(-max(r.computed, base + ended) // ps) - -(-r.computed // ps)
            if span.prefill is not None and k < len(span.undo):
                computed = span.prefill.computed
                pages -= -(-computed // ps) - -(-span.undo[k][0] // ps)
        return pages - finished // self.page_size

    def _views(self, head: list[SimRequest]) -> tuple[list[RequestView], Sequence[RequestView]]:
        """The scheduler's snapshot of running requests and the waiting head, as the engine
        builds it (called at every decision: kept lean)."""
        ps = self.page_size
        running = []
        for r in self.running.values():
            v = r.view
            v.num_computed = r.computed
            v.tokens_to_compute = r.prefill_left or 1
            v.pages_held = v.pages_releasable = -(-r.computed // ps)
            running.append(v)

        def waiting(r: SimRequest) -> RequestView:
            entry = self.idle.get(r.traj.tid)
            cached = entry.device + entry.host if entry is not None else 0
            held = entry.device // ps if entry is not None else 0
            todo = max(r.traj.context - cached, 1)
            return RequestView(r.rid, r.priority, r.arrival, cached, todo, held, 0, pages_idle=held)

        return running, _LazyViews(head, waiting)

    def _step(self) -> None:
        sim, cfg = self.sim, self.sim.config
        now = sim.clock.now
        if now < self.paused_until:  # the weights are being updated
            sim.clock.at(self.paused_until, self._step)
            return
        sim.counters.decisions += 1
        head = self.waiting[: cfg.waiting_head]
        running, waiting = self._views(head)
        # As the engine counts it: free pages plus every idle page (evictable, a waiting request's
        # own cached context included; its `pages_held` keeps it from being asked for twice).
        free = self.capacity - sum(v.pages_held for v in running)
        reserved, release_at = self._reserved_pages(head)
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
        plan = sim.scheduler.schedule(snap)
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
        evictions = sim.counters.evictions
        seen = self._seen(reserved, stop)
        ran, split, pages = self._run(plan, head)
        if not ran:
            self.busy = False
            if plan.run:  # what was planned lost its pages: the engine loop plans again soon
                sim.clock.at(now + RETRY_AFTER_S, self._kick)
            elif release_at is not None:
                # Nothing fits: KV frees when a tool returns or a trajectory's KV is let go,
                # and reserved KV when its pin expires.
                sim.clock.at(release_at, self._kick)
            return
        # The engine packs single-token rows first and samples in that order.
        ran.sort(key=lambda item: item[1] > 1)
        sampling: list[tuple[SimRequest, int]] = []
        prefilling: list[SimRequest] = []
        decoders = context = 0
        for req, _, decodes in ran:
            if decodes:
                sampling.append((req, req.computed))
                decoders += 1
                context += req.computed
            else:
                prefilling.append(req)
                if not req.prefill_left:  # its last chunk samples; it decodes from the next on
                    sampling.append((req, req.computed - 1))
        seconds = sum(split.values())  # and the decodes, with the iteration's fixed cost:
        seconds += sim.cost.decode_step_s(decoders, context) or sim.cost.gpu.t_fix
        # A first token is sampled only here: a span's later iterations never end a prefill.
        for req, _ in sampling:
            if req.tool_returned_at is not None:
                sim.counters.tool_returns += 1
                sim.counters.tool_return_wait_s += now + seconds - req.tool_returned_at
                req.tool_returned_at = None
        span = _Span(sampling, prefill=None, chunk=0, budget_bound=False, hold=0,
                     release_at=release_at, repeats=False)  # fmt: skip
        hold = reserved
        if plan.preempt:
            pass
        elif not prefilling:
            # Decodes only, the same again unless an eviction changed what the plan reads.
            span.repeats = sim.counters.evictions == evictions or seen == self._seen(
                self._reserved_pages(head)[0], stop
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
            hold, span.release_at = self._reserved_pages(self.waiting[: cfg.waiting_head])
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
            hold, span.release_at = self._reserved_pages(head)
            span.repeats = not head or seen == self._seen(hold, stop)
            span.head = stop if head else None
        span.repeats = span.repeats and not cfg.decide_every_iteration
        span.start = now
        span.ends.append(now + seconds)
        span.pages.append(pages)
        span.first = (split["prefill"], split["reprefill"], split["transfers"])
        span.spent = list(span.first)
        if span.repeats:  # after the pages this iteration's decodes open
            opened = sum(
                1 for r, base in sampling if base == r.computed and not base % cfg.page_size
            )
            self._decode_on(span, hold, evict=False, opened=opened)
        self._span = span
        self._end_at(span.ends[-1])

    def _decode_on(self, span: _Span, hold: int, evict: bool, opened: int = 0) -> bool:
        """Plans the span's iterations from its next, its `sampling` decoding in every one (and
        its prefill's chunks, if any), and says if it planned any. `hold`: the reserve, kept if a
        request of the plan is best-effort; `opened`: pages running requests opened in the
        iterations already planned (not yet in their `computed`)."""
        ps, req = self.page_size, span.prefill
        if any(r.priority < HIGH for r, _ in span.sampling) or (
            req is not None and req.priority < HIGH
        ):
            span.hold = hold
        span.running_pages = sum(-(-r.computed // ps) for r in self.running.values()) + opened
        span.crossing = crossing = [0] * ps
        for _, base in span.sampling:
            crossing[base % ps] += 1
        span.context = sum(base for _, base in span.sampling)
        span.most = min((r.decode_left for r, _ in span.sampling), default=1 << 62)
        return self._iterate(span, evict)

    def _iterate(self, span: _Span, evict: bool) -> bool:
        """Plans the span's next iterations, as decisions would, while a decision would plan the
        same: no decode has finished its action, the prefill chunk is as long, the pages fit
        without preempting, without the reserve and without evicting, except in the first if
        `evict` (then `span.start` is now: it is the event's first). Says if it planned any.
        (The simulator's innermost loop: kept lean.)"""
        sim, ps, capacity = self.sim, self.page_size, self.capacity
        decode, t_fix = sim.cost.decode_step_s, sim.cost.gpu.t_fix
        most = min(span.most - span.done, sim.config.max_merged_iterations)
        req, m, hold, release_at = span.prefill, span.chunk, span.hold, span.release_at
        crossing, batch, context = span.crossing, len(span.sampling), span.context
        ends, pages, spent = span.ends, span.pages, span.spent
        running = span.running_pages
        idle = self.idle_device // ps
        first = i = len(ends)
        start = ends[-1] if i else span.start
        while i < most and (release_at is None or start < release_at):
            g = span.done + i  # iterations since the decision
            growth = crossing[-g % ps]  # decodes whose token of this iteration opens a page
            if req is not None:
                if req.prefill_left <= m:
                    break  # its last chunk: it samples, and the plan after differs
                growth += -(-(req.computed + m) // ps) - -(-req.computed // ps)
            if growth and capacity - running - growth < hold:
                break  # the scheduler would preempt or leave a request out
            used = running + idle
            assert used <= capacity, (used, capacity)
            if growth > capacity - used:
                if not evict or i:
                    break
                if req is None:  # decodes: the eviction may change what the next plan reads
                    head = [span.head] if span.head else []
                    seen = self._seen(self._reserved_pages(head)[0], span.head)
                    self._make_room(used, growth)
                    span.repeats = seen == self._seen(self._reserved_pages(head)[0], span.head)
                else:  # a plan that takes the whole token budget reads no cache
                    self._make_room(used, growth)
                idle = self.idle_device // ps
            transfers, self._transfer_s = self._transfer_s, 0.0  # evicting, copied to host
            prefill = reprefill = 0.0
            if req is not None:
                span.undo.append((req.computed, req.prefill_left, req.cached, len(req.segments)))
                prefill, reprefill = self._prefill_seconds(req, m, req.computed)
                req.computed += m
                req.prefill_left -= m
                if m > 1:
                    self._cache(req)
                spent[0] += prefill
                spent[1] += reprefill
            if transfers:
                spent[2] += transfers
            if not i:
                span.first = (prefill, reprefill, transfers)
            seconds = prefill + reprefill + transfers
            seconds += decode(batch, context + batch * g) or t_fix
            start += seconds
            ends.append(start)
            pages.append(used)
            running += growth
            i += 1
            if not span.repeats:
                break
        span.running_pages = running
        return i > first

    def _run(
        self, plan: StepPlan, head: list[SimRequest]
    ) -> tuple[list[tuple[SimRequest, int, bool]], dict[str, float], int]:
        """Admits and runs the plan's requests as the engine does: host KV loaded back, room made
        by eviction, a request the pages ran out for left out. Returns those that run (with
        their tokens and whether they decode), the seconds of the iteration so far, by use, and
        the device pages in use when it was planned."""
        sim, ps = self.sim, self.page_size
        used = pages = self._device_pages()
        assert used <= self.capacity, (used, self.capacity)
        self.peak_pages = max(self.peak_pages, used)
        split = {"prefill": 0.0, "reprefill": 0.0, "transfers": 0.0}
        ran: list[tuple[SimRequest, int, bool]] = []
        for rid, n in plan.run:
            req = self.running.get(rid)
            admitted: int | None = None  # tokens loaded from host, when admitted now
            if req is None:  # admitted: near the head's start (the scheduler admits in order)
                req = next(r for r in head if r.rid == rid)
                used, admitted = self._load(req.traj.tid, used)
                if admitted is None:
                    continue  # its host KV does not fit on the device yet: it waits
                split["transfers"] += sim.cost.transfer_s(admitted, to_device=True)
                self.waiting.remove(req)
                self.running[rid] = req
                self._admit(req)
            decodes = not req.prefill_left
            tokens = 1 if decodes else min(n, req.prefill_left)
            c = req.computed  # its new pages: pages_for(c + tokens) - pages_for(c), inlined
            growth = -(-(c + tokens) // ps) - -(-c // ps)
            if growth:  # most decodes stay within their last page
                used = self._make_room(used, growth)
                if used + growth > self.capacity:
                    # Earlier requests of the plan took the pages it counted on: it waits a step,
                    # back in the queue if it was just admitted.
                    if admitted is not None:
                        del self.running[rid]
                        self._release(req)
                        self._enqueue(req)
                    continue
                used += growth
            if admitted is not None:
                self._count_admission(req, admitted)
            if not decodes:
                prefill, reprefill = self._prefill_seconds(req, tokens, req.computed)
                split["prefill"] += prefill
                split["reprefill"] += reprefill
                req.computed += tokens
                req.prefill_left -= tokens
                if tokens > 1:
                    self._cache(req)  # the engine hands each prefill chunk's pages to the tree
            ran.append((req, tokens, decodes))
        if ran:  # device-to-host copies made meanwhile, charged to the iteration
            split["transfers"] += self._transfer_s
            self._transfer_s = 0.0
        return ran, split, pages

    def _prefill_seconds(self, req: SimRequest, tokens: int, computed: int) -> tuple[float, float]:
        """Seconds of a prefill chunk of `tokens` after `computed`: computing new KV, and
        computing again KV that was lost."""
        seconds = self.sim.cost.prefill_s(tokens, computed)
        lost = max(0, min(computed + tokens, req.lost_until) - computed)
        return seconds * (tokens - lost) / tokens, seconds * lost / tokens

    def _end_at(self, t: float) -> None:
        self._epoch += 1
        epoch = self._epoch
        self.sim.clock.at(t, lambda: self._end(epoch))

    def _end(self, epoch: int) -> None:
        if epoch != self._epoch or self._span is None:
            return  # superseded by a disturbance
        sim, span = self.sim, self._span
        self._span = None
        busy = span.ends[-1] - span.start
        self.busy_s += busy
        prefill, reprefill, transfers = span.spent
        self.spent["prefill"] += prefill
        self.spent["reprefill"] += reprefill
        self.spent["transfers"] += transfers
        self.spent["decode"] += busy - (prefill + reprefill + transfers)  # with fixed costs
        self.peak_pages = max(self.peak_pages, *span.pages)
        sim.counters.iterations += len(span.ends)
        span.done += len(span.ends)
        if span.repeats:  # the plan goes on, from an iteration that may evict
            span.start = sim.clock.now
            span.ends, span.pages, span.undo = [], [], []
            span.spent = [0.0, 0.0, 0.0]
            if self._iterate(span, evict=True):
                self._span = span
                self._end_at(span.ends[-1])
                return
        n, done = span.done, []
        for req, base in span.sampling:  # the simulator's innermost loop: kept lean
            req.computed = base + n  # with the KV of the token sampled before
            req.decode_left -= n
            if not req.decode_left:
                done.append(req)
        for req in done:
            del self.running[req.rid]
            self._release(req)
            sim.turn_done(req.traj)
        if span.repeats and done and self._decodes_go_on(span):
            return
        if self.running or self.waiting:
            self._step()
        else:
            self.busy = False

    def _decodes_go_on(self, span: _Span) -> bool:
        """After decodes finished their actions in iterations nothing disturbed, the next plan
        is known without asking the scheduler: the rest decoding, if they were all that ran and
        nothing waits; or, if a prefill's chunks took the rest of the token budget, the rest
        decoding and its chunk taking what they leave (no waiting request is read while the
        budget is spent). Runs it, unless new weights load or it does not fit as it is; says if
        it did. The reserve is as the finished ones left it."""
        now, cfg = self.sim.clock.now, self.sim.config
        req = span.prefill
        if now < self.paused_until or cfg.decide_every_iteration or (req is None and self.waiting):
            return False
        sampling = [(r, r.computed) for r, _ in span.sampling if r.decode_left]
        if req is None and (not sampling or len(sampling) != len(self.running)):
            return False
        span = _Span(sampling, prefill=req, chunk=cfg.token_budget - len(sampling),
                     budget_bound=req is not None, hold=0, release_at=None, start=now,
                     spent=[0.0] * 3)  # fmt: skip
        hold, span.release_at = self._reserved_pages(self.waiting[: cfg.waiting_head])
        if not self._decode_on(span, hold, evict=True):
            return False
        self._span = span
        self._end_at(span.ends[-1])
        return True

    # --- KV ------------------------------------------------------------------------------------

    def _load(self, tid: str, used: int) -> tuple[int, int | None]:
        """Loads the trajectory's host KV back, as the engine's admission does: the nodes that
        fit in free pages, then, after evicting other KV to make room (the host KV stays where
        it is meanwhile, and may be dropped to make host room), the rest. Returns the pages then
        in use and the tokens loaded, or None when some still do not fit."""
        entry = self.idle.get(tid)
        if entry is None or not entry.host:
            return used, 0
        ps, loaded = self.page_size, 0

        def load_what_fits() -> None:
            nonlocal used, loaded
            while entry.on_host:
                tokens = entry.segments[len(entry.segments) - entry.on_host]
                if tokens // ps > self.capacity - used:
                    return
                entry.on_host -= 1
                entry.host -= tokens
                entry.device += tokens
                self.idle_device += tokens
                self.host_used -= tokens
                used += tokens // ps
                loaded += tokens

        load_what_fits()
        if entry.host:
            used = self._make_room(used, entry.host // ps, keep=tid)
            load_what_fits()
        return used, None if entry.host else loaded

    def _admit(self, req: SimRequest) -> None:
        """The request takes its trajectory's cached KV."""
        entry = self.idle.pop(req.traj.tid, None)
        req.segments = entry.segments if entry is not None else []
        req.computed = req.cached = entry.device if entry is not None else 0
        self.idle_device -= req.computed
        req.prefill_left = req.traj.context - req.computed
        req.lost_until = req.traj.expected_cached

    def _count_admission(self, req: SimRequest, loaded: int) -> None:
        """Where an admission found its KV: on the device, on host (`loaded` tokens) or lost,
        to compute again."""
        sim, t = self.sim, req.traj
        sim.counters.host_hit_tokens += loaded
        sim.counters.loaded_bytes += loaded * sim.cost.model.kv_bytes_per_token
        lost = t.expected_cached - req.computed
        if lost > 0:
            sim.counters.reprefill_tokens += lost
            if req.resumed:
                sim.counters.reprefill_preempted_tokens += lost
            else:
                sim.counters.reprefill_evicted_tokens += lost
                self.reprefill_evicted_tokens += lost
        sim.counters.device_hit_tokens += req.computed - loaded

    def _cache(self, req: SimRequest) -> None:
        """The request's computed whole pages go to the radix tree, as one new node."""
        full = req.computed - req.computed % self.page_size
        if full > req.cached:
            req.segments.append(full - req.cached)
            req.cached = full

    def _release(self, req: SimRequest) -> None:
        """The request lets go of its KV: its whole pages stay in the tree, idle, the rest is
        freed; the tokens it sampled join its trajectory's record."""
        sim, t = self.sim, req.traj
        sampled = t.plan.turns[t.turn].action_tokens - req.decode_left - req.recorded
        t.context += sampled
        t.generated += sampled
        req.recorded += sampled
        self._cache(req)
        t.expected_cached = max(t.expected_cached, req.cached)
        if req.segments:
            sim.ticks += 1
            self.idle[t.tid] = _Idle(t.tid, req.segments, req.cached, req.priority, sim.ticks)
            self.idle_device += req.cached
        req.segments, req.computed, req.cached = [], 0, 0

    def _preempt(self, req: SimRequest) -> None:
        """A running request gives its pages up: its KV stays in the tree, idle, where eviction
        may take it; it waits again with the tokens it sampled kept in its context."""
        self.sim.counters.preemptions += 1
        self._release(req)
        req.resumed = True
        self._enqueue(req)

    def _reserved_pages(self, head: list[SimRequest]) -> tuple[int, float | None]:
        """As the engine counts them: idle device pages of high-priority trajectories within their
        retention pin, off limits to best-effort requests (trajectory retention only); and when
        the first of those pins expires. Nothing when no request the scheduler sees (running, or
        at the `head` of the queue) is best-effort."""
        sim = self.sim
        if all(r.priority >= HIGH for r in self.running.values()) and all(
            r.priority >= HIGH for r in head
        ):
            return 0, None
        now, reserved = sim.clock.now, sim.retention.reserved
        tokens, release_at = 0, None
        for e in self.idle.values():  # `_reserves`, inlined: this runs at every decision
            if e.device and not e.finished and reserved(e.view(), now):
                tokens += e.device
                deadline = e.pin_deadline or now
                if release_at is None or deadline < release_at:
                    release_at = deadline
        return tokens // self.page_size, release_at

    def _seen(self, reserved: int, stop: SimRequest | None) -> tuple[int, int, int]:
        """What evicting idle KV can change of the next plan when no request that waits is
        admitted: the pages in the reserve (`reserved`, of `_reserved_pages`), and the cached
        KV (on the device, on host) of the request where the plan stopped reading the queue."""
        entry = self.idle.get(stop.traj.tid) if stop is not None else None
        return (reserved, entry.device, entry.host) if entry is not None else (reserved, 0, 0)

    def _reserves(self, entry: _Idle) -> bool:
        """Is this idle KV in the reserve? Finished KV has no live owner, whom a reservation
        would be for (the engine skips such nodes too)."""
        return bool(
            entry.device
            and not entry.finished
            and self.sim.retention.reserved(entry.view(), self.sim.clock.now)
        )

    def _kick(self) -> None:
        if not self.busy and (self.running or self.waiting):
            self.busy = True
            self._step()

    def _make_room(self, used: int, need: int, keep: str | None = None) -> int:
        """Evicts idle KV (not the device KV of trajectory `keep`) until `need` more pages fit,
        as the engine's tree does: candidates in the retention policy's order, each path from
        its end; returns the pages then in use."""
        free = self.capacity - used
        if need <= free:
            return used
        sim = self.sim
        now = sim.clock.now
        ret, ps = sim.retention, self.page_size
        candidates = sorted(
            (eviction_key(ret, e.view(), now), tid)
            for tid, e in self.idle.items()
            if e.device and tid != keep
        )
        evicted = 0
        for key, tid in candidates:
            entry = self.idle[tid]
            while need > free and entry.device:
                i = len(entry.segments) - entry.on_host - 1
                tokens = entry.segments[i]
                free += tokens // ps
                evicted += 1
                entry.device -= tokens
                self.idle_device -= tokens
                if ret.offload(entry.view(i), now) and self._to_host(tokens, key):
                    entry.on_host += 1
                    entry.host += tokens
                else:  # dropped, with the host part of its path
                    self.host_used -= entry.host
                    del entry.segments[i:]
                    entry.on_host = entry.host = 0
                    if not entry.segments:
                        del self.idle[tid]
            if need <= free:
                break
        sim.counters.evictions += evicted
        return self.capacity - free

    def _to_host(self, tokens: int, key: tuple[Any, float]) -> bool:
        """Copies KV to host memory if it has room, made where needed by dropping host KV that
        ranks below `key`; the copy's time is charged to the iteration (not overlapped: a
        conservative choice)."""
        short = tokens - (self.host_capacity - self.host_used)
        if short > 0 and not self._make_host_room(short, key):
            return False
        self.host_used += tokens
        cost = self.sim.cost
        self.sim.counters.offloaded_bytes += tokens * cost.model.kv_bytes_per_token
        self._transfer_s += cost.transfer_s(tokens, to_device=False)
        return True

    def _make_host_room(self, tokens: int, below: tuple[Any, float]) -> bool:
        """Drops the last host node of paths ranking below `below`, smallest first, until
        `tokens` fit; drops nothing unless that is enough (the engine's tree does the same)."""
        sim = self.sim
        now = sim.clock.now
        leaves = sorted(
            (eviction_key(sim.retention, e.view(len(e.segments) - 1), now), tid)
            for tid, e in self.idle.items()
            if e.on_host
        )
        chosen, room = [], 0
        for key, tid in leaves:
            if room >= tokens or not key < below:
                break
            chosen.append(tid)
            room += self.idle[tid].segments[-1]
        if room < tokens:
            return False
        for tid in chosen:
            entry = self.idle[tid]
            dropped = entry.segments.pop()
            entry.on_host -= 1
            entry.host -= dropped
            self.host_used -= dropped
            if not entry.segments:
                del self.idle[tid]
        return True
