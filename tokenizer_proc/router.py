"""Which data-parallel replica gets a request (--load-balance-method).

The tokenizer is the only source of work for the schedulers, so the load it has sent and not
yet seen finish is exact and fresh; the schedulers' periodic stats are not needed to balance.

- round_robin: replicas in turn.
- shortest_queue: the replica with the fewest open requests here (ties: in turn).
- longest_prefix: the replica most likely to hold the prompt's prefix in its radix cache,
  i.e. the one this tokenizer last sent the longest matching prefix to, in blocks of
  PREFIX_BLOCK tokens; with no match (or a match shorter than one block), or when that
  replica has IMBALANCE_LIMIT more open requests than the least loaded, shortest_queue.
  The index is an approximation of the caches (it does not see their evictions) bounded
  to MAX_PREFIX_BLOCKS entries, oldest forgotten first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "longest_prefix")
PREFIX_BLOCK = 16
MAX_PREFIX_BLOCKS = 200_000
IMBALANCE_LIMIT = 32


class ReplicaRouter:
    def __init__(self, dp_size: int, method: str) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown load-balance method {method!r}; choose from {LOAD_BALANCE_METHODS}")
        self.dp_size = dp_size
        self.method = method
        self.open_requests = [0] * dp_size
        """Requests sent to each replica and not finished yet (this process's count)."""
        self.routed = [0] * dp_size
        """Requests ever sent to each replica."""
        self._next = 0
        self._prefix_owner: OrderedDict[bytes, int] = OrderedDict()
        """Chained hash of a prompt's first k blocks -> the replica that last got it."""

    def choose(self, prompt_ids: Sequence[int]) -> int:
        """The replica for a new request; the caller must `opened` it there."""
        if self.dp_size == 1:
            return 0
        if self.method == "round_robin":
            return self._in_turn(range(self.dp_size))
        if self.method == "longest_prefix":
            hit = self._longest_prefix_owner(prompt_ids)
            least = min(self.open_requests)
            if hit is not None and self.open_requests[hit] - least <= IMBALANCE_LIMIT:
                return hit
        least = min(self.open_requests)
        return self._in_turn([d for d in range(self.dp_size) if self.open_requests[d] == least])

    def opened(self, replica: int, prompt_ids: Sequence[int], count: int = 1) -> None:
        self.open_requests[replica] += count
        self.routed[replica] += count
        if self.method == "longest_prefix":
            for key in self._block_keys(prompt_ids):
                self._prefix_owner[key] = replica
                self._prefix_owner.move_to_end(key)
            while len(self._prefix_owner) > MAX_PREFIX_BLOCKS:
                self._prefix_owner.popitem(last=False)

    def closed(self, replica: int) -> None:
        self.open_requests[replica] -= 1

    def _in_turn(self, candidates: Sequence[int]) -> int:
        """The first candidate at or after the rotating cursor, so equals share the load."""
        pick = min(candidates, key=lambda d: (d - self._next) % self.dp_size)
        self._next = (pick + 1) % self.dp_size
        return pick

    def _longest_prefix_owner(self, prompt_ids: Sequence[int]) -> int | None:
        owner = None
        for key in self._block_keys(prompt_ids):
            replica = self._prefix_owner.get(key)
            if replica is None:
                break
            owner = replica
        return owner

    @staticmethod
    def _block_keys(prompt_ids: Sequence[int]) -> list[bytes]:
        """One key per whole block: a hash of every token up to the block's end."""
        tokens = np.asarray(prompt_ids, dtype="<i4")
        h = hashlib.blake2b(digest_size=16)
        keys = []
        for end in range(PREFIX_BLOCK, len(tokens) + 1, PREFIX_BLOCK):
            h.update(tokens[end - PREFIX_BLOCK : end].tobytes())
            keys.append(h.copy().digest())
        return keys
