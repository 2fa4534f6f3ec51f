"""Engine iterations that repeat one decision's plan, run as one event of the simulator.

A simulated engine (`sim/engine.py`) asks its scheduler only when the plan may change; the
iterations in between are planned here as a decision would plan them (their pages, their cost),
so the figures are those of deciding every iteration (`SimConfig.decide_every_iteration`,
checked by a test) and a scenario of millions of tokens runs in minutes.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass, field

from venusrl.policy.critical_groups import critical
from venusrl.sim.cost_model import CostModel
from venusrl.sim.kv import SimKV
from venusrl.sim.types import SimRequest


@dataclass(eq=False)
class Span:
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

    def pages_opened(self, now: float, page_size: int) -> int:
        """Device pages that the iterations begun by `now` hold beyond what their requests'
        state says (it is brought up to date when the span ends), as if each had been an event
        of its own."""
        k = self.started(now)
        ps, ended, pages = page_size, self.done + k - 1, 0
        for r, base in self.sampling:
            pages += -(-max(r.computed, base + ended) // ps) - -(-r.computed // ps)
        if self.prefill is not None and k < len(self.undo):
            computed = self.prefill.computed
            pages -= -(-computed // ps) - -(-self.undo[k][0] // ps)
        return pages


class SpanPlanner:
    """Plans a span's iterations on one engine's KV and cost model; at most `max_merged` to an
    event."""

    def __init__(
        self, kv: SimKV, cost: CostModel, max_merged: int, overlap_copies: bool = True
    ) -> None:
        """`overlap_copies`: device-to-host copies run beside the compute (a side stream), so an
        iteration takes the longer of the two; else their time is added to it."""
        self.kv, self.cost, self.max_merged = kv, cost, max_merged
        self.overlap_copies = overlap_copies

    def exposed(self, transfers: float, compute: float) -> float:
        """Seconds of device-to-host copying an iteration waits for beyond its `compute`."""
        if not self.overlap_copies:
            return transfers
        return transfers - compute if transfers > compute else 0.0

    def prefill_seconds(self, req: SimRequest, tokens: int, computed: int) -> tuple[float, float]:
        """Seconds of a prefill chunk of `tokens` after `computed`: computing new KV, and
        computing again KV that was lost."""
        seconds = self.cost.prefill_s(tokens, computed)
        lost = max(0, min(computed + tokens, req.lost_until) - computed)
        return seconds * (tokens - lost) / tokens, seconds * lost / tokens

    def first(
        self,
        ran: list[tuple[SimRequest, int, bool]],
        split: dict[str, float],
        pages: int,
        now: float,
        release_at: float | None,
    ) -> tuple[Span, list[SimRequest]]:
        """The span of a decision's plan, planned as far as its first iteration, which starts
        `now`: who samples in it and what it costs (`ran`: who ran how many tokens and whether
        they decode; `split`: the seconds of its prefills and transfers; `pages`: in use when it
        was planned). Returns it, and those whose prefill ran in it, in order."""
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
        # The decodes, with the iteration's fixed cost, and the prefills; then the copies.
        compute = split["prefill"] + split["reprefill"]
        compute += self.cost.decode_step_s(decoders, context) or self.cost.gpu.t_fix
        split["transfers"] = split.pop("loads") + self.exposed(split["transfers"], compute)
        seconds = compute + split["transfers"]
        span = Span(sampling, prefill=None, chunk=0, budget_bound=False, hold=0,
                    release_at=release_at, repeats=False, start=now)  # fmt: skip
        span.ends.append(now + seconds)
        span.pages.append(pages)
        span.first = (split["prefill"], split["reprefill"], split["transfers"])
        span.spent = list(span.first)
        return span, prefilling

    def stop_after(self, span: Span, k: int) -> None:
        """The span's iterations from its `k`th on do not run: its prefill's chunks in them are
        not computed."""
        del span.ends[k:], span.pages[k:]
        if span.prefill is None:
            return
        req, spent = span.prefill, list(span.first)
        for computed, *_ in span.undo[1:k]:
            prefill, reprefill = self.prefill_seconds(req, span.chunk, computed)
            spent[0] += prefill
            spent[1] += reprefill
        req.computed, req.prefill_left, req.cached, segments = span.undo[k]
        del req.segments[segments:], span.undo[k:]
        span.spent = spent

    def decode_on(
        self,
        span: Span,
        running: Collection[SimRequest],
        hold: int,
        evict: bool,
        opened: int = 0,
    ) -> bool:
        """Plans the span's iterations from its next, its `sampling` decoding in every one (and
        its prefill's chunks, if any), and says if it planned any. `running`: the engine's
        running requests; `hold`: the reserve, kept if a request of the plan is best-effort;
        `opened`: pages running requests opened in the iterations already planned (not yet in
        their `computed`)."""
        ps, req = self.kv.page_size, span.prefill
        if any(not critical(r.priority) for r, _ in span.sampling) or (
            req is not None and not critical(req.priority)
        ):
            span.hold = hold
        span.running_pages = sum(-(-r.computed // ps) for r in running) + opened
        span.crossing = crossing = [0] * ps
        for _, base in span.sampling:
            crossing[base % ps] += 1
        span.context = sum(base for _, base in span.sampling)
        span.most = min((r.decode_left for r, _ in span.sampling), default=1 << 62)
        return self.iterate(span, running, evict)

    def iterate(self, span: Span, running: Collection[SimRequest], evict: bool) -> bool:
        """Plans the span's next iterations, as decisions would, while a decision would plan the
        same: no decode has finished its action, the prefill chunk is as long, the pages fit
        without preempting, without the reserve and without evicting, except in the first if
        `evict` (then `span.start` is now: it is the event's first). Says if it planned any.
        (The simulator's innermost loop: kept lean.)"""
        kv = self.kv
        ps, capacity = kv.page_size, kv.capacity
        decode, t_fix = self.cost.decode_step_s, self.cost.gpu.t_fix
        most = min(span.most - span.done, self.max_merged)
        req, m, hold, release_at = span.prefill, span.chunk, span.hold, span.release_at
        crossing, batch, context = span.crossing, len(span.sampling), span.context
        ends, pages, spent = span.ends, span.pages, span.spent
        held = span.running_pages
        idle = kv.idle_device // ps
        first = i = len(ends)
        start = ends[-1] if i else span.start
        while i < most and (release_at is None or start < release_at):
            g = span.done + i  # iterations since the decision
            growth = crossing[-g % ps]  # decodes whose token of this iteration opens a page
            if req is not None:
                if req.prefill_left <= m:
                    break  # its last chunk: it samples, and the plan after differs
                growth += -(-(req.computed + m) // ps) - -(-req.computed // ps)
            if growth and capacity - held - growth < hold:
                break  # the scheduler would preempt or leave a request out
            used = held + idle
            assert used <= capacity, (used, capacity)
            if growth > capacity - used:
                if not evict or i:
                    break
                if req is None:  # decodes: the eviction may change what the next plan reads
                    head = [span.head] if span.head else []
                    seen = kv.seen(kv.reserved_pages(running, head)[0], span.head)
                    kv.make_room(used, growth)
                    span.repeats = seen == kv.seen(kv.reserved_pages(running, head)[0], span.head)
                else:  # a plan that takes the whole token budget reads no cache
                    kv.make_room(used, growth)
                idle = kv.idle_device // ps
            transfers, kv.transfer_s = kv.transfer_s, 0.0  # evicting, copied to host
            prefill = reprefill = 0.0
            if req is not None:
                span.undo.append((req.computed, req.prefill_left, req.cached, len(req.segments)))
                prefill, reprefill = self.prefill_seconds(req, m, req.computed)
                req.computed += m
                req.prefill_left -= m
                if m > 1:
                    kv.cache(req)
                spent[0] += prefill
                spent[1] += reprefill
            compute = prefill + reprefill + (decode(batch, context + batch * g) or t_fix)
            if transfers:
                transfers = self.exposed(transfers, compute)
                spent[2] += transfers
            if not i:
                span.first = (prefill, reprefill, transfers)
            seconds = compute + transfers
            start += seconds
            ends.append(start)
            pages.append(used)
            held += growth
            i += 1
            if not span.repeats:
                break
        span.running_pages = held
        return i > first
