"""Radix tree over token ids whose nodes store KV page ids (never the KV data itself).

Granularity is one page: a node's key is a whole number of pages of tokens, so a match or a
split always lands on a page boundary and a cached page is never partially valid.

Ownership: a page id inside the tree is owned by the tree. A request that matched a prefix
*borrows* those pages and must hold a lock on the matched node until it stops reading them;
`lock` walks to the root, so every ancestor is protected too. Only unlocked leaves are evicted,
from a heap ordered by an eviction key (LRU by default; later policies add keys, not trees).

Namespaces: each namespace (for example a weight-version salt) has its own root, so prefixes
cached under one namespace are never matched from another.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]
    pages: list[int]
    parent: RadixNode | None
    namespace: Hashable = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children


EvictionKey = Callable[[RadixNode], Any]
"""Orders eviction candidates: the smallest key is evicted first."""


def lru_key(node: RadixNode) -> int:
    return node.last_access


@dataclass(frozen=True)
class PrefixMatch:
    node: RadixNode  # deepest node of the match; lock it while the pages are in use
    pages: list[int]


class RadixTree:
    def __init__(self, page_size: int, eviction_key: EvictionKey = lru_key) -> None:
        self.page_size = page_size
        self.eviction_key = eviction_key
        self._roots: dict[Hashable, RadixNode] = {}
        self._tick = itertools.count(1)
        self.evictable_pages = 0  # pages in unlocked nodes
        self.protected_pages = 0  # pages in locked nodes

    # -- lookup -------------------------------------------------------------------------------

    def root(self, namespace: Hashable = None) -> RadixNode:
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = RadixNode((), [], None, namespace)
            node.lock_ref = 1  # roots are never evicted
        return node

    def match(self, tokens: Sequence[int], namespace: Hashable = None) -> PrefixMatch:
        """Longest cached prefix of `tokens`, whole pages only. Splits a node if needed."""
        ps = self.page_size
        node, pages, _ = self._walk(tuple(tokens[: len(tokens) - len(tokens) % ps]), namespace)
        return PrefixMatch(node, pages)

    def _walk(
        self, tokens: tuple[int, ...], namespace: Hashable
    ) -> tuple[RadixNode, list[int], int]:
        """Follow `tokens` down the tree, splitting where the match ends inside a node.
        Returns the deepest node reached, its path's pages and the tokens they cover."""
        ps = self.page_size
        node = self.root(namespace)
        pages: list[int] = []
        offset = 0
        tick = next(self._tick)
        node.last_access = tick
        while offset < len(tokens):
            child = node.children.get(tokens[offset : offset + ps])
            if child is None:
                break
            n = self._common_pages(child.key, tokens, offset)
            if n * ps < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            pages.extend(child.pages)
            offset += len(child.key)
            node = child
        return node, pages, offset

    def cached_pages(self, tokens: Sequence[int], namespace: Hashable = None) -> int:
        """How many whole pages of `tokens` are cached; read-only (no split, no LRU touch)."""
        ps = self.page_size
        tokens = tuple(tokens[: len(tokens) - len(tokens) % ps])
        node = self._roots.get(namespace)
        offset = 0
        while node is not None and offset < len(tokens):
            child = node.children.get(tokens[offset : offset + ps])
            if child is None:
                break
            n = self._common_pages(child.key, tokens, offset)
            offset += n * ps
            node = child if n * ps == len(child.key) else None
        return offset // ps

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
        )
        node.parent.children[upper.key[:ps]] = upper
        node.key = node.key[num_pages * ps :]
        node.pages = node.pages[num_pages:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        return upper

    # -- insert -------------------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable = None
    ) -> PrefixMatch:
        """Cache the whole pages of `tokens`, whose KV sits in `pages`.

        Returns the node that ends the span and the tree's page ids for it. Where the tree already
        had a prefix, its own pages are kept: every index where the result differs from `pages`
        is a duplicate that the caller still owns and must free (or keep using privately).
        """
        ps = self.page_size
        n_pages = min(len(tokens) // ps, len(pages))
        span = tuple(tokens[: n_pages * ps])
        node, cached, offset = self._walk(span, namespace)
        if offset < len(span):
            new_pages = list(pages[offset // ps : n_pages])
            child = RadixNode(
                span[offset:], new_pages, node, namespace, last_access=node.last_access
            )
            node.children[span[offset : offset + ps]] = child
            self._count(child, +1)
            node, cached = child, cached + new_pages
        return PrefixMatch(node, cached)

    # -- locking ------------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        while node is not None:
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
            node = node.parent  # type: ignore[assignment]

    def _count(self, node: RadixNode, sign: int) -> None:
        if node.lock_ref == 0:
            self.evictable_pages += sign * len(node.pages)
        else:
            self.protected_pages += sign * len(node.pages)

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, num_pages: int) -> list[int]:
        """Remove unlocked leaves, smallest eviction key first, until `num_pages` are freed.

        Returns the freed page ids (the caller gives them back to the allocator); may return
        fewer when not enough pages are evictable.
        """
        order = itertools.count()  # tie-break so nodes themselves are never compared
        heap = [(self.eviction_key(n), next(order), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            freed.extend(node.pages)
            self._count(node, -1)
            del parent.children[node.key[: self.page_size]]
            if parent.parent is not None and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_key(parent), next(order), parent))
        return freed

    def _evictable_leaves(self) -> list[RadixNode]:
        return [n for n in self.nodes() if n.is_leaf and n.lock_ref == 0 and n.parent is not None]

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
        return [p for n in self.nodes() for p in n.pages]

    # -- invariants ---------------------------------------------------------------------------

    def check(self) -> None:
        ps = self.page_size
        evictable = protected = 0
        seen: set[int] = set()
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
            for p in node.pages:
                assert p not in seen, f"page {p} cached twice"
                seen.add(p)
            if node.lock_ref == 0:
                evictable += len(node.pages)
            else:
                protected += len(node.pages)
        assert evictable == self.evictable_pages, "evictable page count drifted"
        assert protected == self.protected_pages, "protected page count drifted"
