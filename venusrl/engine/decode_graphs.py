"""Decode steps replayed from CUDA graphs (`engine.cuda_graphs`).

A decode step of a small model is a few hundred kernel launches, whose launch cost exceeds the
GPU time (issue 31). A graph records them once per batch-size bucket, over persistent buffers
(token ids, positions, KV slots, page tables, lengths, key masks) that each step overwrites in
place; a batch runs in the smallest bucket that holds it, its extra rows padded with one key on
the reserved padding page, their outputs dropped. Pure decode steps only (no prefill spans, shared
prefix groups or layer bands: those shapes vary); the others run eagerly.

Without CUDA (`capture=False`) the same buffers run eagerly: what CPU tests check. On CUDA the
engine records every bucket when it starts (`capture_all`). The capture itself is untested so
far: no GPU has run it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from venusrl.engine.attention import DecodeBatch, StepBatch
from venusrl.engine.kv_cache import KVCache

Forward = Callable[[StepBatch, KVCache], torch.Tensor]


def buckets_up_to(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 rows up to `max_rows` (padding wastes < 8 rows past 8, and
    each bucket's graph holds its own activations)."""
    small = [b for b in (1, 2, 4) if b < max_rows]
    return (*small, *range(8, max_rows, 8), max_rows)


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `rows`; None when none does."""
    i = bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


@dataclass
class _Bucket:
    batch: StepBatch  # over the persistent buffers
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # the graph's output buffer


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        kv: KVCache,
        max_rows: int,
        max_pages: int,
        capture: bool,
    ) -> None:
        """`max_pages`: pages of the longest context; every bucket's page table is that wide."""
        self.forward, self.kv = forward, kv
        self.buckets = buckets_up_to(max_rows)
        self.max_pages, self.capture = max_pages, capture
        self._by_rows: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, batch: StepBatch) -> bool:
        d = batch.decode
        return (
            d is not None
            and not batch.prefills
            and not d.prefix_groups
            and not d.banded
            and d.pages.shape[1] <= self.max_pages
            and bucket_for(d.num_rows, self.buckets) is not None
        )

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The step's output (`forward`'s, [rows, ...]), from its bucket's graph; `fits(batch)`
        must hold."""
        assert batch.decode is not None and self.fits(batch)
        rows = batch.decode.num_rows
        size = bucket_for(rows, self.buckets)
        assert size is not None
        bucket = self._by_rows.get(size) or self._new_bucket(size, batch)
        self._load(bucket.batch, batch)
        if not self.capture:
            return self.forward(bucket.batch, self.kv)[:rows]
        if bucket.graph is None:
            self._record(bucket)
        assert bucket.graph is not None and bucket.out is not None
        bucket.graph.replay()
        return bucket.out[:rows]

    def capture_all(self) -> int:
        """Record every bucket's graph now, largest first (the smaller ones then fit in the
        memory the pool already holds), so that no step pays for a capture. Returns how many
        were recorded: none without CUDA, where there is nothing to record."""
        if not self.capture:
            return 0
        recorded = 0
        for size in reversed(self.buckets):
            if size in self._by_rows:
                continue
            blank = self._blank(size)
            bucket = self._new_bucket(size, blank)
            self._load(bucket.batch, blank)
            self._record(bucket)
            recorded += 1
        return recorded

    def _blank(self, rows: int) -> StepBatch:
        """`rows` decode rows of one key on the padding page, what a capture at start runs: it
        writes K/V only there."""
        dev, kv = self.kv.device, self.kv
        zeros = torch.zeros(rows, dtype=torch.long, device=dev)
        decode = DecodeBatch(
            num_rows=rows,
            pages=torch.zeros(rows, 1, dtype=torch.long, device=dev),
            lengths=torch.ones(rows, dtype=torch.int32, device=dev),
            key_mask=torch.zeros(1, rows, 1, kv.page_size, dtype=kv.device_kv.dtype, device=dev),
            prefix_groups=(),
        )
        return StepBatch(zeros, zeros, zeros, torch.arange(rows, device=dev), decode, ())

    def _new_bucket(self, size: int, like: StepBatch) -> _Bucket:
        assert like.decode is not None
        dev, width = like.input_ids.device, self.max_pages * self.kv.page_size
        decode = DecodeBatch(
            num_rows=size,
            pages=torch.zeros(size, self.max_pages, dtype=like.decode.pages.dtype, device=dev),
            lengths=torch.ones(size, dtype=torch.int32, device=dev),
            key_mask=torch.zeros(1, size, 1, width, dtype=like.decode.key_mask.dtype, device=dev),
            prefix_groups=(),
        )
        static = StepBatch(
            input_ids=torch.zeros(size, dtype=like.input_ids.dtype, device=dev),
            positions=torch.zeros(size, dtype=like.positions.dtype, device=dev),
            slots=torch.zeros(size, dtype=like.slots.dtype, device=dev),
            logits_rows=torch.arange(size, device=dev),
            decode=decode,
            prefills=(),
        )
        self._by_rows[size] = bucket = _Bucket(static)
        return bucket

    def _load(self, static: StepBatch, batch: StepBatch) -> None:
        """Overwrite the buffers in place with `batch`; rows past it attend one key of page 0
        (reserved padding, never live data) and write their K/V there."""
        new, old = batch.decode, static.decode
        assert new is not None and old is not None
        rows, width = new.num_rows, new.pages.shape[1]
        for buffer, values in (
            (static.input_ids, batch.input_ids),
            (static.positions, batch.positions),
            (static.slots, batch.slots),
        ):
            buffer[rows:].zero_()
            buffer[:rows].copy_(values)
        old.pages.zero_()
        old.pages[:rows, :width].copy_(new.pages)
        old.lengths.fill_(1)
        old.lengths[:rows].copy_(new.lengths)
        keys = torch.arange(old.key_mask.shape[-1], device=old.key_mask.device)
        beyond = keys[None, :] >= old.lengths[:, None]
        old.key_mask[0, :, 0].copy_(torch.zeros_like(beyond, dtype=old.key_mask.dtype))
        old.key_mask[0, :, 0].masked_fill_(beyond, float("-inf"))

    def _record(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (compiles kernels, sizes workspaces), then capture. Both
        write the buffers' K/V again: the same values, from the same inputs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(bucket.batch, self.kv)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.out = self.forward(bucket.batch, self.kv)
        bucket.graph = graph
