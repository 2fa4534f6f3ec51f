"""Copies between the KV cache's two tiers, overlapped with the forward pass on CUDA.

Two kinds of copy cross the tiers:

- whole pages (`TierCopies`): the radix tree offloading the KV of a trajectory that waits on a
  tool and loading it back, and layer bands splitting and joining pages;
- one layer of a step's host pages at a time (`StreamedLayers`): a banded request reads, in each
  layer outside its band, that layer of its host pages. Layer i+1 is copied while layer i
  computes, so a step pays for the copies only where they take longer than the layers.

On CUDA the host tier is pinned and every copy runs on one side stream, ordered against the
compute stream by events: the compute stream waits only before it reads what a copy wrote, the
side stream only until the compute stream has finished with what it overwrites, and the host
only before it reads host pages whose copy from the device has not landed yet. Device-to-host
copies land lazily: their data waits in pinned staging until a reader of those host pages (or
the next copy) finds the copy done. On a CPU both tiers are the same
memory: the copies are plain and nothing waits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from venusrl.engine.attention import BandedPages
from venusrl.engine.uploads import ints


@dataclass
class _Landing:
    """A device-to-host copy in flight: `staging` (pinned) becomes `host` pages once `done`."""

    done: torch.cuda.Event
    staging: torch.Tensor  # [layers, 2, kv_heads, pages, page_size, dim]
    host: list[int]


class TierCopies:
    """Page copies between `device_kv` and `host_kv` (kv_cache.py's layout, pages on dim 3)."""

    def __init__(self, device_kv: torch.Tensor, host_kv: torch.Tensor) -> None:
        self.device_kv, self.host_kv = device_kv, host_kv
        cuda = device_kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(device_kv.device) if cuda else None
        self._landing: list[_Landing] = []

    def to_host(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy every layer of `device_pages` into `host_pages`. The device pages may be reused
        at once: the compute stream reads them before anything queued after this call."""
        if not device_pages:
            return
        src = ints(device_pages, self.device_kv.device)
        pages = self.device_kv.index_select(3, src)  # on the compute stream, after its writes
        if self.stream is None:
            self.host_kv.index_copy_(3, torch.tensor(host_pages), pages)
            return
        self._land_done()
        staging = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            staging.copy_(pages, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        pages.record_stream(self.stream)  # freed by the compute stream, read by the side one
        self._landing.append(_Landing(done, staging, list(host_pages)))

    def to_device(
        self, host_pages: list[int], device_pages: list[int], layers: range | None = None
    ) -> None:
        """Copy `layers` (all by default) of `host_pages` into `device_pages`; the compute
        stream reads them only after the copy."""
        if not host_pages:
            return
        self.settle(host_pages)
        span = slice(None) if layers is None else slice(layers.start, layers.stop)
        src = torch.tensor(host_pages)
        if self.stream is None:
            data = self.host_kv[span].index_select(3, src)
            self.device_kv[span].index_copy_(3, ints(device_pages, self.device_kv.device), data)
            return
        source = self.host_kv[span]
        staging = torch.empty(
            (*source.shape[:3], len(host_pages), *source.shape[4:]),
            dtype=source.dtype,
            pin_memory=True,
        )
        torch.index_select(source, 3, src, out=staging)  # a host gather into pinned memory
        self.stream.wait_stream(torch.cuda.current_stream())  # the pages' last readers
        with torch.cuda.stream(self.stream):
            dst = ints(device_pages, self.device_kv.device)
            data = staging.to(self.device_kv.device, non_blocking=True)
            self.device_kv[span].index_copy_(3, dst, data)
            done = torch.cuda.Event()
            done.record(self.stream)
        torch.cuda.current_stream().wait_event(done)

    def settle(self, host_pages: Collection[int] | None = None) -> None:
        """Land the copies still in flight to `host_pages` (every copy when None), waiting
        for them: their readers call this first."""
        wanted = None if host_pages is None else set(host_pages)
        last = -1
        for i, copy in enumerate(self._landing):
            if wanted is None or not wanted.isdisjoint(copy.host):
                last = i
        if last >= 0:
            self._landing[last].done.synchronize()  # one stream: the ones before it are done
        self._land_done()

    def _land_done(self) -> None:
        """Write the copies that are done into the host tier, in the order they were made (a
        host page freed and taken again lands its newer data last)."""
        while self._landing and self._landing[0].done.query():
            copy = self._landing.pop(0)
            self.host_kv.index_copy_(3, torch.tensor(copy.host), copy.staging)

    @property
    def in_flight(self) -> int:
        return len(self._landing)


@dataclass(frozen=True)
class HostLayer:
    """One layer of a step's host pages, on the device: what attention reads for band pages."""

    kv: torch.Tensor  # [2, kv_heads, pages, page_size, dim]
    offsets: dict[int, int]  # id(BandedPages) -> index of its first page in `kv`

    def read(self, banded: BandedPages) -> torch.Tensor:
        """The band pages' keys and values of this layer: [2, kv_heads, tokens, dim]."""
        _, kv_heads, _, page_size, dim = self.kv.shape
        first, n = self.offsets[id(banded)], len(banded.host)
        return self.kv[:, :, first : first + n].reshape(2, kv_heads, n * page_size, dim)


@dataclass(frozen=True)
class _LayerPlan:
    host: torch.Tensor  # host page ids this layer reads, every banded span's in turn
    offsets: dict[int, int]
    slot: int  # device staging buffer (two, alternating between the layers that read)


class StreamedLayers:
    """A step's reads from the host tier, staged one layer ahead of the forward pass.

    The model asks for layer i's pages (`layer`) before it runs layer i, then calls `prefetch`
    once layer i is queued, which starts copying the next layer that reads. Each layer reads
    only the pages of the spans whose band leaves it out.
    """

    def __init__(self, reads: Sequence[BandedPages], copies: TierCopies) -> None:
        self.copies = copies
        host_kv = copies.host_kv
        self._plans: list[_LayerPlan | None] = []
        slot = 0
        for layer in range(host_kv.shape[0]):
            spans = [b for b in reads if layer not in b.layers]
            if not spans:
                self._plans.append(None)
                continue
            offsets, total = {}, 0
            for b in spans:
                offsets[id(b)], total = total, total + len(b.host)
            self._plans.append(_LayerPlan(torch.cat([b.host for b in spans]), offsets, slot))
            slot ^= 1
        if copies.in_flight:
            copies.settle(torch.cat([b.host for b in reads]).tolist())
        self._staged: dict[int, torch.Tensor] = {}
        self._stream = copies.stream
        if self._stream is not None:
            self._init_buffers(max(len(p.host) for p in self._plans if p), self._stream)
        self._start(self._next_reading(0))

    @classmethod
    def of_step(cls, reads: Sequence[BandedPages], copies: TierCopies) -> StreamedLayers | None:
        return cls(reads, copies) if reads else None

    @property
    def staged(self) -> tuple[int, ...]:
        """Layers whose copy has started and that no layer has read yet."""
        return tuple(self._staged)

    def layer(self, layer: int) -> HostLayer | None:
        """Layer `layer` of the pages it reads, on the device (None: it reads none)."""
        plan = self._plans[layer]
        if plan is None:
            return None
        if layer not in self._staged:
            self._start(layer)
        if self._stream is not None:
            ready = self._ready[plan.slot]
            assert ready is not None  # started above or by `prefetch`
            torch.cuda.current_stream().wait_event(ready)
        return HostLayer(self._staged.pop(layer), plan.offsets)

    def prefetch(self, after: int) -> None:
        """Layer `after` is queued: its device buffer is free once it has run; start the next
        layer that reads."""
        plan = self._plans[after]
        if plan is not None and self._stream is not None:
            self._consumed[plan.slot] = event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        self._start(self._next_reading(after + 1))

    def _next_reading(self, layer: int) -> int | None:
        return next((i for i in range(layer, len(self._plans)) if self._plans[i]), None)

    def _start(self, layer: int | None) -> None:
        if layer is None or layer in self._staged:
            return
        plan = self._plans[layer]
        assert plan is not None
        source = self.copies.host_kv[layer]
        if self._stream is None:
            self._staged[layer] = source.index_select(2, plan.host)
            return
        shape = (*source.shape[:2], len(plan.host), *source.shape[3:])
        numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
        # A fresh pinned block per layer: the caching host allocator keeps it until its copy
        # has run, so the host never waits for an earlier layer's copy to reuse one.
        pinned = torch.empty(shape, dtype=source.dtype, pin_memory=True)
        device = self._device[plan.slot][:numel].view(shape)
        torch.index_select(source, 2, plan.host, out=pinned)
        consumed = self._consumed[plan.slot]
        with torch.cuda.stream(self._stream):
            if consumed is not None:
                self._stream.wait_event(consumed)  # the layer that last read `device` has run
            device.copy_(pinned, non_blocking=True)
            self._ready[plan.slot] = event = torch.cuda.Event()
            event.record(self._stream)
        self._staged[layer] = device

    def _init_buffers(self, pages: int, stream: torch.cuda.Stream) -> None:
        host_kv = self.copies.host_kv
        _, _, kv_heads, _, page_size, dim = host_kv.shape
        numel = 2 * kv_heads * pages * page_size * dim
        device = self.copies.device_kv.device
        self._device = [torch.empty(numel, dtype=host_kv.dtype, device=device) for _ in "ab"]
        for buffer in self._device:  # written on the side stream: not reused before it has run
            buffer.record_stream(stream)
        self._ready: list[torch.cuda.Event | None] = [None, None]
        self._consumed: list[torch.cuda.Event | None] = [None, None]
