"""The engine's KV, with one owner: device and host pages, the radix tree over them, what is
known of each trajectory between its requests, and layer bands.

The step loop (`engine.Engine`) asks it to admit a request with its cached prefix, to reserve
pages for the tokens it computes, to hand computed pages to the tree and to release a request
that stops. Ownership of device pages (`check()`): each page is free, owned by the radix tree,
or owned by exactly one running request; a request's first `num_shared_pages` pages are the
tree's, kept alive by a lock on `tree_node`.

Idle KV (DESIGN.md, "Trajectory-aware radix cache"): between two turns of a trajectory its KV
stays in the tree, unlocked. When pages run short the tree evicts in the order of a retention
policy (`policy.kv_retention`) that sees each node's owners: whether their episodes are over
(`end_trajectory`), their priority, and the pin a request sets for the tool wait after it.
Where the policy says so and the host tier has room, KV is offloaded rather than dropped; a
later match loads it back (a host hit) instead of computing it again (a re-prefill, counted by
cause).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from venusrl.engine.attention import BandedPages
from venusrl.engine.config import EngineConfig
from venusrl.engine.kv_cache import KVCache
from venusrl.engine.layer_bands import BandStats, LayerBands
from venusrl.engine.radix_lending import LendingRadixTree
from venusrl.engine.radix_tree import Cached, PrefixMatch, RadixNode
from venusrl.engine.request import Request, Status
from venusrl.model.architecture import ModelConfig
from venusrl.policy.critical_groups import critical
from venusrl.policy.engine_schedule import RequestView, pages_for, pages_needed
from venusrl.policy.kv_retention import (
    IdleKV,
    LruRetention,
    RetentionPolicy,
    TrajectoryRetention,
    eviction_key,
)
from venusrl.policy.layer_residency import LayerResidency

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

REPREFILL_CAUSES = ("evicted", "preempted")


@dataclass
class EngineStats(BandStats):
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    computed_tokens: int = 0  # tokens run through the model (prefill, recompute and decode)
    generated_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    # Where admitted requests found their prefix, in tokens (every admission, resumes included).
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0  # loaded back from the host tier
    # Tokens whose KV the engine had computed and then lost, computed again; by cause
    # (`REPREFILL_CAUSES`): dropped while idle between turns, or after a preemption.
    reprefill_tokens: Counter[str] = field(default_factory=Counter)
    # Real seconds in the steps that ran a forward pass (scheduling, KV moves, the pass,
    # sampling), not the injectable clock.
    busy_s: float = 0.0
    # Later requests of trajectories the engine remembers (a turn after a tool call), and the
    # seconds from their arrival to their first token, summed: how long a tool's answer waits
    # in the engine, behind other work and for its own prefill.
    tool_returns: int = 0
    tool_return_wait_s: float = 0.0
    # (and BandStats: what layer-wise residency moved)

    @property
    def prefix_hit_ratio(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class TrajectoryState:
    """What the engine knows of a trajectory between its requests, for KV retention."""

    priority: int = 0
    pin_deadline: float | None = None  # while it waits on a tool: when the answer is expected
    node: RadixNode | None = None  # the end of its cached context
    # The weights its first request read (`Engine.weights_loaded`): with `salt_cache_by_version`
    # its requests read and cache KV under them, so it keeps its own KV across weight updates
    # (its tokens' staleness bounds that KV's) while a trajectory started later reads none of it.
    weights: int = 0
    cached_ids: list[int] = field(default_factory=list)  # the context that was cached (pages)


class KVManager:
    # Trajectories remembered for KV retention; past this, the least recently seen is ended (a
    # client that never calls `end_trajectory` must not grow the table without bound).
    max_trajectories = 100_000

    def __init__(
        self,
        cfg: EngineConfig,
        model: ModelConfig,
        stats: EngineStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.stats, self.clock = cfg, stats, clock
        self.page_size = cfg.page_size
        self.prefix_cache = cfg.prefix_cache
        self.kv = KVCache(
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            page_size=cfg.page_size,
            device_pages=cfg.device_kv_pages,
            host_pages=cfg.host_kv_pages,
            dtype=DTYPES[cfg.dtype],
            device=torch.device(cfg.device),
        )
        self.retention: RetentionPolicy = (
            TrajectoryRetention() if cfg.retention == "trajectory" else LruRetention()
        )
        self.trajectories: dict[str, TrajectoryState] = {}
        self.tree = LendingRadixTree(
            cfg.page_size,
            eviction_key=lambda node: eviction_key(
                self.retention, self.idle_kv(node), self.clock()
            ),
            offload_if=lambda node: self.retention.offload(self.idle_kv(node), self.clock()),
            tiers=self.kv,
        )
        self.layer_bands: LayerBands | None = None
        if cfg.layer_residency is not None:
            if cfg.host_kv_pages == 0:
                raise ValueError(
                    "engine.layer_residency reads layers from the host tier: "
                    "set engine.host_kv_pages"
                )
            policy = LayerResidency(cfg.layer_residency)
            self.layer_bands = LayerBands(policy, self.kv, self.tree, stats, self.make_room)

    # -- trajectories -------------------------------------------------------------------------

    def remember(self, r: Request, weights_loaded: int) -> None:
        """A request of a trajectory arrives: the trajectory's tool has answered (its pin ends),
        and what it cached before is what the request should find (short of that, a
        re-prefill)."""
        assert r.trajectory_id is not None
        t = self.trajectories.pop(r.trajectory_id, None)
        if t is None:
            t = TrajectoryState(weights=weights_loaded)
        else:
            r.after_tool = True
        if self.cfg.salt_cache_by_version:
            r.namespace = t.weights
        self.trajectories[r.trajectory_id] = t  # the most recently seen last
        while len(self.trajectories) > self.max_trajectories:
            self.end_trajectory(next(iter(self.trajectories)))
        t.priority, t.pin_deadline = r.priority, None
        if t.cached_ids and r.prompt_ids[: len(t.cached_ids)] == t.cached_ids:
            r.expected_cached = len(t.cached_ids)

    def pin(self, r: Request) -> None:
        """The request's turn ended and its trajectory waits on a tool, which starts now."""
        t = self.trajectories.get(r.trajectory_id) if r.trajectory_id else None
        if t is not None and r.expected_wait_s is not None:
            t.pin_deadline = self.clock() + r.expected_wait_s

    def end_trajectory(self, trajectory_id: str) -> None:
        """The trajectory's episode is over: no request reads its KV again, except siblings
        that share a prefix with it (they own those nodes too)."""
        t = self.trajectories.pop(trajectory_id, None)
        if t is not None and t.node is not None:
            self.tree.disown(t.node, trajectory_id)

    def idle_kv(self, node: RadixNode) -> IdleKV:
        """A tree node as the retention policy sees it: through the state of its owners."""
        owners = sorted(o for o in node.owners if o in self.trajectories)
        live = [self.trajectories[o] for o in owners]
        pins = [t.pin_deadline for t in live if t.pin_deadline is not None]
        return IdleKV(
            key=",".join(owners),
            tokens=len(node.key),
            priority=max((t.priority for t in live), default=0),
            last_use=node.last_access,
            pin_deadline=max(pins) if pins else None,
            finished=not live,
        )

    def live_pages(self) -> int:
        """Device pages of live work: running requests' and the cached KV some trajectory not
        yet ended owns. KV no live trajectory owns only waits to be evicted: the cache's content,
        not load (the occupancy agent-level admission control reads, `policy.agent_admission`)."""
        idle_unowned = sum(
            len(n.pages)
            for n in self.tree.nodes()
            if not n.on_host and n.lock_ref == 0 and not (n.owners & self.trajectories.keys())
        )
        alloc = self.kv.device_pages
        return alloc.capacity - alloc.num_free - idle_unowned

    # -- a request's pages --------------------------------------------------------------------

    def admit(self, r: Request, waiting: Sequence[Request]) -> int | None:
        """The request's cached prefix, locked for it: returns how many of its pages were
        loaded back from host, or None when part of its prefix is on host and cannot be loaded
        now (computing that again would waste what was kept)."""
        if not self.prefix_cache:
            return 0
        if self.layer_bands is not None and critical(r.priority):
            banded = self.layer_bands.admit(r, lambda o: self.sibling_waiting(o, waiting))
            if banded is not None:
                return banded
        match = self._match(r)
        if match is None:
            return None
        if match.pages:
            self.tree.lock(match.node)
            r.tree_node = match.node
            r.pages = list(match.pages)
            r.num_shared_pages = len(match.pages)
            r.num_computed = len(match.pages) * self.page_size
        return match.loaded_pages

    def count_admission(self, r: Request, loaded_pages: int) -> None:
        """Statistics of an admission that stuck (a rolled-back one is counted when it runs)."""
        host = loaded_pages * self.page_size
        self.stats.host_hit_tokens += host
        if r.banded is not None:  # admitted with its host pages as banded pages
            self._banding.count_admission(r, loaded_pages)
        self.stats.device_hit_tokens += r.num_computed - host
        if r.expected_cached > r.num_computed:
            cause = "preempted" if r.admissions else "evicted"
            self.stats.reprefill_tokens[cause] += r.expected_cached - r.num_computed
        r.admissions += 1
        if r.admissions == 1:
            r.cached_prompt_tokens = min(r.num_computed, len(r.prompt_ids))
            self.stats.prompt_tokens += len(r.prompt_ids)
            self.stats.cached_prompt_tokens += r.cached_prompt_tokens

    def _match(self, r: Request) -> PrefixMatch | None:
        """The request's cached prefix on device, its host part loaded back (room is made for
        it by evicting other nodes, with the device part locked meanwhile); None when some of
        the host part still does not fit."""
        ids, ns = r.all_ids[: r.num_tokens - 1], r.namespace
        match = self.tree.match(ids, ns)
        on_host = self.tree.cached(ids, ns).host_pages
        if on_host:
            self.tree.lock(match.node)
            self.make_room(on_host)
            self.tree.unlock(match.node)
            more = self.tree.match(ids, ns)
            match = PrefixMatch(more.node, more.pages, match.loaded_pages + more.loaded_pages)
            if self.tree.cached(ids, ns).host_pages:
                return None
        return match

    def make_room(self, pages: int) -> bool:
        alloc = self.kv.device_pages
        if pages > alloc.num_free:
            alloc.free(self.tree.evict(pages - alloc.num_free))
        return pages <= alloc.num_free

    def make_room_for_running(self, run: Sequence[tuple[Request, int]]) -> None:
        """Room for the running requests the plan lists before any admission, in one eviction:
        an eviction ranks every candidate in the cache, and ranking them once a decode row took
        a quarter of the engine's time on the CPU example. Their reservations come first and
        take only free pages, so this frees what evicting for each in turn would."""
        short = 0
        for r, n in run:
            if r.status is not Status.RUNNING:
                break
            short += max(0, self._pages_short(r, min(n, r.tokens_to_compute)))
        self.make_room(short)

    def _pages_short(self, r: Request, n: int) -> int:
        """Pages `r` lacks to compute `n` more tokens (negative when it has spare)."""
        return pages_for(r.num_computed + n, self.page_size) - len(r.pages)

    def reserve(self, r: Request, n: int) -> bool:
        """Pages for `r` to compute `n` more tokens; False when they cannot be had."""
        need = self._pages_short(r, n)
        if need <= 0:
            return True
        if not self.make_room(need):
            return False
        r.pages.extend(self.kv.device_pages.allocate(need))
        return True

    def cache_prefix(self, r: Request) -> None:
        """Hand the request's full, computed pages to the radix tree; it keeps reading them."""
        full = r.num_computed // self.page_size
        if full <= r.num_shared_pages:
            return
        tokens = r.all_ids[: full * self.page_size]
        match = self.tree.insert(tokens, r.pages[:full], r.namespace, r.trajectory_id)
        tree_pages = match.pages
        duplicates = [
            own
            for own, cached in zip(
                r.pages[r.num_shared_pages : full], tree_pages[r.num_shared_pages :], strict=True
            )
            if own != cached
        ]
        self.kv.device_pages.free(duplicates)
        r.pages[:full] = tree_pages
        self.tree.lock(match.node)
        if r.tree_node is not None:
            self.tree.unlock(r.tree_node)
        r.tree_node, r.num_shared_pages = match.node, full

    def computed(self, work: Sequence[tuple[Request, int]]) -> None:
        """After a step computed `n` tokens of each request: banded requests band their newly
        completed pages; a prefill's full pages go to the tree, so that siblings waiting on
        this prompt can match it now."""
        for r, _ in work:
            if r.banded is not None and not r.finished:
                self._banding.band_completed(r)
        if self.prefix_cache:
            for r, n in work:
                if n > 1 and not r.finished and r.banded is None:
                    self.cache_prefix(r)

    def release(self, r: Request) -> None:
        """The request stops running: its computed whole pages go to the cache, the rest of its
        KV is freed."""
        if r.banded is not None and not r.banded.host:
            r.banded = None  # nothing was banded: an ordinary request
        node = None
        if r.banded is not None:
            node = self._banding.release(r, self.prefix_cache)
            own = r.pages[r.banded.end :]
        else:
            if self.prefix_cache:
                self.cache_prefix(r)
                node = r.tree_node
                if node is not None:
                    # Its idle KV was last used now, not when its last whole page was cached.
                    self.tree.touch(node)
            own = r.pages[r.num_shared_pages :]
        if self.prefix_cache:
            # All it computed counts as cached, so whatever the cache could not keep shows as a
            # re-prefill when the trajectory comes back.
            computed = r.num_computed // self.page_size * self.page_size
            r.expected_cached = max(r.expected_cached, computed)
            t = self.trajectories.get(r.trajectory_id) if r.trajectory_id else None
            if t is not None and node is not None:
                t.node, t.cached_ids = node, r.all_ids[:computed]
        self.kv.device_pages.free(own)
        if r.tree_node is not None:
            self.tree.unlock(r.tree_node)
        r.pages, r.num_shared_pages, r.tree_node, r.num_computed = [], 0, None, 0
        r.banded = None

    def flush(self) -> int:
        """Drop every cached prefix no request holds, on both tiers; returns the number of device
        pages freed."""
        pages = self.tree.flush()
        self.kv.device_pages.free(pages)
        return len(pages)

    # -- what the scheduler sees --------------------------------------------------------------

    def cached_prefix(self, r: Request) -> Cached:
        """Pages of the request's prefix cached on device, then on host."""
        if not self.prefix_cache:
            return Cached(0, 0)
        # At least the last token is computed, to produce the logits of the next one.
        return self.tree.cached(r.all_ids[: r.num_tokens - 1], r.namespace)

    def free_pages(self) -> int:
        """Device pages free or held only by the cache (evictable)."""
        return self.kv.device_pages.num_free + self.tree.evictable_pages

    def releasable_pages(self, r: Request) -> int:
        """Pages that preempting `r` frees or makes evictable: its own, plus the cached prefix
        nodes that no other request holds (lock_ref 1)."""
        pages = len(r.pages) - r.num_shared_pages
        s = r.banded
        if s is not None:  # a band page frees its page only where no other band is taken
            pages -= sum(not self.kv.bands.frees(p, s.band) for p in r.pages[s.first : s.end])
        node = r.tree_node
        while node is not None and node.parent is not None and node.lock_ref == 1:
            pages += len(node.pages)
            node = node.parent
        return pages

    def reserved_pages(self, *views: Sequence[RequestView]) -> int:
        """Idle device pages the retention policy keeps from best-effort work (counted only
        when some best-effort request is there to be held back and free pages would not do)."""
        if all(critical(v.priority) for vs in views for v in vs):
            return 0
        ps = self.page_size
        demand = sum(pages_needed(v, v.tokens_to_compute, ps) for vs in views for v in vs)
        if demand <= self.kv.device_pages.num_free:
            return 0  # everything fits in free pages: a reservation could not change the plan
        now = self.clock()
        return sum(
            len(n.pages)
            for n in self.tree.nodes()
            if not n.on_host
            and n.lock_ref == 0
            and n.owners
            and self.retention.reserved(self.idle_kv(n), now)
        )

    # -- layer-wise residency -----------------------------------------------------------------

    def apply_residency(
        self, running: Sequence[Request], waiting: Sequence[Request], max_running: int
    ) -> None:
        """Band or unband running high-priority requests by the pressure their KV puts on the
        device (`policy.layer_residency`)."""
        if self.layer_bands is None:
            return
        high = [r for r in running if critical(r.priority)]
        pressure = self._pressure(high, waiting[: 2 * max_running])
        self.layer_bands.apply(pressure, high, lambda r: self.sibling_waiting(r, waiting))

    def _pressure(self, high: Sequence[Request], waiting: Sequence[Request]) -> float:
        """The KV pages high-priority requests need over the device pages. A prefix several of
        them share counts once: running requests' shared pages by id; a waiting request's cached
        prefix is counted once per group (its siblings share it) unless running requests hold
        it."""
        ps = self.page_size
        shared: set[int] = set()
        need = 0
        for r in high:
            shared.update(r.pages[: r.num_shared_pages])
            need += pages_for(r.num_tokens, ps) - r.num_shared_pages
        groups: set[str] = set()
        for r in waiting:
            if not critical(r.priority):
                break  # the queue is in priority order
            cached = self.cached_prefix(r)
            counted = r.group_id is not None and r.group_id in groups
            need += pages_for(r.num_tokens, ps) - (
                cached.device_pages if counted else cached.device_pages - cached.idle_pages
            )
            if r.group_id is not None:
                groups.add(r.group_id)
        return (need + len(shared)) / self.kv.device_pages.capacity

    def sibling_waiting(self, r: Request, waiting: Sequence[Request]) -> bool:
        """Does a request of its group wait that has nothing cached yet? It may be about to
        read the group's prompt, which only `r` owns until the siblings cache their own
        context through it (later turns own it together)."""
        if r.group_id is None:
            return False
        for o in waiting:
            if o.group_id == r.group_id:
                t = self.trajectories.get(o.trajectory_id) if o.trajectory_id else None
                if t is None or t.node is None:
                    return True
        return False

    @property
    def _banding(self) -> LayerBands:
        assert self.layer_bands is not None, "a banded request without layer residency"
        return self.layer_bands

    def host_reads(self, r: Request, skip: int = 0) -> BandedPages | None:
        """What a banded request's row reads from host (`LayerBands.reads`)."""
        return None if r.banded is None else self._banding.reads(r, skip)

    # -- invariants ---------------------------------------------------------------------------

    def check(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Allocator, tree and ownership invariants; tests call it after every step."""
        self.kv.check()
        self.tree.check()
        owners: dict[int, str] = dict.fromkeys(self.tree.all_pages(), "tree")
        band_owners: dict[tuple[int, int], str] = {}
        host = self.tree.all_host_pages()
        for r in running:
            assert r.status is Status.RUNNING
            assert len(r.pages) * self.page_size >= r.num_computed
            shared = set(r.pages[: r.num_shared_pages])
            assert all(owners.get(p) == "tree" for p in shared), "shared page not in tree"
            own = r.pages[r.num_shared_pages :]
            if r.banded is not None:
                s = r.banded
                assert s.first == r.num_shared_pages and s.end * self.page_size <= r.num_computed
                for p in r.pages[s.first : s.end]:
                    assert (p, s.band) not in band_owners, f"band {s.band} of {p} held twice"
                    assert self.kv.bands.owned(p, s.band), f"band {s.band} of {p} not taken"
                    band_owners[p, s.band] = r.request_id
                host += s.host
                own = r.pages[s.end :]
            for p in own:
                assert p not in owners, f"page {p} owned by {owners.get(p)} and {r.request_id}"
                owners[p] = r.request_id
        for r in waiting:
            assert r.status is Status.WAITING and not r.pages and r.tree_node is None
        free = set(self.kv.device_pages.free_page_ids())
        assert not free & set(owners), "a free page is also owned"
        split = set(self.kv.bands.pages())
        assert not split & set(owners), "a split page is also owned whole"
        assert split == {p for p, _ in band_owners}, "a split page has no banded request"
        assert len(set(host)) == len(host), "a host page is held twice"
        assert len(host) + self.kv.host_pages.num_free == self.kv.host_pages.capacity, (
            "a host page leaked"
        )
        assert 0 not in owners and 0 not in split, "the padding page is in use"
        assert len(free) + len(owners) + len(split) == self.kv.device_pages.capacity, (
            "a page leaked"
        )
