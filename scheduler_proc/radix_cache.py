"""Page-granular radix (prefix) cache over token ids.

Ownership: the tree owns exactly ONE reference (taken with ``PageAllocator.incref``) on
every page stored in it; the allocator owns the counts; the GPU worker owns the KV
tensors. A request that reuses cached pages increfs them itself (its "lock") and
decrefs them when it finishes. ``match_prefix`` therefore never increfs.

Only whole pages are cached and matched: with page size P, every edge key has a length
that is a multiple of P, and every match length is a multiple of P.

Layout of one node (P = 4, the edge from its parent holds 3 pages)::

    parent ──► node
               key   : | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 ta tb |   len(key) == P * len(pages)
               pages : |     17      |     42      |      9      |   one page per P tokens
               children: { key[:P] of each child as bytes ──► child }
               last_access: logical clock of the last match/insert that touched it

A node is evictable when it has no children and every one of its pages has refcount 1
(only the tree holds it). Evicting it decrefs its pages, which frees all of them; its
parent may then become an evictable leaf in turn.

Cache salts (vLLM's `cache_salt`): each salt has a tree of its own, a root beside the
unsalted one, so a request matches only what requests of its salt cached (a tenant cannot
time another's prompts). Eviction is one LRU over every tree; a salt's root goes when its
last node does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from scheduler_proc.page_allocator import PageAllocator

TokenIds = Sequence[int] | np.ndarray


class _Node:
    """One edge of the tree plus the node it leads to. A root (one per cache salt) has an
    empty key and no parent."""

    __slots__ = ("children", "key", "last_access", "pages", "parent", "uid")

    def __init__(self, key: np.ndarray, pages: list[int], parent: _Node | None, uid: int) -> None:
        self.key: np.ndarray = key
        self.pages: list[int] = pages
        self.children: dict[bytes, _Node] = {}
        self.parent: _Node | None = parent
        self.last_access: int = 0
        self.uid: int = uid  # tie-breaker for the eviction heap


class RadixCache:
    """Prefix cache mapping token-id prefixes to the KV pages that hold them."""

    def __init__(self, page_size: int, allocator: PageAllocator, disabled: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size: int = page_size
        self.allocator: PageAllocator = allocator
        self.disabled: bool = disabled
        self._clock: int = 0
        self._next_uid: int = 0
        self._roots: dict[str, _Node] = {"": self._new_root()}
        """The root of each cache salt's tree ("": requests without one)."""
        self._salt_of: dict[_Node, str] = {}
        """A salted tree's root -> its salt (to drop the root with its last node)."""
        self._leaves: set[_Node] = set()  # nodes without children, root excluded
        self._num_nodes: int = 0
        self._cached_tokens: int = 0

    # ------------------------------------------------------------------ queries

    def match_prefix(self, token_ids: TokenIds, salt: str = "") -> tuple[list[int], int]:
        """Longest page-aligned prefix of ``token_ids`` cached under ``salt``: (page ids, token count).

        Touches the LRU clock of every node on the matched path. Does NOT incref: a
        caller that keeps the pages increfs them before anything can be evicted.
        """
        root = self._roots.get(salt)
        if self.disabled or root is None:
            return [], 0
        tokens = _as_tokens(token_ids)
        p = self.page_size
        end = len(tokens) // p * p
        self._clock += 1
        node, pos, pages = root, 0, []
        while pos < end:
            child = node.children.get(tokens[pos : pos + p].tobytes())
            if child is None:
                break
            n = self._common_len(child.key, tokens[pos:end])
            child.last_access = self._clock
            pages.extend(child.pages[: n // p])
            pos += n
            if n < len(child.key):
                break
            node = child
        return pages, pos

    def cached_tokens(self) -> int:
        """Number of tokens stored in the tree (a multiple of the page size)."""
        return self._cached_tokens

    def evictable_pages(self) -> int:
        """Pages that ``evict`` could free right now, counting cascades up the tree.

        A subtree is freeable when every page in it has refcount 1. Cost is O(nodes + pages).
        """
        if self.disabled:
            return 0
        rc = self.allocator.refcount
        # Iterative post-order: children are finished before their parent.
        order: list[_Node] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        freeable: dict[_Node, bool] = {}
        total = 0
        for node in reversed(order):
            ok = all(freeable[c] for c in node.children.values()) and all(rc(pg) == 1 for pg in node.pages)
            freeable[node] = ok
            if ok:
                total += len(node.pages)
        return total

    def __len__(self) -> int:
        """Number of nodes in the tree, root excluded."""
        return self._num_nodes

    # ---------------------------------------------------------------- mutations

    def insert(self, token_ids: TokenIds, page_ids: Sequence[int] | np.ndarray, salt: str = "") -> int:
        """Cache the first ``len(page_ids) * page_size`` tokens under ``salt``, backed by ``page_ids``.

        Where the prefix is already cached nothing changes: the caller keeps (and later
        decrefs) its own duplicate pages. For the new suffix the tree increfs the given
        pages, taking its one reference. Returns the number of newly cached tokens.
        """
        if self.disabled:
            return 0
        p = self.page_size
        end = len(page_ids) * p
        tokens = _as_tokens(token_ids)
        if len(tokens) < end:
            raise ValueError(f"{len(page_ids)} pages need {end} tokens, got {len(tokens)}")
        tokens = tokens[:end]
        self._clock += 1
        if end == 0:
            return 0
        if salt not in self._roots:
            self._roots[salt] = root = self._new_root()
            self._salt_of[root] = salt
        node, pos = self._roots[salt], 0
        while pos < end:
            child = node.children.get(tokens[pos : pos + p].tobytes())
            if child is None:
                new_pages = [int(pg) for pg in page_ids[pos // p :]]
                self.allocator.incref(new_pages)
                self._attach(node, tokens[pos:].copy(), new_pages)
                return end - pos
            n = self._common_len(child.key, tokens[pos:])
            child.last_access = self._clock
            if n < len(child.key):
                if pos + n == end:
                    return 0  # the rest lies inside this edge: already cached
                child = self._split(child, n)
            pos += n
            node = child
        return 0

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if possible, least recently used leaves first.

        Returns the number of pages actually freed (whose refcount reached 0).
        """
        if self.disabled or num_pages <= 0:
            return 0
        heap = [(n.last_access, n.uid, n) for n in self._leaves if self._unshared(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            freed += self.allocator.decref(node.pages)
            parent = self._detach(node)
            if parent.parent is not None and not parent.children and self._unshared(parent):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def reset(self) -> int:
        """Drop the whole tree, releasing the tree's reference on every page.

        Pages still locked by a request stay allocated until that request decrefs them.
        Returns the number of pages freed now.
        """
        freed = 0
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            freed += self.allocator.decref(node.pages)
            stack.extend(node.children.values())
        self._roots = {"": self._roots[""]}
        self._roots[""].children.clear()
        self._salt_of.clear()
        self._leaves.clear()
        self._num_nodes = 0
        self._cached_tokens = 0
        return freed

    # ------------------------------------------------------------------ helpers

    def _new_root(self) -> _Node:
        return self._new_node(np.empty(0, dtype=np.int32), [], None)

    def _new_node(self, key: np.ndarray, pages: list[int], parent: _Node | None) -> _Node:
        self._next_uid += 1
        return _Node(key, pages, parent, self._next_uid)

    def _attach(self, parent: _Node, key: np.ndarray, pages: list[int]) -> _Node:
        node = self._new_node(key, pages, parent)
        node.last_access = self._clock
        parent.children[key[: self.page_size].tobytes()] = node
        self._leaves.discard(parent)
        self._leaves.add(node)
        self._num_nodes += 1
        self._cached_tokens += len(key)
        return node

    def _detach(self, node: _Node) -> _Node:
        """Remove a leaf from the tree (its pages already decref'd); return its parent."""
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key[: self.page_size].tobytes()]
        self._leaves.discard(node)
        if parent.parent is not None and not parent.children:
            self._leaves.add(parent)
        elif not parent.children and parent in self._salt_of:
            del self._roots[self._salt_of.pop(parent)]
        self._num_nodes -= 1
        self._cached_tokens -= len(node.key)
        return parent

    def _split(self, child: _Node, n: int) -> _Node:
        """Split ``child`` after ``n`` tokens (a page multiple); return the new upper half."""
        p = self.page_size
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key) and n % p == 0
        upper = self._new_node(child.key[:n].copy(), child.pages[: n // p], parent)
        upper.last_access = child.last_access
        parent.children[upper.key[:p].tobytes()] = upper
        child.key = child.key[n:].copy()
        child.pages = child.pages[n // p :]
        child.parent = upper
        upper.children[child.key[:p].tobytes()] = child
        self._num_nodes += 1
        return upper

    def _common_len(self, key: np.ndarray, tokens: np.ndarray) -> int:
        """Length of the common prefix of ``key`` and ``tokens``, rounded down to pages."""
        m = min(len(key), len(tokens))
        diff = np.flatnonzero(key[:m] != tokens[:m])
        n = int(diff[0]) if len(diff) else m
        return n // self.page_size * self.page_size

    def _unshared(self, node: _Node) -> bool:
        rc = self.allocator.refcount
        return all(rc(pg) == 1 for pg in node.pages)


def _as_tokens(token_ids: TokenIds) -> np.ndarray:
    return np.ascontiguousarray(token_ids, dtype=np.int32)
