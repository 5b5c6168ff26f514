"""N-gram (prompt-lookup) drafting for speculative decoding, on the worker.

The worker sees every prompt chunk it runs and every token it samples, so it drafts from
its own history and the scheduler never ships token ids for drafting. For a row whose
history ends in the n-gram g, the draft is the K tokens that followed the latest earlier
occurrence of g (n tried from `--speculative-ngram-max` down to `--speculative-ngram-min`).
Only plain greedy rows draft:
verification is an exact argmax match, which keeps greedy output unchanged.
"""

from __future__ import annotations

import numpy as np

from trident.wire.frontend import SamplingParams

SEARCH_WINDOW = 4096
"""Only the last tokens of a long history are searched: bounded work per step."""


def can_draft(p: SamplingParams | None) -> bool:
    return p is not None and p.drafts_allowed()


class NgramDrafter:
    def __init__(self, max_slots: int, num_draft_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.k = num_draft_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.history: list[list[int]] = [[] for _ in range(max_slots)]
        """Tokens of each slot the worker has seen: prompt chunks it ran, tokens it sampled."""

    def reset_slot(self, slot: int) -> None:
        self.history[slot] = []

    def note_tokens(self, slot: int, tokens) -> None:
        self.history[slot].extend(int(t) for t in tokens)

    def propose(self, slot: int) -> np.ndarray:
        """Up to K draft tokens to follow the slot's history (which ends in its last token)."""
        hist = np.asarray(self.history[slot][-SEARCH_WINDOW:], dtype=np.int64)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(hist) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
            hits = np.flatnonzero((windows == hist[-n:]).all(axis=1))
            if len(hits):
                start = hits[-1] + n  # the latest earlier occurrence
                return hist[start : start + self.k]
        return np.zeros(0, dtype=np.int64)
