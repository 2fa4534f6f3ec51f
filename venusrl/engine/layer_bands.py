"""Layer-wise residency in the engine: which running requests keep only a band of their layers.

When the KV that high-priority requests need presses on the device (`policy.layer_residency`
says how hard), a running high-priority request's completed pages keep only a band of their
layers on device (the page shared with other requests' bands) and a whole copy on the host tier,
from which each layer outside the band is read as the forward pass reaches it. New tokens go to
ordinary pages, which are banded once complete. When the pressure falls, the pages are loaded
back whole. When the request stops, its banded pages join the radix tree as host nodes (their
host copy is the cache); when its trajectory's next turn comes back under pressure, it takes
those host pages back as banded pages, copying only its band to the device. Outputs do not
change: the same keys and values are read, from another place.

The engine measures the pressure and owns the queues; `LayerBands` changes requests' pages and
keeps the statistics of what moved. A request's `banded` record (`request.Banded`) says which
pages are banded and where their host copies are; `KVCache.bands` owns the split pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from venusrl.engine.attention import BandedPages
from venusrl.engine.kv_cache import KVCache
from venusrl.engine.radix_lending import LendingRadixTree
from venusrl.engine.radix_tree import RadixNode
from venusrl.engine.request import Banded, Request
from venusrl.policy.layer_residency import LayerResidency, band_layers


@dataclass
class BandStats:
    # Pages reduced to a layer band (ever; of those, taken from the host tier by a returning
    # trajectory, only its band copied to the device), loaded back whole (ever); bytes copied
    # between the tiers to band, unband and cache banded KV, and bytes of KV layers read from the
    # host tier by the forward passes.
    banded_pages: int = 0
    banded_from_host_pages: int = 0
    unbanded_pages: int = 0
    band_copy_bytes: int = 0
    streamed_bytes: int = 0


class LayerBands:
    def __init__(
        self,
        policy: LayerResidency,
        kv: KVCache,
        tree: LendingRadixTree,
        stats: BandStats,
        make_room: Callable[[int], bool],
    ) -> None:
        """`make_room(pages)` frees device pages by evicting idle KV in the retention policy's
        order; False when it cannot free that many."""
        self.policy = policy
        self.kv = kv
        self.tree = tree
        self.stats = stats
        self.make_room = make_room
        self.page_size = kv.page_size
        self.bands = 1  # what the pressure asked for at the last step
        self._next_band: Counter[int] = Counter()

    def apply(
        self, pressure: float, high: Sequence[Request], sibling_waiting: Callable[[Request], bool]
    ) -> None:
        """Band or unband the running high-priority requests' pages by the pressure (the KV
        pages high-priority requests need over the device pages). `sibling_waiting(r)`: a
        request of r's group waits with nothing cached yet, so r's cached prompt must stay
        where that sibling can match it."""
        self.bands = bands = self.policy.bands(pressure, self.kv.num_layers)
        for r in high:
            if r.banded is not None and bands == 1 and self.policy.unband(pressure):
                self._unband(r)
            elif r.banded is None and bands > 1 and self.kv.host_free() > 0:
                if not sibling_waiting(r):
                    self._take_private_prefix(r)
                band = self._pick_band(bands)
                layers = band_layers(band, bands, self.kv.num_layers)
                r.banded = Banded(bands, band, layers, first=r.num_shared_pages)
                self.band_completed(r)

    def admit(self, r: Request, sibling_waiting: Callable[[Request], bool]) -> int | None:
        """Under layer bands, a high-priority request whose context continues on host (its
        earlier turns, offloaded while it waited on a tool) takes those host pages as its
        banded pages and copies only its band's layers to the device, rather than load them
        whole and band them again. Returns how many pages it took; None where that does not
        apply (the prefix is then matched and loaded as usual). Only for high-priority
        requests (the caller's check); `sibling_waiting` as for `apply`. The statistics wait
        until the admission sticks (`count_admission`)."""
        bands = self.bands
        if bands == 1:
            return None
        ids, ns = r.all_ids[: r.num_tokens - 1], r.namespace
        on_host = self.tree.cached(ids, ns).host_pages
        if not on_host or sibling_waiting(r):
            return None
        band = self._pick_band(bands)
        head = self.tree.match(ids, ns, load=False)
        self.tree.lock(head.node)
        host: list[int] = []
        if self.make_room(max(0, on_host - self.kv.bands.free_slots(bands, band))):
            end, host = self.tree.take_host_path(ids, ns, r.trajectory_id)
            assert end is head.node
        if not host:
            self.tree.unlock(head.node)
            return None
        layers = band_layers(band, bands, self.kv.num_layers)
        slots = self.kv.band_from_host(host, bands, band, layers)
        if head.pages:
            r.tree_node = head.node
        else:
            self.tree.unlock(head.node)  # the root: nothing on device to hold
        r.pages = [*head.pages, *slots]
        r.num_shared_pages = len(head.pages)
        r.num_computed = len(r.pages) * self.page_size
        r.banded = Banded(bands, band, layers, first=len(head.pages), host=host)
        return len(host)

    def count_admission(self, r: Request, pages: int) -> None:
        """Statistics of an admission that took `pages` host pages as banded pages."""
        assert r.banded is not None
        self.stats.banded_pages += pages
        self.stats.banded_from_host_pages += pages
        self._count_copies(pages, r.banded.layers)

    def band_completed(self, r: Request) -> None:
        """Reduce the request's completed pages not banded yet to its band (while the host tier
        has room for their whole copy)."""
        s = r.banded
        assert s is not None
        start = s.end
        n = min(r.num_computed // self.page_size - start, self.kv.host_free())
        if n <= 0:
            return
        pages, host = self.kv.split(r.pages[start : start + n], s.bands, s.band, s.layers)
        r.pages[start : start + n] = pages
        s.host += host
        self.stats.banded_pages += n
        self._count_copies(n)

    def reads(self, r: Request, skip: int = 0) -> BandedPages | None:
        """What a banded request reads from host in the layers outside its band; `skip`: its
        first pages, which its row reads elsewhere (a shared prefix)."""
        s = r.banded
        if s is None or not s.host:
            return None
        layers = self.kv.num_layers
        self.stats.streamed_bytes += (
            len(s.host) * (layers - len(s.layers)) * self.kv.page_bytes() // layers
        )
        return BandedPages(s.first - skip, torch.tensor(s.host), s.layers)

    def release(self, r: Request, cache: bool) -> RadixNode | None:
        """A banded request's KV leaves the device: with the prefix cache (`cache`), its banded
        pages and its completed pages after them (copied to host while there is room) join the
        tree as host nodes, the host copies being whole; without, its host pages are freed.
        Returns the node its cached context ends at. The caller frees the pages after them."""
        s = r.banded
        assert s is not None
        for p in r.pages[s.first : s.end]:
            self.kv.bands.release(p, s.band)
        if not cache:
            self.kv.free_host(s.host)
            return None
        complete = r.pages[s.end : r.num_computed // self.page_size]
        tail = self.kv.to_host(complete[: self.kv.host_free()])
        self._count_copies(len(tail))
        host = s.host + tail
        node, duplicates = self.tree.insert_host(
            r.all_ids, host, s.first, r.namespace, r.trajectory_id
        )
        self.kv.free_host(duplicates)
        return node

    def _pick_band(self, bands: int) -> int:
        """The band with the most free slots in split pages (the fewest new pages to split),
        round robin among equals, so requests spread over the bands."""
        start = self._next_band[bands]
        self._next_band[bands] += 1
        order = [(start + i) % bands for i in range(bands)]
        return max(order, key=lambda b: self.kv.bands.free_slots(bands, b))

    def _take_private_prefix(self, r: Request) -> None:
        """The cached prefix only this request reads becomes its own, to be banded: in a
        multi-turn trajectory that is most of its context (its earlier turns). No more than
        the host tier can take: what is not banded must go back to the tree on device."""
        if r.tree_node is None:
            return
        node, pages = self.tree.detach_private(r.tree_node, r.trajectory_id, self.kv.host_free())
        r.num_shared_pages -= len(pages)
        r.tree_node = node
        if node.parent is None:  # the root: nothing on device to hold
            self.tree.unlock(node)
            r.tree_node = None

    def _unband(self, r: Request) -> None:
        """Load the request's banded pages back whole, evicting idle KV in the retention
        policy's order where free pages do not hold them."""
        s = r.banded
        assert s is not None
        banded = r.pages[s.first : s.end]
        freed = sum(self.kv.bands.frees(p, s.band) for p in banded)
        if not self.make_room(len(banded) - freed):
            return
        device = self.kv.unsplit(banded, s.band, s.host)
        r.pages[s.first : s.end] = device
        self._count_copies(len(device))
        self.stats.unbanded_pages += len(device)
        r.banded = None

    def _count_copies(self, pages: int, layers: range | None = None) -> None:
        """Count `pages` copied between the tiers (only `layers` of them, if given)."""
        n_layers = len(layers) if layers is not None else self.kv.num_layers
        self.stats.band_copy_bytes += pages * self.kv.page_bytes() * n_layers // self.kv.num_layers
