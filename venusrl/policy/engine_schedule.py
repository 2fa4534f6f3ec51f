"""Which requests an engine step runs, how many tokens each, and whom it preempts.

Pure policy (DESIGN.md contract 1): it sees a snapshot of the engine's queues and KV occupancy and
returns a plan; it reads no clock, does no I/O and imports neither torch nor Ray, so the engine and
the simulator run the same object.

`PriorityScheduler` is continuous batching with chunked prefill under a token budget:

1. Running requests go first, in priority order (higher `priority` first, then arrival). Each
   runs one token (decode) or its next prefill chunk, within the step's token budget.
2. Waiting requests are then admitted in the same order while slots, budget and pages last. A
   waiting request whose next uncached page another request is computing right now (a GRPO
   sibling) is deferred, so the shared prompt is computed once and then served from the cache.
3. When pages run short, running requests of *strictly lower* priority are preempted, lowest
   priority and latest arrival first. High-priority work therefore never waits behind
   low-priority work, and requests of equal priority never preempt each other to get in.
4. Best-effort filling: `reserved_pages` of the free pages (the idle KV of high-priority
   trajectories waiting on a tool, which the engine would otherwise evict to make room) are off
   limits to requests below `reserve_priority`. Low-priority work runs in the capacity left over
   and never pushes that KV out; high-priority work may use it.

With every priority equal it is plain FCFS continuous batching.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)  # built for every request on every step: keep it cheap
class RequestView:
    request_id: str
    priority: int
    arrival: int
    num_computed: int  # tokens with KV already in pages (for waiting: the prefix-cache hit)
    tokens_to_compute: int
    pages_held: int  # device pages the request would keep using (shared prefix included)
    pages_releasable: int  # device pages freed or made evictable if it is preempted
    prefix_key: Hashable | None = None  # identity of its next uncached page (waiting only)
    prefix_in_flight: bool = False  # another running request is computing that page now
    # Waiting only: of `pages_held`, those counted in `free_pages` (cached, evictable) that
    # admitting it takes out of the free count (it locks them).
    pages_idle: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    running: Sequence[RequestView]
    waiting: Sequence[RequestView]  # the head of the queue, in `queue_order`
    free_pages: int  # free in the allocator plus evictable in the prefix cache
    page_size: int
    token_budget: int
    max_running: int
    reserved_pages: int = 0  # of free_pages, kept for requests of at least reserve_priority
    reserve_priority: int = 0


@dataclass(frozen=True)
class StepPlan:
    run: tuple[tuple[str, int], ...]  # (request_id, tokens this step), in planning order
    preempt: tuple[str, ...]


# When a step runs nothing (its planned requests lost their pages to earlier ones), the engine
# loop plans again after this wait, or at once when a request arrives.
RETRY_AFTER_S = 0.005


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def pages_needed(view: RequestView, num_tokens: int, page_size: int) -> int:
    return max(0, pages_for(view.num_computed + num_tokens, page_size) - view.pages_held)


class Queued(Protocol):
    @property
    def priority(self) -> int: ...
    @property
    def arrival(self) -> int: ...


def queue_order(item: Queued) -> tuple[int, int]:
    """Sort key of the waiting queue and of the running set: priority, then arrival. Engines
    keep their queues in it (the real one and the simulated one alike)."""
    return (-item.priority, item.arrival)


class PriorityScheduler:
    def schedule(self, snap: EngineSnapshot) -> StepPlan:
        budget, free = snap.token_budget, snap.free_pages
        planned: dict[str, int] = {}
        preempted: list[str] = []
        by_order = sorted(snap.running, key=queue_order)
        victims = list(by_order)  # the last one is preempted first

        def make_room(need: int, view: RequestView, waiting: bool) -> bool:
            """Preempt victims until `need` pages are free. A waiting request may only displace
            strictly lower priority; a running one any request behind it in queue order, so
            equal-priority requests cannot deadlock on a full cache."""
            nonlocal free, budget
            chosen: list[RequestView] = []
            gain = 0
            for victim in reversed(victims):
                if need <= free + gain:
                    break
                if victim is view or (
                    victim.priority >= view.priority
                    if waiting
                    else queue_order(victim) <= queue_order(view)
                ):
                    break
                chosen.append(victim)
                gain += victim.pages_releasable
                tokens = planned.get(victim.request_id, 0)
                gain += pages_needed(victim, tokens, snap.page_size) if tokens else 0
            if need > free + gain:
                return False  # preempting would not make enough room: preempt nobody
            for victim in chosen:
                victims.remove(victim)
                budget += planned.pop(victim.request_id, 0)
                preempted.append(victim.request_id)
            free += gain
            return True

        ps = snap.page_size

        def plan(view: RequestView, waiting: bool) -> bool:
            nonlocal free, budget
            n = min(view.tokens_to_compute, budget)
            # pages_needed(), inlined: this runs for every request at every engine step.
            grow = -(-(view.num_computed + n) // ps) - view.pages_held
            need = (grow if grow > 0 else 0) + view.pages_idle
            if need or free < 0:  # most decodes fit in their last page: nothing to make room for
                # Below the reserve priority, the reserved pages are not there to take: such a
                # request runs in leftover capacity (or in what preempting lower work frees).
                hold = snap.reserved_pages if view.priority < snap.reserve_priority else 0
                if not make_room(need + hold if need else 0, view, waiting):
                    return False
            planned[view.request_id] = n
            free -= need
            budget -= n
            return True

        # Decodes before prefill chunks, so a long prompt never starves the decoding batch.
        decodes_first = [v for v in by_order if v.tokens_to_compute <= 1]
        decodes_first += [v for v in by_order if v.tokens_to_compute > 1]
        for view in decodes_first:
            if budget > 0 and view.request_id not in preempted:
                plan(view, waiting=False)  # if it gets no pages it waits a step

        prefixes_in_flight = set()
        active = len(snap.running) - len(preempted)
        # Never more running requests than decode tokens per step, or some would never decode.
        most_running = min(snap.max_running, snap.token_budget)
        for view in snap.waiting:
            if budget <= 0 or active >= most_running:
                break
            if view.prefix_in_flight or (
                view.prefix_key is not None and view.prefix_key in prefixes_in_flight
            ):
                continue  # a sibling computes the shared prefix; admit it once that is cached
            if not plan(view, waiting=True):
                break  # FCFS within a priority: later arrivals do not jump the queue
            active += 1
            if view.prefix_key is not None:
                prefixes_in_flight.add(view.prefix_key)

        return StepPlan(run=tuple(planned.items()), preempt=tuple(preempted))
