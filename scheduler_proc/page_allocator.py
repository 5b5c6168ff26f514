"""Reference-counted KV page allocator.

Ownership: the scheduler owns *which* KV pages belong to whom; the GPU worker owns the
KV tensors themselves and only ever sees page ids that the scheduler sent it. This
class is the single source of truth for page ownership inside the scheduler process.

Pages are ints in ``1 .. num_pages - 1``. Page 0 is a reserved padding page (page tables
are padded with it) and is never handed out.

Every live page has a reference count >= 1. Holders are:

- a running request, for the pages in its page table (``alloc`` gives it one ref, and
  ``incref`` adds one for each cached prefix page it reuses: that is its "lock");
- the radix cache, which holds exactly one ref on every page stored in its tree.

A page returns to the free list when its count reaches 0. A decref of a free page or
an incref of a free page is a bookkeeping bug and raises ``ValueError`` (never silent);
the call that raises leaves all counts exactly as they were.
"""

from __future__ import annotations

from collections.abc import Iterable


class PageAllocator:
    """Free list plus per-page reference counts for ``num_pages`` KV pages.

    Hot-path costs: ``alloc(n)`` is O(n), ``incref``/``decref`` are O(len(pages));
    nothing is O(pool). Plain Python lists beat numpy here because every access is a
    scalar read or write.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages: int = num_pages
        self.total: int = num_pages - 1
        self._refcount: list[int] = [0] * num_pages
        # The free pages as one stack, alloc taking from its top: freed pages (`_free`, top
        # last) above the pages never handed out, `_fresh` .. num_pages - 1, which leave in
        # ascending order. A small model's pool has millions of pages; listing them all at
        # start would cost the scheduler more CPU than its imports, on every server start.
        self._free: list[int] = []
        self._fresh: int = 1

    @property
    def available(self) -> int:
        """Number of free pages."""
        return len(self._free) + self.num_pages - self._fresh

    def refcount(self, page: int) -> int:
        """Current reference count of ``page`` (0 means free)."""
        self._check_id(page)
        return self._refcount[page]

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free pages, each with refcount 1; ``None`` (taking nothing) if too few."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages: {n}")
        if n > self.available:
            return None
        if n == 0:
            return []
        free = self._free
        reused = min(n, len(free))
        pages = free[len(free) - reused :]
        del free[len(free) - reused :]
        pages.reverse()
        if reused < n:
            fresh = self._fresh
            self._fresh = fresh + n - reused
            pages.extend(range(fresh, self._fresh))
        rc = self._refcount
        for p in pages:
            rc[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gets two).

        Raises ``ValueError`` if any page is free or out of range; nothing changes then.
        """
        rc = self._refcount
        done: list[int] = []
        for p in pages:
            p = int(p)
            if not 0 < p < self.num_pages or rc[p] <= 0:
                for q in done:
                    rc[q] -= 1
                self._check_id(p)
                raise ValueError(f"incref of free page {p}")
            rc[p] += 1
            done.append(p)

    def decref(self, pages: Iterable[int]) -> int:
        """Drop one reference from each page; pages reaching 0 are freed.

        Returns how many pages were freed. Raises ``ValueError`` on a double free (decref
        of a page whose count is already 0) or an out-of-range id; nothing changes then.
        """
        rc = self._refcount
        free = self._free
        done: list[int] = []
        freed = 0
        for p in pages:
            p = int(p)
            if not 0 < p < self.num_pages or rc[p] <= 0:
                self._rollback_decref(done)
                self._check_id(p)
                raise ValueError(f"double free: decref of free page {p}")
            rc[p] -= 1
            if rc[p] == 0:
                free.append(p)
                freed += 1
            done.append(p)
        return freed

    def _rollback_decref(self, done: list[int]) -> None:
        # Undo in reverse order: a page freed by this call is the last one on the stack.
        rc = self._refcount
        for p in reversed(done):
            if rc[p] == 0:
                popped = self._free.pop()
                assert popped == p
            rc[p] += 1

    def _check_id(self, page: int) -> None:
        if not 0 < page < self.num_pages:
            raise ValueError(f"page id {page} out of range 1..{self.num_pages - 1}")

    def __repr__(self) -> str:
        return f"PageAllocator(total={self.total}, available={self.available})"
