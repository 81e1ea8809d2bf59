from __future__ import annotations

import pytest

from workspace import PageAllocator, page_hash


def test_refcounts_and_free_list():
    alloc = PageAllocator(num_pages=3, page_size=4)
    a, b, c = alloc.allocate(), alloc.allocate(), alloc.allocate()
    assert sorted([a, b, c]) == [0, 1, 2] and alloc.num_free == 0
    with pytest.raises(MemoryError):
        alloc.allocate()
    alloc.incref(a)
    alloc.decref(a)
    assert alloc.refcount(a) == 1 and alloc.num_free == 0
    alloc.decref(a)
    assert alloc.num_free == 1 and alloc.allocate() == a
    alloc.decref(b)
    with pytest.raises(RuntimeError, match="free page"):
        alloc.decref(b)
    with pytest.raises(RuntimeError, match="free page"):
        alloc.incref(b)


def test_prefix_cache_survives_free_until_evicted_lru():
    alloc = PageAllocator(num_pages=3, page_size=2)
    k1, k2 = page_hash(b"", 0, [1, 2]), page_hash(b"", 0, [3, 4])
    p1, p2 = alloc.allocate(), alloc.allocate()
    alloc.register(p1, k1)
    alloc.register(p2, k2)
    alloc.decref(p1)
    alloc.decref(p2)
    assert alloc.num_free == 3 and alloc.num_cached == 2
    plain = alloc.allocate()  # the never-cached page goes first
    assert plain not in (p1, p2) and alloc.num_cached == 2
    assert alloc.lookup(k2) == p2 and alloc.refcount(p2) == 1  # revived from the free list
    evicted = alloc.allocate()  # only p1 is free: its cache entry goes
    assert evicted == p1 and alloc.lookup(k1) is None


def test_lookup_shares_a_page_in_use_and_clear_cache_forgets():
    alloc = PageAllocator(num_pages=2, page_size=2)
    key = page_hash(b"", 3, [9, 9])
    page = alloc.allocate()
    alloc.register(page, key)
    assert alloc.lookup(key) == page and alloc.refcount(page) == 2
    alloc.clear_cache()
    assert alloc.lookup(key) is None and alloc.refcount(page) == 2


def test_page_hash_depends_on_version_parent_and_tokens():
    base = page_hash(b"", 0, [1, 2, 3])
    assert base == page_hash(b"", 0, [1, 2, 3])
    assert base != page_hash(b"", 1, [1, 2, 3])
    assert base != page_hash(b"x", 0, [1, 2, 3])
    assert base != page_hash(b"", 0, [1, 2, 4])
