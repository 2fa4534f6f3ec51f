"""The KV bookkeeping of one simulated engine, as `venusrl.engine.Engine` keeps it: device pages,
whole pages cached in a radix tree, trajectories' idle KV evicted node by node in the retention
policy's order (offloaded to a bounded host tier or dropped), loaded back at admission, and the
reserve that best-effort requests may not take. Apart from the step loop (`sim/engine.py`), as
nano-vllm's block manager is apart from its scheduler; the modelling notes are engine.py's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from venusrl.policy.critical_groups import critical
from venusrl.policy.kv_retention import IdleKV, RetentionPolicy, eviction_key
from venusrl.sim.cost_model import CostModel
from venusrl.sim.types import Clock, Counters, SimRequest


@dataclass(eq=False)
class IdleEntry:
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


class SimKV:
    """One engine's KV: `capacity` device pages of `page_size` tokens and `host_capacity` tokens
    on host. Running requests hold the pages of what they computed (the engine counts those);
    what they let go of stays in `idle`, by trajectory, until evicted. Counts into `counters`;
    `retention` decides what is evicted first and whether it is offloaded."""

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        page_size: int,
        retention: RetentionPolicy,
        counters: Counters,
    ) -> None:
        self.clock, self.cost, self.retention, self.counters = clock, cost, retention, counters
        self.page_size = page_size
        self.capacity = cost.kv_capacity_tokens // page_size  # pages
        self.host_capacity = cost.host_capacity_tokens  # tokens
        self.host_used = 0
        self.idle: dict[str, IdleEntry] = {}  # trajectory id -> its KV between requests
        self.idle_device = 0  # tokens of `idle` on the device
        self.transfer_s = 0.0  # device-to-host copies made while planning this iteration
        # Seconds of copying out another engine's device KV that moved here, by trajectory
        # (`move`), until its turn is admitted.
        self.moved_in: dict[str, float] = {}
        self._ticks = 0  # the tree's access clock, for LRU

    def check(self) -> None:
        """The books agree with themselves (as `KVManager.check` for the engine): each idle path
        is whole pages, split into a device part and a host suffix; the totals are the sums of
        the paths; the host tier holds no more than it has."""
        ps, device, host = self.page_size, 0, 0
        for tid, e in self.idle.items():
            assert e.tid == tid and e.segments, f"{tid}: an idle entry with no KV is kept"
            assert all(t > 0 and t % ps == 0 for t in e.segments), f"{tid}: not whole pages"
            assert 0 <= e.on_host <= len(e.segments), f"{tid}: {e.on_host} host nodes"
            split = len(e.segments) - e.on_host
            assert e.device == sum(e.segments[:split]), f"{tid}: device tokens miscounted"
            assert e.host == sum(e.segments[split:]), f"{tid}: host tokens miscounted"
            device, host = device + e.device, host + e.host
        assert self.idle_device == device, f"idle device tokens {self.idle_device} != {device}"
        assert self.host_used == host, f"host tokens {self.host_used} != {host}"
        assert host <= self.host_capacity, f"host tier over capacity: {host}"
        assert device // ps <= self.capacity, f"idle KV over the device: {device} tokens"

    # --- owners ----------------------------------------------------------------------------------

    def owner_returns(self, tid: str, priority: int) -> bool:
        """The trajectory's next request arrived (the tool answered): its idle KV is that
        request's now, at its priority and unpinned. Says if the KV left the reserve."""
        entry = self.idle.get(tid)
        if entry is None:
            return False
        unreserved = self.reserves(entry)
        entry.set_owner(priority=priority, pin_deadline=None, finished=entry.finished)
        return unreserved

    def pin(self, tid: str, deadline: float) -> bool:
        """The trajectory waits on a tool until about `deadline`; says if it has idle KV."""
        entry = self.idle.get(tid)
        if entry is None:
            return False
        entry.set_owner(priority=entry.priority, pin_deadline=deadline, finished=entry.finished)
        return True

    def owner_finished(self, tid: str) -> bool:
        """No request of the trajectory follows: its KV stays until evicted, first of all by
        policies that know it is finished. Says if the KV left the reserve."""
        entry = self.idle.get(tid)
        if entry is None or entry.finished:  # (its reward's end says it again)
            return False
        unreserved = self.reserves(entry)
        entry.set_owner(priority=entry.priority, pin_deadline=entry.pin_deadline, finished=True)
        return unreserved

    # --- requests ------------------------------------------------------------------------------

    def load(self, tid: str, used: int) -> tuple[int, int | None]:
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
            used = self.make_room(used, entry.host // ps, keep=tid)
            load_what_fits()
        return used, None if entry.host else loaded

    def admit(self, req: SimRequest) -> None:
        """The request takes its trajectory's cached KV."""
        entry = self.idle.pop(req.traj.tid, None)
        req.segments = entry.segments if entry is not None else []
        req.computed = req.cached = entry.device if entry is not None else 0
        self.idle_device -= req.computed
        req.prefill_left = req.traj.context - req.computed
        req.lost_until = req.traj.expected_cached

    def count_admission(self, req: SimRequest, loaded: int) -> int:
        """Counts where an admission found its KV: on the device, on host (`loaded` tokens) or
        lost, to compute again. Returns the tokens lost to eviction (admission control's cache
        signal)."""
        counters, t = self.counters, req.traj
        counters.host_hit_tokens += loaded
        counters.loaded_bytes += loaded * self.cost.model.kv_bytes_per_token
        counters.device_hit_tokens += req.computed - loaded
        lost = t.expected_cached - req.computed
        if lost <= 0:
            return 0
        counters.reprefill_tokens += lost
        if req.resumed:
            counters.reprefill_preempted_tokens += lost
            return 0
        counters.reprefill_evicted_tokens += lost
        return lost

    def cache(self, req: SimRequest) -> None:
        """The request's computed whole pages go to the radix tree, as one new node."""
        full = req.computed - req.computed % self.page_size
        if full > req.cached:
            req.segments.append(full - req.cached)
            req.cached = full

    def release(self, req: SimRequest) -> None:
        """The request lets go of its KV: its whole pages stay in the tree, idle, the rest is
        freed; the tokens it sampled join its trajectory's record."""
        t = req.traj
        sampled = req.action_tokens - req.decode_left - req.recorded
        t.context += sampled
        t.generated += sampled
        req.recorded += sampled
        self.cache(req)
        t.expected_cached = max(t.expected_cached, req.cached)
        if req.segments:
            self._ticks += 1
            self.idle[t.tid] = IdleEntry(t.tid, req.segments, req.cached, req.priority, self._ticks)
            self.idle_device += req.cached
        req.segments, req.computed, req.cached = [], 0, 0

    def flush(self) -> None:
        """Drops every KV no running request holds, on both tiers (the engine's `flush_cache`):
        the next turn of a trajectory between turns computes its context again."""
        self.counters.evictions += sum(len(e.segments) for e in self.idle.values())
        self.idle.clear()
        self.idle_device = self.host_used = 0
        self.moved_in.clear()

    # --- migration ---------------------------------------------------------------------------

    def move(self, tid: str, to: SimKV) -> None:
        """The trajectory's idle KV leaves this engine for `to`'s host tier, from which its next
        turn loads it: its device part is copied out (to host memory, which the engines of a
        node share). When `to`'s host tier has no room for it, it is dropped here and its next
        turn computes it again there. The copy out is charged with the load back, to the
        iteration that admits the turn (`moved_in`): the turn waits for both."""
        entry = self.idle.pop(tid, None)
        if entry is None:
            return
        self.idle_device -= entry.device
        self.host_used -= entry.host
        tokens = entry.device + entry.host
        short = tokens - (to.host_capacity - to.host_used)
        key = (to.retention.rank(entry.view(), to.clock.now), float("inf"))
        if short > 0 and not to._make_host_room(short, key):
            self.counters.moves_dropped += 1
            return
        if entry.device:
            self.counters.offloaded_bytes += entry.device * self.cost.model.kv_bytes_per_token
            to.moved_in[tid] = self.cost.transfer_s(entry.device, to_device=False)
        to._ticks += 1
        entry.on_host, entry.host, entry.device = len(entry.segments), tokens, 0
        entry.last_use = to._ticks
        entry.set_owner(priority=entry.priority, pin_deadline=None, finished=False)
        to.idle[tid] = entry
        to.host_used += tokens

    # --- the reserve -----------------------------------------------------------------------------

    def reserved_pages(
        self, running: Iterable[SimRequest], head: list[SimRequest]
    ) -> tuple[int, float | None]:
        """As the engine counts them: idle device pages of high-priority trajectories within their
        retention pin, off limits to best-effort requests (trajectory retention only); and when
        the first of those pins expires. Nothing when no request the scheduler sees (`running`,
        or at the `head` of the queue) is best-effort."""
        if all(critical(r.priority) for r in [*running, *head]):
            return 0, None
        now, reserved = self.clock.now, self.retention.reserved
        tokens, release_at = 0, None
        for e in self.idle.values():  # `reserves`, inlined: this runs at every decision
            if e.device and not e.finished and reserved(e.view(), now):
                tokens += e.device
                deadline = e.pin_deadline or now
                if release_at is None or deadline < release_at:
                    release_at = deadline
        return tokens // self.page_size, release_at

    def seen(self, reserved: int, stop: SimRequest | None) -> tuple[int, int, int]:
        """What evicting idle KV can change of the next plan when no request that waits is
        admitted: the pages in the reserve (`reserved`, of `reserved_pages`), and the cached
        KV (on the device, on host) of the request where the plan stopped reading the queue."""
        entry = self.idle.get(stop.traj.tid) if stop is not None else None
        return (reserved, entry.device, entry.host) if entry is not None else (reserved, 0, 0)

    def reserves(self, entry: IdleEntry) -> bool:
        """Is this idle KV in the reserve? Finished KV has no live owner, whom a reservation
        would be for (the engine skips such nodes too)."""
        return bool(
            entry.device
            and not entry.finished
            and self.retention.reserved(entry.view(), self.clock.now)
        )

    # --- eviction ------------------------------------------------------------------------------

    def make_room(self, used: int, need: int, keep: str | None = None) -> int:
        """Evicts idle KV (not the device KV of trajectory `keep`) until `need` more pages fit,
        as the engine's tree does: candidates in the retention policy's order, each path from
        its end; returns the pages then in use."""
        free = self.capacity - used
        if need <= free:
            return used
        now = self.clock.now
        ret, ps = self.retention, self.page_size
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
        self.counters.evictions += evicted
        return self.capacity - free

    def _to_host(self, tokens: int, key: tuple[Any, float]) -> bool:
        """Copies KV to host memory if it has room, made where needed by dropping host KV that
        ranks below `key`; the copy's time is charged to the iteration (not overlapped: a
        conservative choice)."""
        short = tokens - (self.host_capacity - self.host_used)
        if short > 0 and not self._make_host_room(short, key):
            return False
        self.host_used += tokens
        cost = self.cost
        self.counters.offloaded_bytes += tokens * cost.model.kv_bytes_per_token
        self.transfer_s += cost.transfer_s(tokens, to_device=False)
        return True

    def _make_host_room(self, tokens: int, below: tuple[Any, float]) -> bool:
        """Drops the last host node of paths ranking below `below`, smallest first, until
        `tokens` fit; drops nothing unless that is enough (the engine's tree does the same)."""
        now = self.clock.now
        leaves = sorted(
            (eviction_key(self.retention, e.view(len(e.segments) - 1), now), tid)
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
