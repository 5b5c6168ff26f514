"""KV page bookkeeping for requests: allocation with eviction, prefix reuse, release.

The scheduler owns page ownership; the worker owns the tensors. A request holds one
reference on each page in `req.pages`; the radix cache holds one on each page it stores.
A page returns to the free list when both have let go.
"""

from __future__ import annotations

import numpy as np

from scheduler_proc.page_allocator import PageAllocator
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.request import Req


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, disable_radix_cache: bool) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.radix = RadixCache(page_size, self.allocator, disabled=disable_radix_cache)

    @property
    def total_tokens(self) -> int:
        return self.allocator.total * self.page_size

    def used_tokens(self) -> int:
        return (self.allocator.total - self.allocator.available) * self.page_size

    def available_pages(self) -> int:
        """Pages a request could get now: free ones plus ones eviction could free."""
        return self.allocator.available + self.radix.evictable_pages()

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages, evicting cached prefixes if the free list is short; None if impossible."""
        if n == 0:
            return []
        short = n - self.allocator.available
        if short > 0:
            self.radix.evict(short)
        return self.allocator.alloc(n)

    def match_prefix(self, req: Req) -> None:
        """Takes the longest cached prefix of req.fill_ids (leaving at least one token to run,
        and no more than the request may reuse: `Req.reusable_prefix`)."""
        pages, matched = self.radix.match_prefix(req.fill_ids, req.cache_salt)
        max_match = (min(len(req.fill_ids) - 1, req.reusable_prefix()) // self.page_size) * self.page_size
        if matched > max_match:
            matched = max_match
            pages = pages[: matched // self.page_size]
        self.allocator.incref(pages)
        req.pages = list(pages)
        req.prefix_len = matched

    def grow(self, req: Req, kv_tokens: int) -> bool:
        """Makes req's pages cover kv_tokens; False (nothing changed) if pages are short."""
        need = pages_for(kv_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        new = self.alloc(need)
        if new is None:
            return False
        req.pages.extend(new)
        return True

    def grow_rows(self, reqs: list[Req], kv_tokens: np.ndarray) -> bool:
        """grow() for many requests with one allocation (the decode step's hot path: with
        page size 1 every row gains a page every step); False (nothing changed) if short."""
        held = np.fromiter((len(r.pages) for r in reqs), dtype=np.int64, count=len(reqs))
        need = -(-kv_tokens // self.page_size) - held
        rows = np.flatnonzero(need > 0)
        if not len(rows):
            return True
        counts = need[rows]
        new = self.alloc(int(counts.sum()))
        if new is None:
            return False
        if len(new) == len(rows):  # one page each: the decode step at page size 1
            for row, page in zip(rows.tolist(), new):
                reqs[row].pages.append(page)
            return True
        for row, end, n in zip(rows.tolist(), np.cumsum(counts).tolist(), counts.tolist()):
            reqs[row].pages.extend(new[end - n : end])
        return True

    def trim(self, req: Req, kv_tokens: int) -> None:
        """Drops pages past what kv_tokens needs (unaccepted speculative drafts)."""
        keep = pages_for(kv_tokens, self.page_size)
        if len(req.pages) > keep:
            self.allocator.decref(req.pages[keep:])
            del req.pages[keep:]
            req.pages_sent = min(req.pages_sent, keep)

    def cache_prefix(self, token_ids: np.ndarray, req: Req, kv_len: int) -> None:
        """Offers the request's written KV to the prefix cache, whole pages only."""
        full = min(kv_len, len(token_ids)) // self.page_size
        self.radix.insert(token_ids[: full * self.page_size], req.pages[:full], req.cache_salt)

    def release(self, req: Req, kv_len: int) -> None:
        """The request leaves the batch: cache what it computed, drop its references."""
        self.cache_prefix(req.all_token_ids(), req, kv_len)
        self.allocator.decref(req.pages)
        req.pages = []
        req.pages_sent = 0

    def flush(self) -> None:
        self.radix.reset()
