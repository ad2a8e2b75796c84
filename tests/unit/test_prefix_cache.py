"""The prefix cache's page bookkeeping on its own (no model): keys, references, LRU eviction,
flush, and the invariant that every page is free, referenced or cached, never two of them."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.allocator import PageAllocator
from pdserve.engine.prefix_cache import PrefixCache, chain_hashes


def make(num_pages: int = 8, enabled: bool = True) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), page_size=4, enabled=enabled)


def check_invariant(c: PrefixCache) -> None:
    n = c.allocator.num_pages
    refs = [c.refcount(p) for p in range(n)]
    assert min(refs) >= 0
    referenced = sum(1 for r in refs if r > 0)
    assert c.allocator.free_count + c.cached_pages + referenced == n


def test_chain_hashes_stand_for_the_whole_prefix():
    a = chain_hashes(list(range(12)), 4, [])
    assert len(a) == 3 and len(set(a)) == 3
    assert chain_hashes(list(range(13)), 4, []) == a  # a partial page has no key
    assert chain_hashes(list(range(12)), 4, a[:1]) == a  # extends what it is given
    # the same page after a different prefix gets another key
    b = chain_hashes([99] + list(range(1, 12)), 4, [])
    assert b[0] != a[0] and b[1] != a[1] and b[2] != a[2]
    assert chain_hashes(list(range(12)), 4, []) == a  # deterministic (not Python's hash())


def test_released_keyed_pages_are_cached_and_matched_again():
    c = make()
    pages = c.alloc(3)
    keys = chain_hashes(list(range(12)), 4, [])
    for p, k in zip(pages, keys):
        c.insert(p, k)
    c.release(pages)
    assert c.cached_pages == 3 and c.allocator.free_count == 5 and c.available == 8
    got = c.match(keys[:2] + [b"missing"])
    assert got == pages[:2] and [c.refcount(p) for p in got] == [1, 1]
    assert c.cached_pages == 1
    check_invariant(c)
    c.release(got)
    assert c.cached_pages == 3
    check_invariant(c)


def test_unkeyed_pages_go_straight_back_to_the_free_list():
    c = make()
    pages = c.alloc(2)
    c.insert(pages[0], b"k0")
    c.release(pages)
    assert c.cached_pages == 1 and c.allocator.free_count == 7


def test_match_stops_at_the_first_missing_key():
    c = make()
    pages = c.alloc(3)
    keys = [b"a", b"b", b"c"]
    c.insert(pages[0], keys[0])
    c.insert(pages[2], keys[2])
    assert c.match(keys) == [pages[0]]


def test_eviction_takes_the_oldest_and_deepest_pages_first():
    c = make(num_pages=6)
    first = c.alloc(3)
    second = c.alloc(3)
    for i, p in enumerate(first + second):
        c.insert(p, bytes([i]))
    c.release(first)  # older: evicted first, its last page before its first
    c.release(second)
    assert c.available == 6 and c.allocator.free_count == 0
    got = c.alloc(2)
    assert sorted(got) == sorted(first[1:])
    assert c.counters().evicted_pages == 2
    assert c.match([bytes([0])]) == [first[0]]  # the root of the oldest chain survived
    assert c.match([bytes([1])]) == []  # evicted: its key is gone
    check_invariant(c)


def test_alloc_is_all_or_nothing_and_never_evicts_referenced_pages():
    c = make(num_pages=4)
    held = c.alloc(2)
    c.insert(held[0], b"x")
    cached = c.alloc(1)
    c.insert(cached[0], b"y")
    c.release(cached)
    assert c.alloc(3) is None  # 1 free + 1 cached available
    assert c.cached_pages == 1 and c.counters().evicted_pages == 0
    assert len(c.alloc(2)) == 2
    assert c.refcount(held[0]) == 1 and c.match([b"x"]) == [held[0]]


def test_shared_page_is_freed_only_by_its_last_holder():
    c = make()
    p = c.alloc(1)
    c.insert(p[0], b"k")
    again = c.match([b"k"])
    assert again == p and c.refcount(p[0]) == 2
    c.release(p)
    assert c.refcount(p[0]) == 1 and c.cached_pages == 0
    c.release(again)
    assert c.cached_pages == 1


def test_release_below_zero_raises():
    c = make()
    p = c.alloc(1)
    c.release(p)
    with pytest.raises(RuntimeError, match="released more often"):
        c.release(p)


def test_a_key_keeps_its_first_page_and_a_page_its_first_key():
    c = make()
    a, b = c.alloc(2)
    c.insert(a, b"k")
    c.insert(b, b"k")  # duplicate content computed twice: b stays private
    c.insert(a, b"other")  # a page never takes a second key
    assert c.match([b"k"]) == [a] and c.match([b"other"]) == []
    c.release([a, b, a])
    assert c.cached_pages == 1 and c.allocator.free_count == 7


def test_flush_frees_cached_pages_and_detaches_referenced_ones():
    c = make()
    live = c.alloc(2)
    idle = c.alloc(2)
    for i, p in enumerate(live + idle):
        c.insert(p, bytes([i]))
    c.release(idle)
    assert c.flush() == 2
    assert c.cached_pages == 0 and c.allocator.free_count == 6
    assert c.match([bytes([0])]) == []  # nothing is found after a flush
    c.release(live)  # detached pages are freed, not cached
    assert c.cached_pages == 0 and c.allocator.free_count == 8
    check_invariant(c)


def test_disabled_cache_counts_references_but_never_matches():
    c = make(enabled=False)
    p = c.alloc(1)
    c.insert(p[0], b"k")
    assert c.match([b"k"]) == []
    c.release(p)
    assert c.cached_pages == 0 and c.allocator.free_count == 8


def test_random_operations_keep_the_invariant():
    rng = random.Random(7)
    c = make(num_pages=16)
    holders: list[list[int]] = []
    keys = [bytes([i]) for i in range(24)]
    for _ in range(2000):
        op = rng.random()
        if op < 0.35:
            got = c.alloc(rng.randint(1, 4))
            if got is not None:
                for p in got:
                    if rng.random() < 0.7:
                        c.insert(p, rng.choice(keys))
                holders.append(got)
        elif op < 0.6:
            start = rng.randint(0, 20)
            got = c.match(keys[start:start + rng.randint(1, 4)])
            if got:
                holders.append(got)
        elif op < 0.95 and holders:
            c.release(holders.pop(rng.randrange(len(holders))))
        elif op >= 0.95:
            c.flush()
        check_invariant(c)
    for h in holders:
        c.release(h)
    assert c.allocator.free_count + c.cached_pages == 16
    assert all(c.refcount(p) == 0 for p in range(16))
