"""Paged KV cache with two tiers: a device pool and a host pool of fixed-size pages.

Everything above this file deals in integer page ids (DESIGN.md contract 3). A page holds
`page_size` consecutive tokens of one sequence for every layer. Page 0 of the device tier is
reserved as the padding page: batched attention reads it for the unused tail of short sequences,
so it must never hold live data.

On CPU both tiers are host tensors; on CUDA the device tier lives in GPU memory and the host tier
in pinned memory, so `to_host`/`to_device` are real PCIe copies, made on a side stream
(`tier_copies.py`).

Layer bands (`policy.layer_residency`): under pressure a request's completed pages keep only a
band of their layers on device, the whole page being copied to host, where attention reads the
other layers from. A device page split n ways holds the bands of n such pages, one per contiguous
layer range, so each costs 1/n of a page. `BandPages` hands out those slots.
"""

from __future__ import annotations

import torch

from venusrl.engine.tier_copies import TierCopies
from venusrl.engine.uploads import ints


class OutOfPages(RuntimeError):
    """The allocator has fewer free pages than were asked for."""


class PageAllocator:
    """Owns the free list of one tier. Every page id is either free here or owned by a caller."""

    def __init__(self, num_pages: int, reserved: int = 0) -> None:
        if num_pages < reserved:
            raise ValueError(f"num_pages ({num_pages}) < reserved ({reserved})")
        self.num_pages = num_pages
        self.reserved = reserved
        # Popped from the end, so a fresh allocator hands out ascending, contiguous ids.
        self._free = list(range(num_pages - 1, reserved - 1, -1))
        self._is_free = [False] * reserved + [True] * (num_pages - reserved)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - self.reserved

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def free_page_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        if n <= 0:
            return []
        pages = self._free[-n:]
        pages.reverse()
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self.reserved <= p < self.num_pages:
                raise ValueError(f"page {p} is outside this allocator")
            if self._is_free[p]:
                raise ValueError(f"page {p} freed twice")
            self._is_free[p] = True
        self._free.extend(reversed(pages))

    def check(self) -> None:
        """Invariants: the free list and the free flags agree, no duplicates, ids in range."""
        assert len(set(self._free)) == len(self._free), "duplicate page in free list"
        assert all(self.reserved <= p < self.num_pages for p in self._free), "page id out of range"
        assert sum(self._is_free) == len(self._free), "free flags disagree with free list"
        assert all(self._is_free[p] for p in self._free), "free-listed page not flagged free"
        assert not any(self._is_free[: self.reserved]), "reserved page marked free"


class BandPages:
    """Device pages split into layer bands, each band holding one request page's layers.

    A page split n ways has n bands, each free or taken; pages come from the device allocator
    and go back to it when their last band is released. A band's layers sit at their own layer
    index, so attention reads them like any page of that layer.
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self._taken: dict[int, tuple[int, list[bool]]] = {}  # page -> (bands, taken per band)
        # (bands, band) -> split pages with that band free, in insertion order
        self._free: dict[tuple[int, int], dict[int, None]] = {}

    def pages(self) -> list[int]:
        return list(self._taken)

    def free_slots(self, bands: int, band: int) -> int:
        return len(self._free.get((bands, band), ()))

    def take(self, bands: int, band: int, page: int | None = None) -> int:
        """A slot for band `band` of `bands`: a split page with that band free or, when there is
        none, `page` (a full device page of the caller's) or else a new page from the allocator,
        split from now on. When the answer is not `page`, the caller copies the band's layers
        and frees `page`."""
        free = self._free.setdefault((bands, band), {})
        if free:
            slot = next(iter(free))
            del free[slot]
        else:
            slot = page if page is not None else self.allocator.allocate(1)[0]
            self._taken[slot] = (bands, [False] * bands)
            for b in range(bands):
                if b != band:
                    self._free.setdefault((bands, b), {})[slot] = None
        self._taken[slot][1][band] = True
        return slot

    def release(self, page: int, band: int) -> None:
        if page not in self._taken:
            raise ValueError(f"page {page} is not split")
        bands, taken = self._taken[page]
        if not taken[band]:
            raise ValueError(f"band {band} of page {page} released twice")
        taken[band] = False
        if any(taken):
            self._free[(bands, band)][page] = None
            return
        for b in range(bands):
            self._free[(bands, b)].pop(page, None)
        del self._taken[page]
        self.allocator.free([page])

    def frees(self, page: int, band: int) -> bool:
        """Would releasing this band give the page back to the allocator (no other is taken)?"""
        return sum(self._taken[page][1]) == 1

    def owned(self, page: int, band: int) -> bool:
        entry = self._taken.get(page)
        return entry is not None and entry[1][band]

    def check(self) -> None:
        for (bands, band), pages in self._free.items():
            for p in pages:
                assert self._taken[p][0] == bands and not self._taken[p][1][band], (
                    f"band {band} of page {p} listed free but taken"
                )
        for p, (bands, taken) in self._taken.items():
            assert any(taken), f"split page {p} has no band taken"
            assert not self.allocator.is_free(p), f"split page {p} is also free"
            for b in range(bands):
                assert taken[b] or p in self._free[(bands, b)], f"band {b} of {p} lost"


class KVCache:
    """Device and host KV tensors plus an allocator per tier.

    Tensor layout per tier: `[layers, 2 (k, v), kv_heads, pages, page_size, head_dim]`: one
    `index_select` along the page dimension gathers a sequence's K and V of one layer as
    `[2, kv_heads, seq_pages * page_size, head_dim]` without a permute. Page-level gathers
    measured ~1.7x faster than token-level ones here.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        device_pages: int,
        host_pages: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        shape = (num_layers, 2, num_kv_heads)
        self.device_kv = torch.zeros(
            (*shape, device_pages, page_size, head_dim), dtype=dtype, device=self.device
        )
        pin = self.device.type == "cuda"
        self.host_kv = torch.zeros(
            (*shape, host_pages, page_size, head_dim), dtype=dtype, pin_memory=pin
        )
        self.device_pages = PageAllocator(device_pages, reserved=1)
        self.host_pages = PageAllocator(host_pages)
        self.bands = BandPages(self.device_pages)
        self.num_layers = num_layers
        self.copies = TierCopies(self.device_kv, self.host_kv)

    def layer(self, layer: int) -> torch.Tensor:
        """K and V of one layer on the device tier: `[2, kv_heads, pages, page_size, head_dim]`."""
        return self.device_kv[layer]

    # Layer bands.

    def split(
        self, pages: list[int], bands: int, band: int, layers: range
    ) -> tuple[list[int], list[int]]:
        """Keep only `layers` (band `band` of `bands`) of full device pages on device: every
        page is copied whole to new host pages, its band moved to a shared split page where one
        has room. Returns (band pages, host pages); the device pages the caller owned are either
        band pages now or freed."""
        host = self.to_host(pages)
        slots = [self.bands.take(bands, band, p) for p in pages]
        moved = [(p, s) for p, s in zip(pages, slots, strict=True) if p != s]
        if moved:
            src, dst = ints([[p for p, _ in moved], [s for _, s in moved]], self.device)
            band_kv = self.device_kv[layers.start : layers.stop]
            band_kv.index_copy_(3, dst, band_kv.index_select(3, src))
            self.device_pages.free([p for p, _ in moved])
        return slots, host

    def band_from_host(self, host: list[int], bands: int, band: int, layers: range) -> list[int]:
        """Band slots holding `layers` of host pages, copied from them (the host pages stay:
        attention reads the other layers there). The device needs `len(host)` minus the free
        slots of that band in free pages."""
        slots = [self.bands.take(bands, band) for _ in host]
        self.copies.to_device(host, slots, layers)
        return slots

    def unsplit(self, band_pages: list[int], band: int, host: list[int]) -> list[int]:
        """Full device pages again, loaded from the host copies (which hold every layer); the
        band slots and host pages are freed. The caller makes sure the device has the pages:
        `len(host)` less those that releasing the bands frees."""
        for p in band_pages:
            self.bands.release(p, band)
        device = self.to_device(host)
        assert device is not None, "unsplit without room"
        self.host_pages.free(host)
        return device

    # The radix tree's `HostTier`: it moves whole nodes between the tiers.

    def host_free(self) -> int:
        return self.host_pages.num_free

    def to_host(self, device_pages: list[int]) -> list[int]:
        """Copy pages to newly allocated host pages; the device pages stay allocated."""
        host = self.host_pages.allocate(len(device_pages))
        self.copies.to_host(device_pages, host)
        return host

    def to_device(self, host_pages: list[int]) -> list[int] | None:
        """Copy host pages to newly allocated device pages, or None when too few are free; the
        host pages stay allocated."""
        if len(host_pages) > self.device_pages.num_free:
            return None
        device = self.device_pages.allocate(len(host_pages))
        self.copies.to_device(host_pages, device)
        return device

    def free_host(self, host_pages: list[int]) -> None:
        self.host_pages.free(host_pages)

    def page_bytes(self) -> int:
        """Bytes of one page, all layers, K and V."""
        per_page = self.device_kv[:, :, :, 0].numel()
        return per_page * self.device_kv.element_size()

    def check(self) -> None:
        self.device_pages.check()
        self.host_pages.check()
        self.bands.check()
