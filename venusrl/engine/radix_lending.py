"""A radix tree whose paths can be lent out whole: layer-wise residency (`engine.layer_bands`)
takes the part of a request's context that only it reads out of the tree while the request
keeps a band of its layers, and puts it back as host nodes when the request stops."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from venusrl.engine.radix_tree import RadixNode, RadixTree, just


class LendingRadixTree(RadixTree):
    def insert_host(
        self,
        tokens: Sequence[int],
        host_pages: Sequence[int],
        first: int,
        namespace: Hashable = None,
        owner: str | None = None,
    ) -> tuple[RadixNode, list[int]]:
        """Cache pages `first`.. of `tokens`, whose KV sits in `host_pages` (a request that kept
        only a layer band on device has a whole copy there); the tree holds its first `first`
        pages already. Returns the node that ends the span and the host pages the tree did not
        take (it had those pages cached already): the caller frees them."""
        ps = self.page_size
        span = tuple(tokens[: (first + len(host_pages)) * ps])
        node, _, offset, _ = self._walk(span, namespace, through_host=True)
        assert offset >= first * ps, "the span's first pages are not cached"
        cached = offset // ps - first
        if cached < len(host_pages):
            child = RadixNode(
                span[offset:],
                list(host_pages[cached:]),
                node,
                namespace,
                last_access=node.last_access,
                on_host=True,
            )
            node.children[span[offset : offset + ps]] = child
            self._count(child, +1)
            node = child
        self._own(node, owner)
        return node, list(host_pages[:cached])

    def detach_private(
        self, node: RadixNode, owner: str | None, max_pages: int
    ) -> tuple[RadixNode, list[int]]:
        """Take out of the tree the end of the path to `node` that only its one lock holder
        reads: nodes locked once, owned by `owner` alone (by no one, for None), with no other
        branch below them, whole nodes up to `max_pages` pages. Returns the node the path now
        ends at (still locked by the holder) and the device pages taken out, in path order; the
        holder owns them from now on."""
        taken: list[RadixNode] = []
        pages = 0
        while (
            node.parent is not None
            and pages + len(node.pages) <= max_pages
            and node.lock_ref == 1
            and node.owners == just(owner)
            and list(node.children.values()) == taken[-1:]
        ):
            taken.append(node)
            pages += len(node.pages)
            node = node.parent
        return node, self._take_out(node, taken[::-1])

    def take_host_path(
        self, tokens: Sequence[int], namespace: Hashable, owner: str | None
    ) -> tuple[RadixNode, list[int]]:
        """Take out of the tree the host nodes that end the cached path of `tokens` and return
        the device node above them with their host pages, in order, for the caller to own; only
        when those nodes are whole pages of `tokens`, owned by `owner` alone (by no one, for
        None), with nothing else below them. Otherwise take nothing (the pages are [])."""
        ps = self.page_size
        end, _, _, _ = self._walk(
            tuple(tokens[: len(tokens) - len(tokens) % ps]), namespace, through_host=True
        )
        chain: list[RadixNode] = []
        node = end
        while node.on_host:
            assert node.parent is not None
            chain.append(node)
            node = node.parent
        chain.reverse()
        if any(
            n.owners != just(owner) or list(n.children.values()) != chain[i + 1 : i + 2]
            for i, n in enumerate(chain)
        ):
            chain = []
        return node, self._take_out(node, chain)

    def _take_out(self, parent: RadixNode, path: list[RadixNode]) -> list[int]:
        """Remove `path` (a chain hanging from `parent`, with nothing else below it) from the
        tree; returns its pages, which the caller owns from now on."""
        if not path:
            return []
        del parent.children[path[0].key[: self.page_size]]
        if parent.parent is not None:
            self._candidates[parent] = None  # it may be evictable now
        for n in path:
            self._count(n, -1)
            self._candidates.pop(n, None)
        return [p for n in path for p in n.pages]
