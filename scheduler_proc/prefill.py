"""Admission and chunking: which prompt tokens run this step.

Per step at most `max_prefill_tokens` prompt tokens run, and one request contributes at
most `chunked_prefill_size` of them, so a long prompt is spread over several steps while
the running decodes keep going. A request whose prefill is unfinished keeps its place
in the batch and is served before new ones are admitted.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from scheduler_proc.kv_cache import KVCacheManager, pages_for
from scheduler_proc.request import Req
from scheduler_proc.schedule_batch import ScheduleBatch


class WaitingQueue:
    """Requests not yet in the batch, in the order the policy serves them."""

    def __init__(self, policy: str, kv: KVCacheManager | None = None) -> None:
        self.policy = policy
        self.kv = kv
        """The current worker group's KV manager (replaced when the workers restart)."""
        self.queue: deque[Req] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, req: Req) -> None:
        self.queue.append(req)

    def push_front(self, req: Req) -> None:
        self.queue.appendleft(req)

    def remove(self, rid: str) -> Req | None:
        for req in self.queue:
            if req.rid == rid:
                self.queue.remove(req)
                return req
        return None

    def ordered(self) -> list[Req]:
        if self.policy == "lpm" and len(self.queue) > 1:
            # Longest cached prefix first; the stable sort keeps arrival order among equals.
            return sorted(self.queue, key=lambda r: -self.kv.radix.match_prefix(r.fill_ids, r.cache_salt)[1])
        if self.policy == "priority":
            return sorted(self.queue, key=lambda r: r.priority)  # stable: arrival order among equals
        return list(self.queue)


class PrefillPlanner:
    def __init__(
        self, kv: KVCacheManager, max_prefill_tokens: int, chunk_size: int, max_running: int, pooling: str = "last"
    ) -> None:
        self.kv = kv
        self.pooling = pooling
        """`--pooling`: with mean, an embedding request's every token must run."""
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.free_slots = list(range(max_running - 1, -1, -1))

    def plan(self, batch: ScheduleBatch, waiting: WaitingQueue, decoding: np.ndarray) -> None:
        """Adds this step's prompt chunks to the batch (continuing ones, then new requests).
        `decoding` marks the batch's decoding rows (the rest are still prefilling)."""
        budget = self.max_prefill_tokens
        chunks: list[tuple[int, int]] = []
        for i in np.flatnonzero(~decoding).tolist():
            req = batch.reqs[i]
            if req.finished or budget <= 0:
                continue
            start = batch.seq_len(i)
            n = min(len(req.fill_ids) - start, self.chunk_size, budget)
            if not self.kv.grow(req, start + n):
                break
            chunks.append((i, n))
            budget -= n

        decode_reserve = int(decoding.sum())
        admitted: list[Req] = []
        for req in waiting.ordered():
            if req.pending_results:
                continue  # retracted while a step was in flight: wait for its token
            if budget <= 0 or not self.free_slots or len(batch) + len(admitted) >= self.max_running:
                break
            if not self._admit(req, budget, decode_reserve):
                break
            waiting.queue.remove(req)
            n = min(len(req.fill_ids) - req.prefix_len, self.chunk_size, budget)
            chunks.append((len(batch) + len(admitted), n))
            admitted.append(req)
            budget -= n
        batch.merge_batch(admitted)
        batch.prepare_for_extend(chunks)
        # Offer each chunk's pages to the prefix cache now, so requests admitted in later
        # steps share them while this one still runs (the worker writes them in order).
        for i, _ in chunks:
            self.kv.cache_prefix(batch.reqs[i].fill_ids, batch.reqs[i], batch.seq_len(i))

    def _admit(self, req: Req, budget: int, decode_reserve: int) -> bool:
        """Takes the cached prefix and the pages of the first chunk, or nothing at all."""
        req.fill_ids = req.all_token_ids()
        if req.sampling.repetition_penalty != 1.0 or (req.embedding and self.pooling == "mean"):
            # The worker's repetition penalty, and mean pooling, see only the prompt tokens it
            # runs: a cached prefix never runs there, so such a request takes none (it still
            # offers its KV).
            req.pages, req.prefix_len = [], 0
        else:
            self.kv.match_prefix(req)
        n = min(len(req.fill_ids) - req.prefix_len, self.chunk_size, budget)
        need = pages_for(req.prefix_len + n, self.kv.page_size) - len(req.pages)
        # Keep one page per running decode in reserve so admission does not force a retraction.
        if not self._room_for(need + decode_reserve) or not self.kv.grow(req, req.prefix_len + n):
            self.kv.allocator.decref(req.pages)
            req.pages, req.prefix_len = [], 0
            return False
        if req.num_retractions == 0:
            req.cached_tokens = req.prefix_len
        req.slot = self.free_slots.pop()
        return True

    def _room_for(self, pages: int) -> bool:
        """Whether `pages` could be had now. The free list alone usually answers; only when it
        is short is the radix tree walked for what eviction could add, which costs O(cached
        pages): done for every admission, it was nearly all of the scheduler's CPU while
        thousands of requests were admitted over a cache of a million pages."""
        return self.kv.allocator.available >= pages or self.kv.available_pages() >= pages

    def release_slot(self, req: Req) -> None:
        self.free_slots.append(req.slot)
        req.slot = None
