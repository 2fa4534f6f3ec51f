"""The rollout engine: continuous batching over a paged KV cache with a radix prefix cache.

One `step()` is schedule -> run -> postprocess:

- schedule: a pure policy (`venusrl.policy.engine_schedule`) sees a snapshot of the queues and the
  KV occupancy and returns which requests run how many tokens, and whom to preempt;
- run: the chosen tokens of all sequences are packed into one forward pass (`StepBatch`);
- postprocess: sequences that reached their end sample a token; finished and preempted sequences
  hand their full KV pages to the radix tree and free the rest.

A request carries no prefill/decode mode: it has `num_computed` tokens with KV and computes the
rest in chunks; whenever all of its tokens have KV, it samples the next one. Resuming a preempted
request is therefore the same as prefilling it, served mostly from the prefix cache.

Ownership of device pages (checked by `check()`): each page is free, owned by the radix tree, or
owned by exactly one running request. A request's first `num_shared_pages` pages are the tree's,
kept alive by a lock on `tree_node`.

Idle KV (DESIGN.md, "Trajectory-aware radix cache"): between two turns of a trajectory, its KV stays
in the tree, unlocked. When pages run short the tree evicts in the order of a retention policy
(`policy.kv_retention`, `engine.retention`) that sees each node's owners: whether their episodes are
over (`end_trajectory`), their priority, and the retention pin a request sets for the tool wait that
follows it (`expected_wait_s`, the coordinator's estimate of when the tool answers). Where the
policy says so and the host tier has room, the KV is offloaded rather than dropped; a later match
loads it back (a host hit) instead of computing it again (a re-prefill, counted by cause). A
preempted request's full pages go the same way.

Layer-wise residency (`engine.layer_residency`): when the KV that high-priority requests need
presses on the device, running high-priority requests keep only a band of their layers on device
and read the rest from the host tier (`engine.layer_bands`); the engine measures the pressure.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from venusrl.engine.attention import (
    BandedPages,
    DecodeBatch,
    PrefillSpan,
    PrefixGroup,
    StepBatch,
    causal_mask,
    needs_prefill_mask,
)
from venusrl.engine.config import EngineConfig
from venusrl.engine.host_malloc import keep_freed_memory_in_heap
from venusrl.engine.kv_cache import KVCache
from venusrl.engine.layer_bands import BandStats, LayerBands
from venusrl.engine.model import CausalLM
from venusrl.engine.model_dir import iter_safetensors, load_model
from venusrl.engine.radix_tree import Cached, PrefixMatch, RadixNode, RadixTree
from venusrl.engine.request import GenerationOutput, Request, SamplingParams, Status
from venusrl.engine.sampler import sample
from venusrl.engine.tokenizer import Tokenizer
from venusrl.policy.critical_groups import HIGH
from venusrl.policy.engine_schedule import (
    EngineSnapshot,
    PriorityScheduler,
    RequestView,
    pages_for,
    pages_needed,
    queue_order,
)
from venusrl.policy.kv_retention import (
    IdleKV,
    LruRetention,
    RetentionPolicy,
    TrajectoryRetention,
    eviction_key,
)
from venusrl.policy.layer_residency import LayerResidency

# Decode rows sharing a prefix attend it once (cascade attention) when that saves reading at
# least this many KV tokens per layer; below it one fused SDPA call over all pages is cheaper.
CASCADE_MIN_SAVED_TOKENS = 2048

# Tokens decoded beyond the longest stop string when looking for it (a multi-byte character
# can span tokens).
STOP_WINDOW_EXTRA_TOKENS = 8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


REPREFILL_CAUSES = ("evicted", "preempted")


def tool_return_wait_mean_s(counters: Mapping[str, float]) -> float | None:
    """From `Engine.counters`: the mean wait of a turn after a tool call, from its arrival to
    its first token, in seconds to 0.1 ms (None before any)."""
    returns = counters.get("tool_returns", 0)
    return round(counters["tool_return_wait_s"] / returns, 4) if returns else None


class RequestError(ValueError):
    """A request the engine cannot run as given; the message says why, `param` which field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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


class Engine:
    # Trajectories remembered for KV retention; past this, the least recently seen is ended (a
    # client that never calls `end_trajectory` must not grow the table without bound).
    max_trajectories = 100_000

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        scheduler: PriorityScheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg = config or EngineConfig()
        self.clock = clock
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        if torch.device(cfg.device).type == "cpu":
            keep_freed_memory_in_heap()
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = scheduler or PriorityScheduler()
        mc = model.config
        self.device = torch.device(cfg.device)
        self.page_size = ps = cfg.page_size
        self.kv = KVCache(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            page_size=ps,
            device_pages=cfg.device_kv_pages,
            host_pages=cfg.host_kv_pages,
            dtype=DTYPES[cfg.dtype],
            device=self.device,
        )
        self.retention: RetentionPolicy = (
            TrajectoryRetention() if cfg.retention == "trajectory" else LruRetention()
        )
        self.trajectories: dict[str, TrajectoryState] = {}
        self.tree = RadixTree(
            ps,
            eviction_key=lambda node: eviction_key(
                self.retention, self._idle_kv(node), self.clock()
            ),
            offload_if=lambda node: self.retention.offload(self._idle_kv(node), self.clock()),
            tiers=self.kv,
        )
        self.max_context = min(
            cfg.max_context or mc.max_position_embeddings, mc.max_position_embeddings
        )
        capacity_tokens = self.kv.device_pages.capacity * ps
        if capacity_tokens < self.max_context:
            raise ValueError(
                f"engine.device_kv_pages={cfg.device_kv_pages} x page_size={ps} holds "
                f"{capacity_tokens} tokens, less than one sequence of the context limit "
                f"({self.max_context}); raise device_kv_pages or lower engine.max_context"
            )
        self.stats = EngineStats()
        self.layer_bands: LayerBands | None = None
        if cfg.layer_residency is not None:
            if cfg.host_kv_pages == 0:
                raise ValueError(
                    "engine.layer_residency reads layers from the host tier: "
                    "set engine.host_kv_pages"
                )
            policy = LayerResidency(cfg.layer_residency)
            self.layer_bands = LayerBands(policy, self.kv, self.tree, self.stats, self._make_room)
        eos = set(mc.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.eos_token_ids = frozenset(eos)
        self.weight_version = 0
        self.weights_loaded = 0  # loads since start: the cache's salt (`update_weights`)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by the scheduler's queue order
        self.running: list[Request] = []
        self._arrivals = itertools.count()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        cfg = config or EngineConfig()
        model = load_model(model_dir, cfg.device, DTYPES[cfg.dtype])
        return cls(model, cfg, Tokenizer.load(model_dir))

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        trajectory_id: str | None = None,
        group_id: str | None = None,
        expected_wait_s: float | None = None,
        arrived_at: float | None = None,
    ) -> Request:
        """Queue a request. `expected_wait_s`: after this turn the trajectory waits on a tool,
        expected back within that time; its KV is pinned until then (what a pin is worth is the
        retention policy's call). The trajectory's next request ends the wait; `end_trajectory`
        says no request will follow. `arrived_at` (the engine's clock; default now): when a
        front end received it, so that its wait counts the step it queued behind."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self.check_prompt(prompt)
        self.check_params(params)
        if expected_wait_s is not None and not 0 <= expected_wait_s < math.inf:
            raise RequestError(
                f"expected_wait_s must be a finite number >= 0, got {expected_wait_s}",
                "expected_wait_s",
            )
        if expected_wait_s is not None and trajectory_id is None:
            raise RequestError(
                "expected_wait_s needs a trajectory_id: whose KV is to be kept?", "trajectory_id"
            )
        request_id = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        arrival = next(self._arrivals)
        sampling_seed = None
        if not params.greedy:
            # Requests without a seed draw from the upper half of the seed space, which given
            # seeds (< 2**63) never reach: an unseeded request never replays a seeded one.
            default = (self.cfg.seed * 1_000_003 + arrival) % 2**63 + 2**63
            sampling_seed = params.seed if params.seed is not None else default
        r = Request(
            request_id,
            prompt,
            params,
            priority=priority,
            arrival=arrival,
            trajectory_id=trajectory_id,
            group_id=group_id,
            namespace=self.weights_loaded if self.cfg.salt_cache_by_version else None,
            sampling_seed=sampling_seed,
            expected_wait_s=expected_wait_s,
            arrived_at=self.clock() if arrived_at is None else arrived_at,
        )
        if trajectory_id is not None:
            t = self.trajectories.pop(trajectory_id, None)
            if t is None:
                t = TrajectoryState(weights=self.weights_loaded)
            else:
                r.after_tool = True
            if self.cfg.salt_cache_by_version:
                r.namespace = t.weights
            self.trajectories[trajectory_id] = t  # the most recently seen last
            while len(self.trajectories) > self.max_trajectories:
                self.end_trajectory(next(iter(self.trajectories)))
            t.priority, t.pin_deadline = priority, None  # the tool has answered
            if t.cached_ids and prompt[: len(t.cached_ids)] == t.cached_ids:
                r.expected_cached = len(t.cached_ids)
        self.requests[request_id] = r
        self._enqueue(r)
        return r

    def check_prompt(self, prompt: Sequence[int], param: str = "prompt") -> None:
        """Raise `RequestError` unless the engine can run this prompt (front ends call it before
        they answer, so that a stream never opens on a request that cannot run)."""
        vocab = self.model.config.vocab_size
        if not prompt:
            raise RequestError(f"{param} is empty", param)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(
                f"{param} token id {bad} is outside the vocabulary [0, {vocab})", param
            )
        if len(prompt) >= self.max_context:
            raise RequestError(
                f"{param} has {len(prompt)} tokens; the context limit is {self.max_context} "
                "and at least one token must be generated",
                param,
            )

    def check_params(self, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: it needs the model's vocabulary and
        tokenizer."""
        vocab = self.model.config.vocab_size
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(
                f"stop token id {bad} is outside the vocabulary [0, {vocab})", "stop_token_ids"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop"
            )

    def end_trajectory(self, trajectory_id: str) -> None:
        """The trajectory's episode is over: no request reads its KV again, except siblings
        that share a prefix with it (they own those nodes too)."""
        t = self.trajectories.pop(trajectory_id, None)
        if t is not None and t.node is not None:
            self.tree.disown(t.node, trajectory_id)

    def counters(self) -> dict[str, float]:
        """The engine's totals since it started, flat (step metrics, `GET /stats`, benchmarks):
        `EngineStats` with re-prefilled tokens by cause, and the bytes offloaded to and loaded
        back from the host tier."""
        out: dict[str, float] = {
            k: v for k, v in vars(self.stats).items() if k != "reprefill_tokens"
        }
        for cause in sorted({*REPREFILL_CAUSES, *self.stats.reprefill_tokens}):
            out[f"reprefill_{cause}_tokens"] = self.stats.reprefill_tokens[cause]
        out["offloaded_bytes"] = self.tree.offloaded_pages * self.kv.page_bytes()
        out["loaded_bytes"] = self.tree.loaded_pages * self.kv.page_bytes()
        return out

    def live_kv_pages(self) -> int:
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

    def _idle_kv(self, node: RadixNode) -> IdleKV:
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

    def abort(self, request_id: str) -> bool:
        r = self.requests.get(request_id)
        if r is None or r.finished:
            return False
        self._finish(r, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self, request_id: str) -> GenerationOutput:
        r = self.requests.pop(request_id)
        assert r.finished, f"{request_id} has not finished"
        return GenerationOutput.of(r)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Run prompts to completion (all submitted at once) and return outputs in order."""
        per = (
            params if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        )
        ids = [self.add_request(p, sp).request_id for p, sp in zip(prompts, per, strict=True)]
        while self.has_work():
            self.step()
        return [self.pop_finished(i) for i in ids]

    # -- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one forward pass; returns the requests that finished in it."""
        began = time.perf_counter()
        if self.layer_bands is not None:
            high = [r for r in self.running if r.priority >= HIGH]
            self.layer_bands.apply(self._pressure(high), high, self._sibling_waiting)
        plan = self.scheduler.schedule(self._snapshot())
        for rid in plan.preempt:
            self._preempt(self.requests[rid])
        self._make_room_for_running(plan.run)
        work: list[tuple[Request, int]] = []
        for rid, n in plan.run:
            r = self.requests[rid]
            admitting = r.status is Status.WAITING
            loaded = self._admit(r) if admitting else 0
            if loaded is None:
                continue  # its KV is on host and the device has no room for it yet: it waits
            n = min(n, r.tokens_to_compute)
            if n > 0 and self._reserve_pages(r, n):
                work.append((r, n))
                if admitting:
                    self._count_admission(r, loaded)
            elif admitting:
                # The plan counted pages that earlier admissions took: wait for the next step
                # rather than hold a running slot with nothing to compute.
                self.running.remove(r)
                self._release_kv(r)
                self._enqueue(r)
        if not work:
            return []
        work.sort(key=lambda item: item[1] > 1)  # the packed batch puts decode rows first
        batch = self._build_batch(work)
        logits = self.model(batch, self.kv)
        self.stats.steps += 1
        finished = self._postprocess(work, logits)
        self.stats.busy_s += time.perf_counter() - began
        return finished

    def _snapshot(self) -> EngineSnapshot:
        ps = self.page_size
        running = []
        for r in self.running:
            running.append(
                RequestView(
                    r.request_id,
                    r.priority,
                    r.arrival,
                    r.num_computed,
                    r.tokens_to_compute,
                    pages_held=len(r.pages),
                    pages_releasable=self._releasable_pages(r),
                )
            )
        prefilling = [r for r in self.running if r.tokens_to_compute > 1]
        waiting = []
        for r in self.waiting[: 2 * self.cfg.max_running]:
            on_device, on_host, idle = self._cached_prefix(r)
            cached = (on_device + on_host) * ps
            key, in_flight = None, False
            if self.cfg.prefix_cache and r.num_tokens - cached > ps:
                head = r.all_ids[: cached + ps]
                key = (r.namespace, tuple(head))
                in_flight = any(
                    o.namespace == r.namespace
                    and o.num_computed <= cached
                    and o.all_ids[: cached + ps] == head
                    for o in prefilling
                )
            waiting.append(
                RequestView(
                    r.request_id,
                    r.priority,
                    r.arrival,
                    cached,
                    r.num_tokens - cached,
                    pages_held=on_device,  # host pages need device pages to load into
                    pages_releasable=0,
                    pages_idle=idle,
                    prefix_key=key,
                    prefix_in_flight=in_flight,
                )
            )
        return EngineSnapshot(
            running=running,
            waiting=waiting,
            free_pages=self.kv.device_pages.num_free + self.tree.evictable_pages,
            page_size=ps,
            token_budget=self.cfg.token_budget,
            max_running=self.cfg.max_running,
            reserved_pages=self._reserved_pages(running, waiting),
            reserve_priority=HIGH,
        )

    def _reserved_pages(self, *views: Sequence[RequestView]) -> int:
        """Idle device pages the retention policy keeps from best-effort work (counted only
        when some best-effort request is there to be held back and free pages would not do)."""
        if all(v.priority >= HIGH for vs in views for v in vs):
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
            and self.retention.reserved(self._idle_kv(n), now)
        )

    def _releasable_pages(self, r: Request) -> int:
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

    def _cached_prefix(self, r: Request) -> Cached:
        """Pages of the request's prefix cached on device, then on host."""
        if not self.cfg.prefix_cache:
            return Cached(0, 0)
        # At least the last token is computed, to produce the logits of the next one.
        return self.tree.cached(r.all_ids[: r.num_tokens - 1], r.namespace)

    def _build_batch(self, work: Sequence[tuple[Request, int]]) -> StepBatch:
        """Pack the step's tokens; `work` lists decode (single-token) entries first."""
        ps, dev = self.page_size, self.device
        group = self.model.config.num_heads // self.model.config.num_kv_heads
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        decoding: list[Request] = []
        prefills: list[PrefillSpan] = []
        for r, n in work:
            start = r.num_computed
            row = len(input_ids)
            input_ids.extend(r.all_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(r.pages[p // ps] * ps + p % ps for p in range(start, start + n))
            if start + n == r.num_tokens:
                logits_rows.append(row + n - 1)
            if n == 1:
                decoding.append(r)
            else:
                used = torch.tensor(r.pages[: pages_for(start + n, ps)], device=dev)
                mask = causal_mask(start, n, group, dev) if needs_prefill_mask(dev) else None
                prefills.append(PrefillSpan(row, n, used, start + n, mask, self._host_reads(r)))
        return StepBatch(
            input_ids=torch.tensor(input_ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            slots=torch.tensor(slots, device=dev),
            logits_rows=torch.tensor(logits_rows, device=dev, dtype=torch.long),
            decode=self._decode_batch(decoding) if decoding else None,
            prefills=tuple(prefills),
        )

    def _decode_batch(self, rows: Sequence[Request]) -> DecodeBatch:
        """Rows that share their cached prefix pages (GRPO siblings) attend them once."""
        ps, dev = self.page_size, self.device
        by_prefix: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(rows):
            if r.num_shared_pages:
                by_prefix.setdefault(tuple(r.pages[: r.num_shared_pages]), []).append(i)
        groups = [(pages, members) for pages, members in by_prefix.items() if len(members) > 1]
        saved_tokens = sum((len(m) - 1) * len(pages) * ps for pages, m in groups)
        if saved_tokens < CASCADE_MIN_SAVED_TOKENS:
            groups = []  # the split costs ~40 small ops per layer; not worth it for little reuse
        skip = [0] * len(rows)  # pages each row reads through its group instead
        for pages, members in groups:
            for i in members:
                skip[i] = len(pages)
        own = [r.pages[skip[i] : pages_for(r.num_computed + 1, ps)] for i, r in enumerate(rows)]
        own_lens = [r.num_computed + 1 - skip[i] * ps for i, r in enumerate(rows)]
        width = max(len(p) for p in own)
        beyond = (
            torch.arange(width * ps, device=dev)[None, :]
            >= torch.tensor(own_lens, device=dev)[:, None]
        )
        # Additive (0 / -inf) once per step, rather than converted from bool in every layer.
        key_mask = torch.zeros(beyond.shape, dtype=self.kv.device_kv.dtype, device=dev)
        key_mask.masked_fill_(beyond, float("-inf"))
        prefix_groups = []
        for pages, members in groups:
            contiguous = list(pages) == list(range(pages[0], pages[0] + len(pages)))
            prefix_groups.append(
                PrefixGroup(
                    rows=torch.tensor(members, device=dev),
                    first_page=pages[0],
                    num_pages=len(pages),
                    pages=None if contiguous else torch.tensor(pages, device=dev),
                )
            )
        banded = [(i, self._host_reads(r, skip[i])) for i, r in enumerate(rows)]
        return DecodeBatch(
            num_rows=len(rows),
            pages=_padded(own, width, dev),
            key_mask=key_mask[None, :, None],
            prefix_groups=tuple(prefix_groups),
            banded=tuple((i, b) for i, b in banded if b is not None),
        )

    def _postprocess(
        self, work: Sequence[tuple[Request, int]], logits: torch.Tensor
    ) -> list[Request]:
        sampling = []
        for r, n in work:
            r.num_computed += n
            self.stats.computed_tokens += n
            if r.num_computed == r.num_tokens:
                sampling.append(r)
        tokens, logprobs, tops = sample(
            logits,
            [r.params for r in sampling],
            [r.sampling_seed for r in sampling],
            [len(r.output_ids) for r in sampling],
        )
        finished = []
        for r, token, logprob, top in zip(sampling, tokens, logprobs, tops, strict=True):
            r.append_token(token, logprob, self.weight_version, top)
            self.stats.generated_tokens += 1
            if r.after_tool and len(r.output_ids) == 1:  # not again after a preemption
                self.stats.tool_returns += 1
                self.stats.tool_return_wait_s += self.clock() - r.arrived_at
            reason = self._stop_reason(r, token)
            if reason is not None:
                self._finish(r, reason)
                finished.append(r)
        for r, _ in work:
            if r.banded is not None and not r.finished:
                self._banding.band_completed(r)
        if self.cfg.prefix_cache:
            for r, n in work:
                if n > 1 and not r.finished and r.banded is None:
                    self._cache_prefix(r)  # siblings waiting on this prompt can now match it
        return finished

    def _stop_reason(self, r: Request, token: int) -> str | None:
        p = r.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if p.stop and self.tokenizer is not None:
            # Only the tail can hold a new match; a token decodes to at least one character.
            window = max(len(s) for s in p.stop) + STOP_WINDOW_EXTRA_TOKENS
            text = self.tokenizer.decode(r.output_ids[-window:])
            if any(s in text for s in p.stop):
                return "stop"
        if len(r.output_ids) >= p.max_tokens or r.num_tokens >= self.max_context:
            return "length"
        return None

    # -- KV bookkeeping -----------------------------------------------------------------------

    def _enqueue(self, r: Request) -> None:
        r.status = Status.WAITING
        bisect.insort(self.waiting, r, key=queue_order)

    def _admit(self, r: Request) -> int | None:
        """Moves the request to the running set with its cached prefix; returns how many of its
        pages were loaded back from host, or None (and leaves it waiting) when part of its prefix
        is on host and cannot be loaded now: computing that again would waste what was kept."""
        loaded = 0
        if self.cfg.prefix_cache:
            banded = None
            if self.layer_bands is not None and r.priority >= HIGH:
                banded = self.layer_bands.admit(r, self._sibling_waiting)
            if banded is not None:
                loaded = banded
            else:
                match = self._match(r)
                if match is None:
                    return None
                if match.pages:
                    self.tree.lock(match.node)
                    r.tree_node = match.node
                    r.pages = list(match.pages)
                    r.num_shared_pages = len(match.pages)
                    r.num_computed = len(match.pages) * self.page_size
                loaded = match.loaded_pages
        self.waiting.remove(r)
        r.status = Status.RUNNING
        self.running.append(r)
        return loaded

    def _count_admission(self, r: Request, loaded_pages: int) -> None:
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
            self._make_room(on_host)
            self.tree.unlock(match.node)
            more = self.tree.match(ids, ns)
            match = PrefixMatch(more.node, more.pages, match.loaded_pages + more.loaded_pages)
            if self.tree.cached(ids, ns).host_pages:
                return None
        return match

    def _make_room(self, pages: int) -> bool:
        alloc = self.kv.device_pages
        if pages > alloc.num_free:
            alloc.free(self.tree.evict(pages - alloc.num_free))
        return pages <= alloc.num_free

    def _make_room_for_running(self, run: Sequence[tuple[str, int]]) -> None:
        """Room for the running requests the plan lists before any admission, in one eviction:
        an eviction ranks every candidate in the cache, and ranking them once a decode row took
        a quarter of the engine's time on the CPU example. Their reservations come first and
        take only free pages, so this frees what evicting for each in turn would."""
        short = 0
        for rid, n in run:
            r = self.requests[rid]
            if r.status is not Status.RUNNING:
                break
            short += max(0, self._pages_short(r, min(n, r.tokens_to_compute)))
        self._make_room(short)

    def _pages_short(self, r: Request, n: int) -> int:
        """Pages `r` lacks to compute `n` more tokens (negative when it has spare)."""
        return pages_for(r.num_computed + n, self.page_size) - len(r.pages)

    def _reserve_pages(self, r: Request, n: int) -> bool:
        need = self._pages_short(r, n)
        if need <= 0:
            return True
        if not self._make_room(need):
            return False
        r.pages.extend(self.kv.device_pages.allocate(need))
        return True

    def _cache_prefix(self, r: Request) -> None:
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

    def _release_kv(self, r: Request) -> None:
        """The request stops running: its computed whole pages go to the cache, the rest of its
        KV is freed."""
        if r.banded is not None and not r.banded.host:
            r.banded = None  # nothing was banded: an ordinary request
        node = None
        if r.banded is not None:
            node = self._banding.release(r, self.cfg.prefix_cache)
            own = r.pages[r.banded.end :]
        else:
            if self.cfg.prefix_cache:
                self._cache_prefix(r)
                node = r.tree_node
                if node is not None:
                    # Its idle KV was last used now, not when its last whole page was cached.
                    self.tree.touch(node)
            own = r.pages[r.num_shared_pages :]
        if self.cfg.prefix_cache:
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

    # -- layer-wise residency -----------------------------------------------------------------

    def _pressure(self, high: Sequence[Request]) -> float:
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
        for r in self.waiting[: 2 * self.cfg.max_running]:
            if r.priority < HIGH:
                break  # the queue is in priority order
            cached = self._cached_prefix(r)
            counted = r.group_id is not None and r.group_id in groups
            need += pages_for(r.num_tokens, ps) - (
                cached.device_pages if counted else cached.device_pages - cached.idle_pages
            )
            if r.group_id is not None:
                groups.add(r.group_id)
        return (need + len(shared)) / self.kv.device_pages.capacity

    def _sibling_waiting(self, r: Request) -> bool:
        """Does a request of its group wait that has nothing cached yet? It may be about to
        read the group's prompt, which only `r` owns until the siblings cache their own
        context through it (later turns own it together)."""
        if r.group_id is None:
            return False
        for o in self.waiting:
            if o.group_id == r.group_id:
                t = self.trajectories.get(o.trajectory_id) if o.trajectory_id else None
                if t is None or t.node is None:
                    return True
        return False

    @property
    def _banding(self) -> LayerBands:
        assert self.layer_bands is not None, "a banded request without layer residency"
        return self.layer_bands

    def _host_reads(self, r: Request, skip: int = 0) -> BandedPages | None:
        """What a banded request's row reads from host (`LayerBands.reads`)."""
        return None if r.banded is None else self._banding.reads(r, skip)

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._release_kv(r)
        self.stats.preemptions += 1
        self._enqueue(r)

    def _finish(self, r: Request, reason: str) -> None:
        t = self.trajectories.get(r.trajectory_id) if r.trajectory_id else None
        if t is not None and r.expected_wait_s is not None and reason != "abort":
            t.pin_deadline = self.clock() + r.expected_wait_s  # the tool call starts now
        if r.status is Status.RUNNING:
            self.running.remove(r)
            self._release_kv(r)
        elif r.status is Status.WAITING:
            self.waiting.remove(r)
        r.status, r.finish_reason = Status.FINISHED, reason
        self.stats.finished += 1

    # -- weights and cache --------------------------------------------------------------------

    @torch.inference_mode()
    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | str | Path,
        version: int | None = None,
        flush_cache: bool = False,
    ) -> int:
        """Load new weights in place between steps and bump the weight version.

        Requests in flight keep their KV and continue; their later tokens record the new
        version. `flush_cache` drops every cached prefix no running request holds; with
        `engine.salt_cache_by_version` (the default), trajectories started from now on never
        match KV computed under earlier weights, while those in flight keep reading their own.
        The salt counts the loads, not the version numbers a caller gives: a version given
        twice (a second run against the same server) still salts each load apart.
        """
        source = iter_safetensors(weights) if isinstance(weights, str | Path) else weights
        self.model.load_weights(source)
        self.weights_loaded += 1
        self.weight_version = self.weight_version + 1 if version is None else version
        if flush_cache:
            self.flush_cache()
        return self.weight_version

    def flush_cache(self) -> int:
        """Drop every cached prefix no request holds, on both tiers; returns the number of device
        pages freed."""
        pages = self.tree.flush()
        self.kv.device_pages.free(pages)
        return len(pages)

    # -- invariants ---------------------------------------------------------------------------

    def check(self) -> None:
        """Allocator, tree and ownership invariants; tests call it after every step."""
        self.kv.check()
        self.tree.check()
        owners: dict[int, str] = dict.fromkeys(self.tree.all_pages(), "tree")
        band_owners: dict[tuple[int, int], str] = {}
        host = self.tree.all_host_pages()
        for r in self.running:
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
        for r in self.waiting:
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


def _padded(rows: Sequence[Sequence[int]], width: int, device: torch.device) -> torch.Tensor:
    """Page-id rows padded to `width` with the reserved padding page 0."""
    data = [list(row) + [0] * (width - len(row)) for row in rows]
    return torch.tensor(data, dtype=torch.long, device=device).view(len(rows), width)
