"""Radix tree and page allocator: invariants hold after every operation (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from venusrl.engine.kv_cache import OutOfPages, PageAllocator
from venusrl.engine.radix_lending import LendingRadixTree
from venusrl.engine.radix_tree import PrefixMatch, RadixNode, RadixTree

PAGE = 2
# Tiny alphabet and lengths so that sequences share prefixes often.
sequences = st.lists(st.integers(0, 2), min_size=0, max_size=12)
namespaces = st.sampled_from([None, "v1"])
owners = st.sampled_from([None, "t0", "t1", "t2"])
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), sequences, namespaces, owners),
        st.tuples(st.just("match"), sequences, namespaces, st.none()),
        st.tuples(st.just("lock"), sequences, namespaces, st.none()),
        st.tuples(st.just("unlock"), st.integers(0, 50), st.none(), st.none()),
        st.tuples(st.just("evict"), st.integers(0, 8), st.none(), st.none()),
        st.tuples(st.just("pin"), st.sampled_from(["t0", "t1", "t2"]), st.none(), st.none()),
        st.tuples(st.just("end"), st.sampled_from(["t0", "t1", "t2"]), st.none(), st.none()),
        st.tuples(st.just("flush"), st.none(), st.none(), st.none()),
        # a lock holder takes the private end of its path, then gives it back as host pages
        st.tuples(st.just("detach"), st.integers(0, 50), st.none(), owners),
        st.tuples(st.just("rehost"), st.integers(0, 50), st.none(), st.none()),
    ),
    max_size=40,
)


class Tiers:
    """The tree's host tier without KV data: two allocators, so leaks and double frees show."""

    def __init__(self, device: PageAllocator, host_pages: int) -> None:
        self.device = device
        self.host = PageAllocator(host_pages)

    def host_free(self) -> int:
        return self.host.num_free

    def to_host(self, device_pages: list[int]) -> list[int]:
        return self.host.allocate(len(device_pages))

    def to_device(self, host_pages: list[int]) -> list[int] | None:
        if len(host_pages) > self.device.num_free:
            return None
        return self.device.allocate(len(host_pages))

    def free_host(self, host_pages: list[int]) -> None:
        self.host.free(host_pages)


def retention_tree(alloc: PageAllocator, host_pages: int, pinned: set[str]) -> LendingRadixTree:
    """A tree ranked as the engine ranks it: nodes of pinned owners last, offloaded when owned."""
    return LendingRadixTree(
        PAGE,
        eviction_key=lambda n: (bool(n.owners & pinned), n.last_access),
        offload_if=lambda n: bool(n.owners),
        tiers=Tiers(alloc, host_pages),
    )


def path_tokens(node: RadixNode) -> tuple[int, ...]:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


def evictable(node: RadixNode) -> bool:
    """What eviction may take, read off the whole tree: an unlocked device node with no child
    on device."""
    return (
        not node.on_host and node.lock_ref == 0 and all(c.on_host for c in node.children.values())
    )


@settings(max_examples=300, deadline=None)
@given(operations, st.integers(0, 12))
def test_tree_and_allocators_invariants_hold_after_every_operation(
    ops: list, host_pages: int
) -> None:
    alloc = PageAllocator(24, reserved=1)
    pinned: set[str] = set()
    tree = retention_tree(alloc, host_pages, pinned)
    tiers = tree.tiers
    assert isinstance(tiers, Tiers)
    locks: list[RadixNode] = []
    ends: dict[str, RadixNode] = {}
    # (path tokens, node the holder still locks, pages it took out, owner)
    held: list[tuple[tuple[int, ...], RadixNode, list[int], str | None]] = []
    for op, arg, namespace, owner in ops:
        if op == "insert":
            n = len(arg) // PAGE
            if n > alloc.num_free:
                continue
            own = alloc.allocate(n)
            m = tree.insert(arg, own, namespace, owner)
            alloc.free([p for p, k in zip(own, m.pages, strict=True) if p != k])
            assert tree.cached(arg, namespace)[:2] == (len(m.pages), 0)
            assert tree.match(arg, namespace).pages == m.pages
            if owner is not None:
                ends[owner] = m.node
        elif op == "match":
            before = tree.cached(arg, namespace)
            m = tree.match(arg, namespace)
            assert before.device_pages + m.loaded_pages == len(m.pages)
            assert len(m.pages) <= sum(before)
        elif op == "lock":
            m = tree.match(arg, namespace)
            tree.lock(m.node)
            locks.append(m.node)
        elif op == "unlock" and locks:
            tree.unlock(locks.pop(arg % len(locks)))
        elif op == "evict":
            freed = tree.evict(arg)
            alloc.free(freed)
            if len(freed) < arg:  # short: nothing evictable may be left anywhere in the tree
                assert not [n for n in tree.nodes() if evictable(n)]
        elif op == "pin":
            pinned.add(arg)
        elif op == "end" and arg in ends:
            tree.disown(ends.pop(arg), arg)
            pinned.discard(arg)
        elif op == "flush":
            alloc.free(tree.flush())
        elif op == "detach" and locks:
            node = locks.pop(arg % len(locks))
            tokens = path_tokens(node)
            end, pages = tree.detach_private(node, owner, arg % 7)
            assert path_tokens(end) == tokens[: len(tokens) - len(pages) * PAGE]
            held.append((tokens, end, pages, owner))
        elif op == "rehost" and held:
            tokens, end, pages, owner = held.pop(arg % len(held))
            host = tiers.host.allocate(min(len(pages), tiers.host.num_free))
            first = len(path_tokens(end)) // PAGE
            _, duplicates = tree.insert_host(tokens, host, first, end.namespace, owner)
            tiers.host.free(duplicates)
            alloc.free(pages)
            tree.unlock(end)
            assert sum(tree.cached(tokens, end.namespace)[:2]) >= first + len(host)
        tree.check()
        alloc.check()
        tiers.host.check()
        # Every page of either tier is free or in the tree, never both.
        private = sum(len(pages) for _, _, pages, _ in held)
        assert len(tree.all_pages()) + alloc.num_free + private == alloc.capacity
        assert len(tree.all_host_pages()) + tiers.host.num_free == tiers.host.capacity
    for node in locks:
        tree.unlock(node)
    for _, end, pages, _ in held:
        alloc.free(pages)
        tree.unlock(end)
    alloc.free(tree.flush())
    tree.check()
    assert alloc.num_free == alloc.capacity and tree.all_pages() == []
    assert tiers.host.num_free == tiers.host.capacity


def test_owned_kv_is_offloaded_and_a_match_loads_it_back() -> None:
    alloc = PageAllocator(16, reserved=1)
    tree = retention_tree(alloc, host_pages=8, pinned=set())
    own = alloc.allocate(3)
    tree.insert([1, 2, 3, 4, 5, 6], own, owner="t0")
    tree.insert([7, 8], alloc.allocate(1))  # nobody owns it: dropped
    alloc.free(tree.evict(16))
    assert alloc.num_free == alloc.capacity and tree.host_pages == 3
    assert tree.cached([1, 2, 3, 4, 5, 6, 9])[:2] == (0, 3)
    assert tree.cached([7, 8])[:2] == (0, 0)
    m = tree.match([1, 2, 3, 4, 5, 6, 9])
    assert len(m.pages) == 3 and m.loaded_pages == 3 and tree.host_pages == 0
    tree.check()


def test_a_full_host_tier_drops_colder_nodes_to_take_a_warmer_one() -> None:
    alloc = PageAllocator(16, reserved=1)
    pinned = {"hot"}
    tree = retention_tree(alloc, host_pages=2, pinned=pinned)
    tree.insert([1, 2, 3, 4], alloc.allocate(2), owner="cold")
    alloc.free(tree.evict(2))  # offloaded: the host tier is full now
    tree.insert([5, 6, 7, 8], alloc.allocate(2), owner="hot")
    alloc.free(tree.evict(2))  # hot outranks cold: cold is dropped from host to make room
    assert tree.cached([5, 6, 7, 8, 0])[:2] == (0, 2)
    assert tree.cached([1, 2, 3, 4, 0])[:2] == (0, 0)
    tree.insert([1, 2, 3, 4], alloc.allocate(2), owner="cold")
    alloc.free(tree.evict(2))  # colder than what the host holds: dropped
    assert tree.cached([1, 2, 3, 4, 0])[:2] == (0, 0)
    tree.check()


def test_match_is_page_granular_and_splits_nodes() -> None:
    tree = RadixTree(page_size=4)
    tree.insert(list(range(12)), [1, 2, 3])
    probe = [0, 1, 2, 3, 4, 5, 6, 7, 99, 9, 10, 11]
    assert tree.cached(probe) == (2, 0, 2)  # two pages on device, both evictable
    assert len(tree.nodes()) == 1  # counting is read-only: no split yet
    m: PrefixMatch = tree.match(probe)
    assert m.pages == [1, 2] and len(tree.nodes()) == 2
    tree.lock(m.node)  # a request reads them: no longer evictable
    assert tree.cached(probe) == (2, 0, 0)
    tree.unlock(m.node)
    assert tree.match([0, 1, 2]).pages == []  # less than a page never matches
    tree.check()


def test_namespaces_never_share_prefixes() -> None:
    tree = RadixTree(page_size=2)
    tree.insert([1, 2, 3, 4], [5, 6], namespace=0)
    assert tree.match([1, 2, 3, 4], namespace=1).pages == []
    assert tree.match([1, 2, 3, 4], namespace=0).pages == [5, 6]


def test_locked_prefix_is_never_evicted() -> None:
    tree = RadixTree(page_size=2)
    tree.insert([1, 2, 3, 4], [5, 6])
    tree.insert([1, 2, 7, 8], [5, 9])
    m = tree.match([1, 2, 3, 4])
    tree.lock(m.node)
    assert sorted(tree.evict(10)) == [9]
    assert tree.match([1, 2, 3, 4]).pages == [5, 6]
    tree.unlock(m.node)
    assert sorted(tree.evict(10)) == [5, 6]
    tree.check()


def test_lru_evicts_the_least_recently_used_leaf_first() -> None:
    tree = RadixTree(page_size=1)
    tree.insert([1], [10])
    tree.insert([2], [20])
    tree.match([1])  # touch 1
    assert tree.evict(1) == [20]


def test_a_path_read_to_its_end_counts_as_just_used() -> None:
    # A request that decoded after its last whole page was cached used that KV until it ended.
    tree = RadixTree(page_size=1)
    first = tree.insert([1], [10]).node
    tree.insert([2], [20])
    tree.touch(first)
    assert tree.evict(1) == [20]


def test_allocator_refuses_double_free_and_overdraw() -> None:
    alloc = PageAllocator(4, reserved=1)
    pages = alloc.allocate(3)
    assert pages == [1, 2, 3]
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.free([2])
    with pytest.raises(ValueError, match="twice"):
        alloc.free([2])
    alloc.check()


def test_only_the_private_end_of_a_path_is_taken_out() -> None:
    alloc = PageAllocator(16, reserved=1)
    tree = LendingRadixTree(PAGE)
    prompt, mine, theirs = [1] * PAGE, [2] * (2 * PAGE), [3] * PAGE
    for tokens, owner in ((prompt + mine, "t0"), (prompt + theirs, "t1")):
        own = alloc.allocate(len(tokens) // PAGE)
        m = tree.insert(tokens, own, owner=owner)
        alloc.free([p for p, k in zip(own, m.pages, strict=True) if p != k])
    m = tree.match(prompt + mine)
    tree.lock(m.node)
    assert tree.detach_private(m.node, "t0", 1)[1] == []  # its private end is two pages
    end, pages = tree.detach_private(m.node, "t0", 8)
    assert pages == m.pages[1:]  # the prompt has another branch below it: it stays
    assert end.key == tuple(prompt) and end.lock_ref == 1
    assert tree.cached(prompt + mine)[:2] == (1, 0)
    tree.check()
    host, dup = tree.insert_host(prompt + mine, [7, 8], 1, owner="t0")
    assert dup == [] and host.on_host and tree.cached(prompt + mine)[:2] == (1, 2)
    tree.unlock(end)
    tree.check()
