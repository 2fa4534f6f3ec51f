"""Radix tree over token ids whose nodes store KV page ids (never the KV data itself).

Granularity is one page: a node's key is a whole number of pages of tokens, so a match or a
split always lands on a page boundary and a cached page is never partially valid.

Ownership: a page id inside the tree is owned by the tree. A request that matched a prefix
*borrows* those pages and must hold a lock on the matched node until it stops reading them;
`lock` walks to the root, so every ancestor is protected too.

Two tiers: a node's pages are device pages or, once offloaded, host pages (`on_host`). Only a
suffix of a path may be on host (a node on device has its parent on device), so a match reads
device pages up to the first host node and loads the rest back in order. Locked nodes are always
on device.

Eviction frees device pages from unlocked nodes none of whose children are on device, smallest
eviction key first (LRU by default; the engine passes a key built from a retention policy). The
tree keeps the nodes that may be evictable as they become so (unlocked, inserted, loaded back, a
child gone from the device), so an eviction ranks those instead of walking the whole tree: the
engine evicts whenever a full cache must give a page, and a long run caches thousands of nodes.
The
`offload_if` predicate says, per node, whether its KV moves to the host tier (through `tiers`,
which copies the data) or is dropped; dropping a node drops the host part of the subtree below it.
Nodes record the trajectories whose context runs through them (`owners`), so a retention policy
can rank a node by the state of its owners.

Namespaces: each namespace (for example a weight-version salt) has its own root, so prefixes
cached under one namespace are never matched from another.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]
    pages: list[int]  # device page ids, or host page ids when `on_host`
    parent: RadixNode | None
    namespace: Hashable = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    on_host: bool = False
    owners: set[str] = field(default_factory=set)  # trajectories whose context includes it

    @property
    def is_leaf(self) -> bool:
        return not self.children


EvictionKey = Callable[[RadixNode], Any]
"""Orders eviction candidates: the smallest key leaves the device first."""


def just(owner: str | None) -> set[str]:
    return set() if owner is None else {owner}


def lru_key(node: RadixNode) -> int:
    return node.last_access


def never(node: RadixNode) -> bool:
    return False


class HostTier(Protocol):
    """Moves KV between the tiers for the tree; the caller keeps the device allocator."""

    def host_free(self) -> int:
        """Host pages free now."""
        ...

    def to_host(self, device_pages: list[int]) -> list[int]:
        """Copy these device pages to newly allocated host pages; the device pages stay allocated
        (the tree hands them back to the caller as freed)."""
        ...

    def to_device(self, host_pages: list[int]) -> list[int] | None:
        """Copy host pages to newly allocated device pages, or None when the device is full."""
        ...

    def free_host(self, host_pages: list[int]) -> None: ...


@dataclass(frozen=True)
class PrefixMatch:
    node: RadixNode  # deepest node of the match; lock it while the pages are in use
    pages: list[int]  # device pages
    loaded_pages: int = 0  # of `pages`, those loaded back from the host tier by this match


class Cached(NamedTuple):
    device_pages: int  # leading pages cached on device
    host_pages: int  # pages after those, cached on host
    idle_pages: int = 0  # of the device pages, those in unlocked (evictable) nodes


class RadixTree:
    def __init__(
        self,
        page_size: int,
        eviction_key: EvictionKey = lru_key,
        offload_if: Callable[[RadixNode], bool] = never,
        tiers: HostTier | None = None,
    ) -> None:
        self.page_size = page_size
        self.eviction_key = eviction_key
        self.offload_if = offload_if
        self.tiers = tiers
        self._roots: dict[Hashable, RadixNode] = {}
        self._tick = itertools.count(1)
        self.evictable_pages = 0  # device pages in unlocked nodes
        self.protected_pages = 0  # device pages in locked nodes
        self.host_pages = 0  # host pages in offloaded nodes
        self.offloaded_pages = 0  # pages moved to host, ever
        self.loaded_pages = 0  # pages moved back to device, ever
        self.dropped_pages = 0  # pages dropped, ever (either tier)
        # Every evictable node, and some that stopped being so (dropped from here when an
        # eviction ranks the candidates). Insertion-ordered, so ties in the key break the same
        # way in every run.
        self._candidates: dict[RadixNode, None] = {}

    # -- lookup -------------------------------------------------------------------------------

    def root(self, namespace: Hashable = None) -> RadixNode:
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = RadixNode((), [], None, namespace)
            node.lock_ref = 1  # roots are never evicted
        return node

    def match(
        self, tokens: Sequence[int], namespace: Hashable = None, load: bool = True
    ) -> PrefixMatch:
        """Longest cached prefix of `tokens`, whole pages only, on device: host nodes on the way
        are loaded back while the device has room (unless `load` is off: the match then ends at
        the first host node). Splits a node if needed."""
        ps = self.page_size
        span = tuple(tokens[: len(tokens) - len(tokens) % ps])
        node, pages, _, loaded = self._walk(span, namespace, load=load)
        return PrefixMatch(node, pages, loaded)

    def _walk(
        self,
        tokens: tuple[int, ...],
        namespace: Hashable,
        load: bool = False,
        adopt: Sequence[int] | None = None,
        through_host: bool = False,
    ) -> tuple[RadixNode, list[int], int, int]:
        """Follow `tokens` down the tree, splitting where the match ends inside a node.

        A host node on the way ends the walk unless `adopt` holds the caller's device pages for
        `tokens` (the node takes them over and its host copy is freed), `load` is set (the node
        is copied back to device while there is room) or `through_host` is (the walk goes on
        through host nodes, which stay there). Returns the deepest node reached, its path's
        pages (device ones, except through host), the tokens they cover and how many pages were
        loaded.
        """
        ps = self.page_size
        node = self.root(namespace)
        pages: list[int] = []
        offset = loaded = 0
        tick = next(self._tick)
        node.last_access = tick
        while offset < len(tokens):
            child = node.children.get(tokens[offset : offset + ps])
            if child is None:
                break
            n = self._common_pages(child.key, tokens, offset)
            if n * ps < len(child.key):
                child = self._split(child, n)
            if child.on_host:
                if adopt is not None:
                    self._to_device(child, list(adopt[offset // ps : offset // ps + n]))
                elif load and self.tiers is not None:
                    device = self.tiers.to_device(child.pages)
                    if device is None:
                        break
                    self._to_device(child, device)
                    loaded += n
                elif not through_host:
                    break
            child.last_access = tick
            pages.extend(child.pages)
            offset += len(child.key)
            node = child
        return node, pages, offset, loaded

    def _to_device(self, node: RadixNode, device_pages: list[int]) -> None:
        assert self.tiers is not None and node.on_host and node.lock_ref == 0
        self.tiers.free_host(node.pages)
        self.host_pages -= len(node.pages)
        self.loaded_pages += len(node.pages)
        node.pages, node.on_host = device_pages, False
        self.evictable_pages += len(device_pages)
        self._candidates[node] = None

    def cached(self, tokens: Sequence[int], namespace: Hashable = None) -> Cached:
        """How many whole pages of `tokens` are cached, on device then on host; read-only (no
        split, no LRU touch, nothing loaded)."""
        ps = self.page_size
        tokens = tuple(tokens[: len(tokens) - len(tokens) % ps])
        node = self._roots.get(namespace)
        offset = device = idle = 0
        while node is not None and offset < len(tokens):
            child = node.children.get(tokens[offset : offset + ps])
            if child is None:
                break
            n = self._common_pages(child.key, tokens, offset)
            offset += n * ps
            if not child.on_host:
                device += n
                idle += n if child.lock_ref == 0 else 0
            node = child if n * ps == len(child.key) else None
        return Cached(device, offset // ps - device, idle)

    def _common_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], offset: int) -> int:
        ps = self.page_size
        if tokens[offset : offset + len(key)] == key:
            return len(key) // ps
        n = 1  # the first page matched: it is the child's dict key
        while (n + 1) * ps <= len(key) and key[n * ps : (n + 1) * ps] == tokens[
            offset + n * ps : offset + (n + 1) * ps
        ]:
            n += 1
        return n

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut `node` after `num_pages` pages; returns the new upper part."""
        ps = self.page_size
        assert node.parent is not None and 0 < num_pages < len(node.pages)
        upper = RadixNode(
            node.key[: num_pages * ps],
            node.pages[:num_pages],
            node.parent,
            node.namespace,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            on_host=node.on_host,
            owners=set(node.owners),
        )
        node.parent.children[upper.key[:ps]] = upper
        node.key = node.key[num_pages * ps :]
        node.pages = node.pages[num_pages:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        return upper

    # -- insert -------------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        namespace: Hashable = None,
        owner: str | None = None,
    ) -> PrefixMatch:
        """Cache the whole pages of `tokens`, whose KV sits in device `pages`.

        Returns the node that ends the span and the tree's page ids for it. Where the tree already
        had a prefix on device, its own pages are kept: every index where the result differs from
        `pages` is a duplicate that the caller still owns and must free (or keep using
        privately). Where it had the prefix on host, it takes `pages` over and frees the host
        copy. `owner` (a trajectory id) is recorded on every node of the span.
        """
        ps = self.page_size
        n_pages = min(len(tokens) // ps, len(pages))
        span = tuple(tokens[: n_pages * ps])
        node, cached, offset, _ = self._walk(span, namespace, adopt=pages)
        if offset < len(span):
            new_pages = list(pages[offset // ps : n_pages])
            child = RadixNode(
                span[offset:], new_pages, node, namespace, last_access=node.last_access
            )
            node.children[span[offset : offset + ps]] = child
            self._count(child, +1)
            self._candidates[child] = None
            node, cached = child, cached + new_pages
        self._own(node, owner)
        return PrefixMatch(node, cached)

    def _own(self, node: RadixNode, owner: str | None) -> None:
        """Record `owner` on `node` and every ancestor."""
        if owner is None:
            return
        up: RadixNode | None = node
        while up is not None and up.parent is not None and owner not in up.owners:
            up.owners.add(owner)
            up = up.parent

    def touch(self, node: RadixNode) -> None:
        """The path ending at `node` was just used (by a request that read it to its end)."""
        tick = next(self._tick)
        up: RadixNode | None = node
        while up is not None:
            up.last_access = tick
            up = up.parent

    def disown(self, node: RadixNode, owner: str) -> None:
        """`owner` (a trajectory whose episode is over) no longer reads any node of the tree
        `node` is in. Its nodes hang together from the root (a child's owners own its parent),
        and may reach below `node`: a shorter insertion can end inside an owner's path."""
        root = node
        while root.parent is not None:
            root = root.parent
        stack = [c for c in root.children.values() if owner in c.owners]
        while stack:
            n = stack.pop()
            n.owners.discard(owner)
            stack.extend(c for c in n.children.values() if owner in c.owners)

    # -- locking ------------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        while node is not None:
            assert not node.on_host, "a host node cannot be locked; match loads it first"
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
                self._candidates[node] = None
            node = node.parent  # type: ignore[assignment]

    def _count(self, node: RadixNode, sign: int) -> None:
        if node.on_host:
            self.host_pages += sign * len(node.pages)
        elif node.lock_ref == 0:
            self.evictable_pages += sign * len(node.pages)
        else:
            self.protected_pages += sign * len(node.pages)

    # -- eviction -----------------------------------------------------------------------------

    def _evictable(self, node: RadixNode) -> bool:
        return (
            node.parent is not None
            and not node.on_host
            and node.lock_ref == 0
            and all(c.on_host for c in node.children.values())
        )

    def evict(self, num_pages: int, offload: bool = True) -> list[int]:
        """Free device pages from evictable nodes, smallest eviction key first, until
        `num_pages` are freed: each node is offloaded where `offload_if` says so and the host
        tier has room (made by dropping host nodes of smaller key), else dropped.

        Returns the freed device page ids (the caller gives them back to its allocator); may
        return fewer when not enough pages are evictable.
        """
        order = itertools.count()  # tie-break so nodes themselves are never compared
        for node in [n for n in self._candidates if not self._evictable(n)]:
            del self._candidates[node]
        heap = [(self.eviction_key(n), next(order), n) for n in self._candidates]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            key, _, node = heapq.heappop(heap)
            del self._candidates[node]
            parent = node.parent
            assert parent is not None
            freed.extend(node.pages)
            if not (offload and self._offload(node, key)):
                self._drop(node)
            if self._evictable(parent):
                self._candidates[parent] = None
                heapq.heappush(heap, (self.eviction_key(parent), next(order), parent))
        return freed

    def flush(self) -> list[int]:
        """Drop every node no request holds, on either tier; returns the freed device pages."""
        freed = self.evict(self.evictable_pages, offload=False)
        for node in self.nodes():
            if node.on_host and node.parent is not None and not node.parent.on_host:
                self._drop(node)
        return freed

    def _offload(self, node: RadixNode, key: Any) -> bool:
        if self.tiers is None or not self.offload_if(node):
            return False
        need = len(node.pages) - self.tiers.host_free()
        if need > 0 and not self._make_host_room(need, key):
            return False
        self.evictable_pages -= len(node.pages)
        node.pages, node.on_host = self.tiers.to_host(node.pages), True
        self.host_pages += len(node.pages)
        self.offloaded_pages += len(node.pages)
        return True

    def _make_host_room(self, num_pages: int, below: Any) -> bool:
        """Drop host leaves whose key is smaller than `below` until `num_pages` host pages are
        free; drops nothing unless that frees enough."""
        leaves = sorted(
            (n for n in self.nodes() if n.on_host and n.is_leaf),
            key=self.eviction_key,
        )
        chosen, room = [], 0
        for leaf in leaves:
            if room >= num_pages or not self.eviction_key(leaf) < below:
                break
            chosen.append(leaf)
            room += len(leaf.pages)
        if room < num_pages:
            return False
        for leaf in chosen:
            self._drop(leaf)
        return True

    def _drop(self, node: RadixNode) -> None:
        """Remove `node` and its subtree (whose nodes are all on host) from the tree."""
        assert node.parent is not None
        del node.parent.children[node.key[: self.page_size]]
        self._candidates.pop(node, None)
        self._candidates[node.parent] = None  # its last device child may be gone
        stack = [node]
        while stack:
            n = stack.pop()
            self._count(n, -1)
            self.dropped_pages += len(n.pages)
            if n.on_host:
                assert self.tiers is not None
                self.tiers.free_host(n.pages)
            stack.extend(n.children.values())
        # The parent pointer stays: `disown` may still walk up from a dropped node.

    def nodes(self) -> list[RadixNode]:
        """Every non-root node."""
        out: list[RadixNode] = []
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_pages(self) -> list[int]:
        """Device pages held by the tree."""
        return [p for n in self.nodes() if not n.on_host for p in n.pages]

    def all_host_pages(self) -> list[int]:
        return [p for n in self.nodes() if n.on_host for p in n.pages]

    # -- invariants ---------------------------------------------------------------------------

    def check(self) -> None:
        ps = self.page_size
        evictable = protected = host = 0
        seen: set[int] = set()
        seen_host: set[int] = set()
        for root in self._roots.values():
            assert root.parent is None and root.lock_ref >= 1 and not root.pages
        for node in self.nodes():
            assert node.parent is not None
            assert len(node.key) == len(node.pages) * ps > 0, "key is not whole pages"
            assert node.parent.children.get(node.key[:ps]) is node, "child stored under wrong key"
            assert node.namespace == node.parent.namespace, "namespace differs from parent's"
            assert node.lock_ref >= 0
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "a locked child's ancestor is not locked"
            for child in node.children.values():
                assert node.owners >= child.owners, "an owner of a child does not own its parent"
            if node.on_host:
                assert node.lock_ref == 0, "a host node is locked"
                for p in node.pages:
                    assert p not in seen_host, f"host page {p} cached twice"
                    seen_host.add(p)
                host += len(node.pages)
                continue
            assert not node.parent.on_host, "a device node under a host node"
            for p in node.pages:
                assert p not in seen, f"page {p} cached twice"
                seen.add(p)
            if node.lock_ref == 0:
                evictable += len(node.pages)
            else:
                protected += len(node.pages)
            if self._evictable(node):
                assert node in self._candidates, "an evictable node is not an eviction candidate"
        assert evictable == self.evictable_pages, "evictable page count drifted"
        assert protected == self.protected_pages, "protected page count drifted"
        assert host == self.host_pages, "host page count drifted"
