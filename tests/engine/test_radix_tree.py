"""Radix tree and page allocator: invariants hold after every operation (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from venusrl.engine.kv_cache import OutOfPages, PageAllocator
from venusrl.engine.radix_tree import PrefixMatch, RadixNode, RadixTree

PAGE = 2
# Tiny alphabet and lengths so that sequences share prefixes often.
sequences = st.lists(st.integers(0, 2), min_size=0, max_size=12)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), sequences, st.sampled_from([None, "v1"])),
        st.tuples(st.just("lock"), sequences, st.sampled_from([None, "v1"])),
        st.tuples(st.just("unlock"), st.integers(0, 50), st.none()),
        st.tuples(st.just("evict"), st.integers(0, 8), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_tree_and_allocator_invariants_hold_after_every_operation(ops: list) -> None:
    alloc = PageAllocator(64, reserved=1)
    tree = RadixTree(PAGE)
    locks: list[RadixNode] = []
    for op, arg, namespace in ops:
        if op == "insert":
            n = len(arg) // PAGE
            if n > alloc.num_free:
                continue
            own = alloc.allocate(n)
            kept = tree.insert(arg, own, namespace).pages
            alloc.free([p for p, k in zip(own, kept, strict=True) if p != k])
            assert tree.cached_pages(arg, namespace) == len(kept)
            assert tree.match(arg, namespace).pages == kept
        elif op == "lock":
            m = tree.match(arg, namespace)
            tree.lock(m.node)
            locks.append(m.node)
        elif op == "unlock" and locks:
            tree.unlock(locks.pop(arg % len(locks)))
        elif op == "evict":
            alloc.free(tree.evict(arg))
        tree.check()
        alloc.check()
        # Every page is either free or in the tree, never both.
        cached = tree.all_pages()
        assert len(cached) + alloc.num_free == alloc.capacity
    for node in locks:
        tree.unlock(node)
    alloc.free(tree.evict(tree.evictable_pages))
    tree.check()
    assert alloc.num_free == alloc.capacity and tree.all_pages() == []


def test_match_is_page_granular_and_splits_nodes() -> None:
    tree = RadixTree(page_size=4)
    tree.insert(list(range(12)), [1, 2, 3])
    probe = [0, 1, 2, 3, 4, 5, 6, 7, 99, 9, 10, 11]
    assert tree.cached_pages(probe) == 2
    assert len(tree.nodes()) == 1  # counting is read-only: no split yet
    m: PrefixMatch = tree.match(probe)
    assert m.pages == [1, 2] and len(tree.nodes()) == 2
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
