"""The rollout engine: continuous batching over a paged KV cache with a radix prefix cache.

One `step()` is schedule -> run -> postprocess:

- schedule: a pure policy (`venusrl.policy.engine_schedule`) sees a snapshot of the queues and the
  KV occupancy and returns which requests run how many tokens, and whom to preempt;
- run: the chosen tokens of all sequences are packed into one forward pass (`engine.batch`);
- postprocess: sequences that reached their end sample a token; finished and preempted sequences
  hand their full KV pages to the radix tree and free the rest.

The engine owns the queues; its KV (pages on two tiers, the radix tree, what it knows of each
trajectory between turns, layer bands) has an owner of its own, `engine.kv_manager`. A request
carries no prefill/decode mode: it has `num_computed` tokens with KV and computes the rest in
chunks; whenever all of its tokens have KV, it samples the next one. Resuming a preempted
request is therefore the same as prefilling it, served mostly from the prefix cache.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from venusrl.engine.attention_backend import attention_backend
from venusrl.engine.batch import BatchBuilder
from venusrl.engine.config import EngineConfig
from venusrl.engine.decode_graphs import DecodeGraphs
from venusrl.engine.host_malloc import keep_freed_memory_in_heap
from venusrl.engine.kv_manager import DTYPES, REPREFILL_CAUSES, EngineStats, KVManager
from venusrl.engine.page_table import PageTables
from venusrl.engine.paged_forward import PagedForward
from venusrl.engine.request import Request, Status
from venusrl.engine.sampler import sample
from venusrl.engine.snapshot import snapshot
from venusrl.model.architecture import CausalLM
from venusrl.model.directory import check_same_model, iter_safetensors, load_model
from venusrl.model.tokenizer import Tokenizer
from venusrl.policy.engine_schedule import (
    PriorityScheduler,
    pages_for,
    queue_order,
)
from venusrl.types import GenerationOutput, SamplingParams, TurnMeta

# Tokens decoded beyond the longest stop string when looking for it (a multi-byte character
# can span tokens).
STOP_WINDOW_EXTRA_TOKENS = 8


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


class Engine:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        scheduler: PriorityScheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
        weight_version: int = 0,
    ) -> None:
        """`weight_version`: what the weights it starts with are (a run resumed at step N
        starts from N's); `update_weights` moves it on."""
        self.cfg = cfg = config or EngineConfig()
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        if torch.device(cfg.device).type == "cpu":
            keep_freed_memory_in_heap()
        self.model = model
        self.forward = PagedForward(
            model, attention_backend(cfg.attention_backend, torch.device(cfg.device))
        )
        self.tokenizer = tokenizer
        self.scheduler = scheduler or PriorityScheduler()
        mc = model.config
        self.device = torch.device(cfg.device)
        self.page_size = cfg.page_size
        self.cache = KVManager(cfg, mc, EngineStats(), clock)
        self.max_context = min(
            cfg.max_context or mc.max_position_embeddings, mc.max_position_embeddings
        )
        capacity_tokens = self.cache.kv.device_pages.capacity * cfg.page_size
        if capacity_tokens < self.max_context:
            raise ValueError(
                f"engine.device_kv_pages={cfg.device_kv_pages} x page_size={cfg.page_size} holds "
                f"{capacity_tokens} tokens, less than one sequence of the context limit "
                f"({self.max_context}); raise device_kv_pages or lower engine.max_context"
            )
        max_pages = pages_for(self.max_context, cfg.page_size)
        self.batches = BatchBuilder(
            cfg.page_size,
            self.device,
            mc.num_heads // mc.num_kv_heads,
            DTYPES[cfg.dtype],
            self.cache.host_reads,
            PageTables(cfg.max_running, max_pages, self.device),
        )
        self.graphs: DecodeGraphs | None = None
        if cfg.cuda_graphs:
            capture = self.device.type == "cuda"
            # The graphs record up to the final hidden states; the vocabulary projection runs
            # after a replay (a [rows, vocab] output per bucket would hold GBs at 150K vocab).
            self.graphs = DecodeGraphs(
                self.forward.hidden_states, self.cache.kv, cfg.max_running, max_pages, capture
            )
            self.graphs.capture_all()  # at start, so that no step pays for a capture
        eos = set(mc.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.eos_token_ids = frozenset(eos)
        self.weight_version = weight_version
        self.weights_loaded = 0  # loads since start: the cache's salt (`update_weights`)
        self.admitting = True  # False while it drains for new weights (`hold_admission`)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by the scheduler's queue order
        self.running: list[Request] = []
        self._arrivals = itertools.count()

    @property
    def stats(self) -> EngineStats:
        """The counters since the engine started (`counters()` flattens them); one object, the
        KV manager's: read-only, so that no caller splits it in two."""
        return self.cache.stats

    @property
    def clock(self) -> Callable[[], float]:
        return self.cache.clock

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        weight_version: int = 0,
    ) -> Engine:
        cfg = config or EngineConfig()
        model = load_model(model_dir, cfg.device, DTYPES[cfg.dtype])
        tokenizer = Tokenizer.load(model_dir)
        return cls(model, cfg, tokenizer, clock=clock, weight_version=weight_version)

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        meta: TurnMeta | None = None,
        *,
        request_id: str | None = None,
        arrived_at: float | None = None,
    ) -> Request:
        """Queue a request. `meta.expected_wait_s`: after this turn the trajectory waits on a
        tool, expected back within that time; its KV is pinned until then (what a pin is worth
        is the retention policy's call). The trajectory's next request ends the wait;
        `end_trajectory` says no request will follow. `arrived_at` (the engine's clock; default
        now): when a front end received it, so that its wait counts the step it queued behind."""
        params = params or SamplingParams()
        meta = meta or TurnMeta()
        trajectory_id, expected_wait_s = meta.trajectory_id, meta.expected_wait_s
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
            priority=meta.priority,
            arrival=arrival,
            trajectory_id=trajectory_id,
            group_id=meta.group_id,
            namespace=self.weights_loaded if self.cfg.salt_cache_by_version else None,
            sampling_seed=sampling_seed,
            expected_wait_s=expected_wait_s,
            arrived_at=self.clock() if arrived_at is None else arrived_at,
        )
        if trajectory_id is not None:
            self.cache.remember(r, self.weights_loaded)
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
        """The trajectory's episode is over: no request reads its KV again (`KVManager`)."""
        self.cache.end_trajectory(trajectory_id)

    def counters(self) -> dict[str, float]:
        """The engine's totals since it started, flat (step metrics, `GET /stats`, benchmarks):
        `EngineStats` with re-prefilled tokens by cause, and the bytes offloaded to and loaded
        back from the host tier."""
        out: dict[str, float] = {
            k: v for k, v in vars(self.stats).items() if k != "reprefill_tokens"
        }
        for cause in sorted({*REPREFILL_CAUSES, *self.stats.reprefill_tokens}):
            out[f"reprefill_{cause}_tokens"] = self.stats.reprefill_tokens[cause]
        page_bytes = self.cache.kv.page_bytes()
        out["offloaded_bytes"] = self.cache.tree.offloaded_pages * page_bytes
        out["loaded_bytes"] = self.cache.tree.loaded_pages * page_bytes
        return out

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
        return r.output()

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
        self.cache.apply_residency(self.running, self.waiting, self.cfg.max_running)
        waiting = self.waiting if self.admitting else [r for r in self.waiting if r.admissions]
        plan = self.scheduler.schedule(snapshot(self.running, waiting, self.cache, self.cfg))
        for rid in plan.preempt:
            self._preempt(self.requests[rid])
        self.cache.make_room_for_running([(self.requests[rid], n) for rid, n in plan.run])
        work = self._admit_and_reserve(plan.run)
        if not work:
            return []
        work.sort(key=lambda item: item[1] > 1)  # the packed batch puts decode rows first
        batch = self.batches.build(work)
        if self.graphs is not None and self.graphs.fits(batch):
            self.model.check_whole()  # a replay never calls the model, whose forward asks
            logits = self.model.logits(self.graphs.run(batch))
        else:
            logits = self.forward(batch, self.cache.kv)
        self.stats.steps += 1
        finished = self._postprocess(work, logits)
        self.stats.busy_s += time.perf_counter() - began
        return finished

    def _admit_and_reserve(self, run: Sequence[tuple[str, int]]) -> list[tuple[Request, int]]:
        """The plan's requests with the tokens each computes this step, the waiting ones
        admitted; pages reserved for all."""
        work: list[tuple[Request, int]] = []
        for rid, n in run:
            r = self.requests[rid]
            admitting = r.status is Status.WAITING
            loaded = self._admit(r) if admitting else 0
            if loaded is None:
                continue  # its KV is on host and the device has no room for it yet: it waits
            n = min(n, r.tokens_to_compute)
            if n > 0 and self.cache.reserve(r, n):
                work.append((r, n))
                if admitting:
                    self.cache.count_admission(r, loaded)
            elif admitting:
                # The plan counted pages that earlier admissions took: wait for the next step
                # rather than hold a running slot with nothing to compute.
                self.running.remove(r)
                self.cache.release(r)
                self._enqueue(r)
        return work

    def _admit(self, r: Request) -> int | None:
        """Moves the request to the running set with its cached prefix; returns how many of its
        pages were loaded back from host, or None (and leaves it waiting) when part of its prefix
        is on host and cannot be loaded now."""
        loaded = self.cache.admit(r, self.waiting)
        if loaded is None:
            return None
        self.waiting.remove(r)
        r.status = Status.RUNNING
        self.running.append(r)
        return loaded

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
        self.cache.computed(work)
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

    # -- queues -------------------------------------------------------------------------------

    def _enqueue(self, r: Request) -> None:
        r.status = Status.WAITING
        bisect.insort(self.waiting, r, key=queue_order)

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.cache.release(r)
        self.stats.preemptions += 1
        self._enqueue(r)

    def _finish(self, r: Request, reason: str) -> None:
        if reason != "abort":
            self.cache.pin(r)  # the tool call after this turn starts now
        if r.status is Status.RUNNING:
            self.running.remove(r)
            self.cache.release(r)
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
        if isinstance(weights, str | Path):
            check_same_model(Path(weights), self.model.config)
            weights = iter_safetensors(weights)
        self.model.load_weights(weights)
        self.weights_loaded += 1
        self.weight_version = self.weight_version + 1 if version is None else version
        if flush_cache:
            self.flush_cache()
        return self.weight_version

    def hold_admission(self) -> None:
        """Start no new turn until `resume_admission`: the turns in flight go on, a preempted
        one included (to drain the engine before new weights: `engine.weight_update=drain`)."""
        self.admitting = False

    def resume_admission(self) -> None:
        self.admitting = True

    @property
    def turns_in_flight(self) -> bool:
        """A turn runs, or waits again after a preemption (what a drain waits for)."""
        return bool(self.running) or any(r.admissions for r in self.waiting)

    def flush_cache(self) -> int:
        """Drop every cached prefix no request holds, on both tiers; returns the number of device
        pages freed."""
        return self.cache.flush()

    # -- invariants ---------------------------------------------------------------------------

    def check(self) -> None:
        """Allocator, tree and ownership invariants; tests call it after every step."""
        self.cache.check(self.running, self.waiting)
