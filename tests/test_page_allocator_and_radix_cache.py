"""Tests for the scheduler's KV page allocator and page-granular radix cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_proc.page_allocator import PageAllocator
from scheduler_proc.radix_cache import RadixCache

# --------------------------------------------------------------------------- allocator


def test_alloc_never_hands_out_padding_page_and_respects_total() -> None:
    a = PageAllocator(9)
    assert a.total == 8 and a.available == 8
    pages = a.alloc(8)
    assert pages is not None and sorted(pages) == list(range(1, 9))
    assert a.available == 0
    assert all(a.refcount(p) == 1 for p in pages)


def test_alloc_returns_none_and_takes_nothing_when_short() -> None:
    a = PageAllocator(5)
    assert a.alloc(3) is not None
    assert a.alloc(2) is None
    assert a.available == 1
    assert a.alloc(1) is not None
    assert a.alloc(0) == []


def test_decref_frees_only_at_zero_and_pages_are_reused() -> None:
    a = PageAllocator(4)
    pages = a.alloc(2)
    assert pages is not None
    a.incref(pages[:1])
    assert a.refcount(pages[0]) == 2
    assert a.decref(pages) == 1  # pages[1] freed, pages[0] still held
    assert a.available == 2
    assert a.decref(pages[:1]) == 1
    assert a.available == 3
    again = a.alloc(3)
    assert again is not None and sorted(again) == [1, 2, 3]


def test_double_free_raises_and_changes_nothing() -> None:
    a = PageAllocator(6)
    pages = a.alloc(3)
    assert pages is not None
    a.decref([pages[2]])
    before = (a.available, [a.refcount(p) for p in range(1, 6)])
    with pytest.raises(ValueError, match="double free"):
        a.decref([pages[0], pages[1], pages[2]])
    assert (a.available, [a.refcount(p) for p in range(1, 6)]) == before
    with pytest.raises(ValueError):
        a.decref([pages[0], pages[0]])  # second listing would drop below zero
    assert a.refcount(pages[0]) == 1 and a.available == before[0]


def test_incref_of_free_or_invalid_page_raises_and_changes_nothing() -> None:
    a = PageAllocator(4)
    pages = a.alloc(1)
    assert pages is not None
    free_page = next(p for p in range(1, 4) if p not in pages)
    with pytest.raises(ValueError, match="free page"):
        a.incref([pages[0], free_page])
    assert a.refcount(pages[0]) == 1
    with pytest.raises(ValueError):
        a.incref([0])
    with pytest.raises(ValueError):
        a.decref([4])


# --------------------------------------------------------------------------- radix cache


def _cache(page_size: int, num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    a = PageAllocator(num_pages)
    return a, RadixCache(page_size, a)


def _request(a: PageAllocator, tokens: list[int], page_size: int) -> list[int]:
    pages = a.alloc(len(tokens) // page_size)
    assert pages is not None
    return pages


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_shared_prefix_is_matched_page_aligned(page_size: int) -> None:
    a, cache = _cache(page_size, num_pages=256)
    p = page_size
    first = list(range(100, 100 + 5 * p))
    pages = _request(a, first, p)
    assert cache.insert(first, pages) == 5 * p
    # A prompt sharing 3 pages and 1 token of the 4th matches exactly 3 pages (or 3p+1 at p=1).
    probe = first[: 3 * p + 1] + [7] * (2 * p)
    got_pages, n = cache.match_prefix(probe)
    expected = 3 * p + 1 if p == 1 else 3 * p
    assert n == expected and n % p == 0
    assert got_pages == pages[: n // p]
    # Numpy input works too; a partial second page does not count.
    short = np.array(first[: max(1, 2 * p - 1)], dtype=np.int64)
    assert cache.match_prefix(short)[1] == p
    assert cache.match_prefix([1, 2, 3]) == ([], 0)


def test_insert_of_present_prefix_keeps_caller_duplicates_and_adds_suffix() -> None:
    a, cache = _cache(4)
    base = list(range(8))
    base_pages = _request(a, base, 4)
    assert cache.insert(base, base_pages) == 8
    a.decref(base_pages)  # request done: only the tree holds them
    assert all(a.refcount(p) == 1 for p in base_pages)

    longer = base + list(range(50, 58))
    dup = _request(a, longer, 4)  # did not use the cache: 2 duplicate pages + 2 new
    assert cache.insert(longer, dup) == 8
    assert [a.refcount(p) for p in dup] == [1, 1, 2, 2]
    assert cache.match_prefix(longer) == (base_pages + dup[2:], 16)
    a.decref(dup)
    assert a.available == a.total - 4
    assert cache.cached_tokens() == 16


def test_insert_ignores_tokens_beyond_whole_pages() -> None:
    a, cache = _cache(4)
    tokens = list(range(11))  # 2 full pages + 3 tokens
    pages = _request(a, tokens, 4)
    assert len(pages) == 2
    assert cache.insert(tokens, pages) == 8
    assert cache.match_prefix(tokens)[1] == 8
    with pytest.raises(ValueError):
        cache.insert(tokens[:7], pages)


def test_split_edge_at_page_boundary_on_divergence() -> None:
    a, cache = _cache(2)
    x = [1, 2, 3, 4, 5, 6]
    y = [1, 2, 3, 4, 9, 9]
    px, py = _request(a, x, 2), _request(a, y, 2)
    cache.insert(x, px)
    assert len(cache) == 1
    assert cache.insert(y, py) == 2
    assert len(cache) == 3  # shared [1,2,3,4] node plus two leaves
    assert cache.match_prefix(y) == (px[:2] + py[2:], 6)
    assert cache.match_prefix(x) == (px, 6)
    # Divergence inside a page: [1,2,3,7] shares only the first page.
    assert cache.match_prefix([1, 2, 3, 7]) == (px[:1], 2)


def test_locked_pages_are_not_evicted_and_lru_leaf_goes_first() -> None:
    a, cache = _cache(1, num_pages=16)
    seqs = [[4, 5], [1, 2, 3], [1, 2, 7]]  # [4,5] is the oldest until it is matched
    for s in seqs:
        pages = _request(a, s, 1)
        cache.insert(s, pages)
        a.decref(pages)
    assert cache.evictable_pages() == a.total - a.available == 3 + 1 + 2
    # Lock [1,2,3] the way a request does, then touch [4,5] so [1,2,7] becomes the LRU leaf.
    lock, n = cache.match_prefix([1, 2, 3])
    assert n == 3
    a.incref(lock)
    cache.match_prefix([4, 5])
    assert cache.evictable_pages() == 1 + 2
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2, 7])[1] == 2
    assert cache.match_prefix([4, 5])[1] == 2
    assert cache.evict(100) == 2  # only [4,5] is left to free
    assert cache.match_prefix([1, 2, 3]) == (lock, 3)
    a.decref(lock)
    assert cache.evictable_pages() == 3
    assert cache.evict(100) == 3
    assert a.available == a.total and len(cache) == 0 and cache.cached_tokens() == 0


def test_evict_cascades_to_parent_once_children_are_gone() -> None:
    a, cache = _cache(4)
    s1 = list(range(16))
    s2 = list(range(8)) + [99] * 8
    for s in (s1, s2):
        pages = _request(a, s, 4)
        cache.insert(s, pages)
        a.decref(pages)
    held = a.total - a.available
    assert held == 6 and cache.evictable_pages() == 6
    assert cache.evict(6) == 6
    assert a.available == a.total and len(cache) == 0


def test_reset_releases_tree_refs_but_not_request_locks() -> None:
    a, cache = _cache(4)
    s = list(range(12))
    pages = _request(a, s, 4)
    cache.insert(s, pages)
    assert cache.reset() == 0  # the request still holds every page
    assert cache.match_prefix(s) == ([], 0) and cache.cached_tokens() == 0
    assert all(a.refcount(p) == 1 for p in pages)
    a.decref(pages)
    assert a.available == a.total


def test_a_salted_prefix_is_matched_only_under_its_own_salt_and_evicted_with_the_rest() -> None:
    a, cache = _cache(4)
    s = list(range(12))
    for salt in ("tenant-a", ""):
        pages = _request(a, s, 4)
        cache.insert(s, pages, salt)
        a.decref(pages)
    assert cache.match_prefix(s, "tenant-a")[1] == 12 and cache.match_prefix(s)[1] == 12
    assert cache.match_prefix(s, "tenant-b") == ([], 0)
    assert cache.match_prefix(s, "tenant-a")[0] != cache.match_prefix(s)[0]  # each tree its own pages
    assert cache.cached_tokens() == 24 and cache.evictable_pages() == 6
    cache.match_prefix(s)  # the unsalted copy is now the more recently used
    assert cache.evict(3) == 3
    assert cache.match_prefix(s, "tenant-a") == ([], 0) and cache.match_prefix(s)[1] == 12
    assert cache.reset() == 3 and a.available == a.total


def test_disabled_cache_matches_nothing_and_holds_nothing() -> None:
    a = PageAllocator(16)
    cache = RadixCache(4, a, disabled=True)
    s = list(range(8))
    pages = _request(a, s, 4)
    assert cache.insert(s, pages) == 0
    assert cache.match_prefix(s) == ([], 0)
    assert all(a.refcount(p) == 1 for p in pages)
    assert cache.evict(10) == 0 and cache.evictable_pages() == 0
    a.decref(pages)
    assert a.available == a.total


# --------------------------------------------------------------------------- property-based

_ALPHABET = st.integers(min_value=0, max_value=3)  # tiny alphabet: many shared prefixes
_SALTS = ["", "tenant-a", "tenant-b"]
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.tuples(st.lists(_ALPHABET, min_size=0, max_size=24), st.sampled_from(_SALTS))),
        st.tuples(st.just("finish"), st.integers(min_value=0, max_value=1000)),
        st.tuples(st.just("evict"), st.integers(min_value=0, max_value=20)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=40,
)


def _check_invariants(a: PageAllocator, cache: RadixCache, requests: list[list[int]]) -> None:
    rcs = [a.refcount(p) for p in range(1, a.num_pages)]
    assert all(r >= 0 for r in rcs)
    assert a.available + sum(1 for r in rcs if r > 0) == a.total
    # Every reference is accounted for: one per request holding the page, one if in the tree.
    expected = [0] * a.num_pages
    for pages in requests:
        for p in pages:
            expected[p] += 1
    stack = [child for root in cache._roots.values() for child in root.children.values()]
    tree_tokens = 0
    while stack:
        node = stack.pop()
        assert len(node.key) == len(node.pages) * cache.page_size > 0
        tree_tokens += len(node.key)
        for p in node.pages:
            expected[p] += 1
        stack.extend(node.children.values())
    assert expected[1:] == rcs
    assert tree_tokens == cache.cached_tokens()
    assert 0 <= cache.evictable_pages() <= a.total - a.available


def _run_ops(page_size: int, ops: list[tuple[str, object]]) -> None:
    """Simulate a scheduler: requests lock a matched prefix, alloc the rest, insert on finish."""
    a = PageAllocator(48)
    cache = RadixCache(page_size, a)
    running: list[tuple[list[int], list[int], str]] = []  # (tokens, page table, cache salt)
    for op, arg in ops:
        if op == "start":
            tokens, salt = list(arg[0]), arg[1]  # type: ignore[index]
            need_pages = -(-len(tokens) // page_size)
            prefix, n = cache.match_prefix(tokens, salt)
            assert n % page_size == 0 and len(prefix) * page_size == n <= len(tokens)
            a.incref(prefix)  # lock before anything can be evicted
            rest = need_pages - len(prefix)
            if a.available < rest:
                cache.evict(rest - a.available)
            new = a.alloc(rest)
            if new is None:
                a.decref(prefix)  # cannot admit: release the lock
            else:
                running.append((tokens, prefix + new, salt))
        elif op == "finish" and running:
            tokens, pages, salt = running.pop(int(arg) % len(running))  # type: ignore[call-overload]
            full = len(tokens) // page_size
            cache.insert(tokens, pages[:full], salt)
            a.decref(pages)
        elif op == "evict":
            before = a.available
            evictable = cache.evictable_pages()
            freed = cache.evict(int(arg))  # type: ignore[call-overload]
            assert a.available - before == freed
            assert freed >= min(int(arg), evictable)  # type: ignore[call-overload]
        elif op == "reset":
            cache.reset()
        _check_invariants(a, cache, [pages for _, pages, _ in running])
    for _, pages, _ in running:
        a.decref(pages)
    _check_invariants(a, cache, [])
    assert cache.evictable_pages() == a.total - a.available
    cache.evict(a.total)
    assert a.available == a.total and len(cache) == 0
    assert list(cache._roots) == [""]  # a salt's tree goes with its last node
    with pytest.raises(ValueError):
        a.decref([1])  # everything is free now: any decref is a double free


_FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(ops=_OPS)
def test_random_ops_never_leak_or_double_free_page_size_1(ops: list[tuple[str, object]]) -> None:
    _run_ops(1, ops)


@_FAST
@given(ops=_OPS)
def test_random_ops_never_leak_or_double_free_page_size_4(ops: list[tuple[str, object]]) -> None:
    _run_ops(4, ops)


@settings(max_examples=120, deadline=None)
@given(ops=_OPS)
def test_random_ops_never_leak_or_double_free_page_size_16(ops: list[tuple[str, object]]) -> None:
    _run_ops(16, ops)


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.sampled_from([1, 4]),
    seqs=st.lists(st.lists(_ALPHABET, max_size=20), max_size=8),
    probe=st.lists(_ALPHABET, max_size=24),
)
def test_match_equals_longest_page_aligned_common_prefix(
    page_size: int, seqs: list[list[int]], probe: list[int]
) -> None:
    a = PageAllocator(128)
    cache = RadixCache(page_size, a)
    for s in seqs:
        pages = a.alloc(len(s) // page_size)
        assert pages is not None
        cache.insert(s, pages)
        a.decref(pages)

    def common(x: list[int], y: list[int]) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    best = max([common(s[: len(s) // page_size * page_size], probe) for s in seqs], default=0)
    pages, n = cache.match_prefix(probe)
    assert n == best // page_size * page_size
    assert len(pages) == n // page_size and len(set(pages)) == len(pages)
    cache.reset()
    assert a.available == a.total
