"""The running batch as the scheduler sees it, and the seq_lens mirror (docs/design.md §4).

The worker owns the device `seq_lens`. `ScheduleBatch.seq_lens_cpu` is this process's
mirror of it, row for row in batch order, holding each row's KV length *after* the step
being built (as in SGLang: a decode row counts the token it is about to write).

Rules kept here and nowhere else:
- producers (`prepare_for_extend`, `prepare_for_decode`, `filter_batch`, `merge_batch`)
  never compute a sum: they set `seq_lens_sum = None`;
- `refresh_seq_lens_cpu` is the only place that recomputes it; with `sync=True` it takes
  the values the worker published (`SeqLensSync`) as the new mirror;
- `build_descriptor` refreshes lazily, so no consumer ever reads None.

The batch also collects the delta the next descriptor carries (rows removed, rows added,
pages gained since the last descriptor, prompt chunks to run), because every change to the batch is a change the
worker must hear about, and recording both in one place keeps them from drifting apart.
"""

from __future__ import annotations

import numpy as np

from scheduler_proc.prompt_logprobs import chunk_scoring
from scheduler_proc.request import Req
from trident.wire.backend import AddedRequest, BatchDescriptor, ExtendChunk, ForwardMode, PageAppends
from trident.wire.codec import pack_int32


class SeqLensDrift(AssertionError):
    """The mirror disagrees with what the worker published (`--check-seq-lens`)."""


class ScheduleBatch:
    def __init__(self) -> None:
        self.reqs: list[Req] = []
        """Rows in batch order; the worker's persistent batch has the same order."""
        self.seq_lens_cpu = np.zeros(0, dtype=np.int64)
        """Mirror of the worker's device seq_lens (KV length after the step being built)."""
        self.seq_lens_sum: int | None = 0
        """Sum of seq_lens_cpu, or None when a producer changed the batch since."""
        self._removed_slots: list[int] = []
        self._added: list[AddedRequest] = []
        self._extends: list[ExtendChunk] = []
        self._decode_rows = 0
        self.step_increments = np.zeros(0, dtype=np.int64)
        """Tokens the step being built adds to each row; reset by build_descriptor."""
        self.sampling_mask = np.zeros(0, dtype=bool)
        """Rows that sample a token in the step being built: decoding rows, and rows whose
        last prompt chunk runs; reset by build_descriptor."""
        self.pooling_reqs: list[Req] = []
        """Embedding rows whose last prompt chunk runs in the step being built, in batch
        order: each gets its vector from the step; reset by build_descriptor."""
        self.scoring_reqs: list[Req] = []
        """Requests whose chunk in the step being built scores prompt tokens, in chunk
        order; a new list after build_descriptor."""
        self.first_outputs_row_by_row = False
        """A prompt ending in the step being built wants its first output taken row by row
        (it carries prompt logprobs, or its token is dropped: `Req.prefill_only`); reset by
        build_descriptor."""

    def __len__(self) -> int:
        return len(self.reqs)

    def seq_len(self, index: int) -> int:
        return int(self.seq_lens_cpu[index])

    # --- producers: change the batch, invalidate the sum -------------------------------

    def merge_batch(self, new_reqs: list[Req]) -> None:
        """Appends admitted requests (prefix already in the cache) as prefilling rows."""
        if not new_reqs:
            return
        for req in new_reqs:
            self._added.append(
                AddedRequest(
                    slot=req.slot,
                    prefix_len=req.prefix_len,
                    sampling=req.sampling,
                    generated_ids=pack_int32(req.resumed_ids + req.output_ids)
                    if req.resumed_ids or req.output_ids
                    else b"",
                    pooled=req.embedding,
                )
            )
        self.reqs.extend(new_reqs)
        self.seq_lens_cpu = np.concatenate(
            [self.seq_lens_cpu, np.asarray([r.prefix_len for r in new_reqs], dtype=np.int64)]
        )
        self.step_increments = np.concatenate([self.step_increments, np.zeros(len(new_reqs), dtype=np.int64)])
        self.sampling_mask = np.concatenate([self.sampling_mask, np.zeros(len(new_reqs), dtype=bool)])
        self.seq_lens_sum = None

    def filter_batch(self, remove: list[Req]) -> None:
        """Drops rows (finished, aborted, retracted); order of the rest is kept."""
        if not remove:
            return
        gone = {id(r) for r in remove}
        keep = np.asarray([id(r) not in gone for r in self.reqs], dtype=bool)
        self._removed_slots.extend(r.slot for r in remove)
        self.reqs = [r for r, k in zip(self.reqs, keep) if k]
        self.seq_lens_cpu = self.seq_lens_cpu[keep]
        self.step_increments = self.step_increments[keep]
        self.sampling_mask = self.sampling_mask[keep]
        self.seq_lens_sum = None

    def prepare_for_extend(self, chunks: list[tuple[int, int]]) -> None:
        """Rows (by index) that run `n` prompt tokens this step."""
        for index, n in chunks:
            req = self.reqs[index]
            start = self.seq_len(index)
            is_last = start + n == len(req.fill_ids)
            score_from, targets = chunk_scoring(req, start, n)
            chunk = ExtendChunk(req.slot, pack_int32(req.fill_ids[start : start + n]), is_last, score_from, targets)
            self._extends.append(chunk)
            if targets:
                self.scoring_reqs.append(req)
            self.seq_lens_cpu[index] += n
            self.step_increments[index] += n
            if req.embedding:  # samples nothing, never decodes: its vector is due
                if is_last:
                    self.pooling_reqs.append(req)
                continue
            if is_last and (req.score_start() >= 0 or req.prefill_only):
                self.first_outputs_row_by_row = True
            # The worker starts decoding this row right after the step; so does the mirror.
            req.decoding = is_last
            self.sampling_mask[index] = is_last
        self.seq_lens_sum = None

    def add_accepted_drafts(self, rows: np.ndarray, accepted_drafts: np.ndarray) -> None:
        """Plain loop with speculative decoding: rows verified drafts and grew by more than
        the one token prepare_for_decode counted (the CPU mirror is current again)."""
        self.seq_lens_cpu[rows] += accepted_drafts
        self.seq_lens_sum = None

    def prepare_for_decode(self, decode_mask: np.ndarray) -> None:
        """Every decoding row (a bool or 0/1 per row) writes one more token this step."""
        self.seq_lens_cpu += decode_mask
        self.step_increments += decode_mask
        self.sampling_mask |= decode_mask.astype(bool)
        self._decode_rows = int(decode_mask.sum())
        self.seq_lens_sum = None

    # --- the one refresh ---------------------------------------------------------------

    def refresh_seq_lens_cpu(self, sync: bool, published: np.ndarray | None = None) -> None:
        """Recomputes the sum; with sync=True first adopts the worker's published lengths."""
        if sync and published is not None:
            if len(published) != len(self.seq_lens_cpu):
                raise SeqLensDrift(
                    f"worker published {len(published)} seq_lens for a batch of {len(self.seq_lens_cpu)}"
                )
            self.seq_lens_cpu = published.astype(np.int64)
        self.seq_lens_sum = int(self.seq_lens_cpu.sum())

    # --- the descriptor ----------------------------------------------------------------

    def collect_page_appends(self) -> PageAppends:
        """Pages the worker's page tables do not hold yet (`Req.pages_sent` onwards)."""
        slots: list[int] = []
        firsts: list[int] = []
        counts: list[int] = []
        ids: list[int] = []
        for req in self.reqs:
            held, sent = len(req.pages), req.pages_sent
            if held > sent:
                slots.append(req.slot)
                firsts.append(sent)
                counts.append(held - sent)
                if held - sent == 1:
                    ids.append(req.pages[sent])
                else:
                    ids += req.pages[sent:]
                req.pages_sent = held
        return PageAppends.of_columns(slots, firsts, ids, counts)

    def build_descriptor(self, step_id: int) -> BatchDescriptor:
        if self.seq_lens_sum is None:
            self.refresh_seq_lens_cpu(sync=False)
        has_extend = bool(self._extends)
        has_decode = self._decode_rows > 0
        mode = (
            ForwardMode.MIXED
            if has_extend and has_decode
            else ForwardMode.EXTEND
            if has_extend
            else ForwardMode.DECODE
            if has_decode
            else ForwardMode.IDLE
        )
        desc = BatchDescriptor(
            step_id=step_id,
            forward_mode=int(mode),
            removed_slots=self._removed_slots,
            added=self._added,
            page_appends=self.collect_page_appends(),
            extends=self._extends,
            seq_lens_sum=self.seq_lens_sum,
        )
        self._removed_slots, self._added, self._extends = [], [], []
        self.pooling_reqs, self.scoring_reqs, self.first_outputs_row_by_row = [], [], False
        self._decode_rows = 0
        self.step_increments = np.zeros(len(self.reqs), dtype=np.int64)
        self.sampling_mask = np.zeros(len(self.reqs), dtype=bool)
        return desc


def check_seq_lens(expected: np.ndarray, published: np.ndarray, step_id: int) -> None:
    """`--check-seq-lens`: the mirror taken when step_id was built must equal the worker's
    lengths after it ran."""
    if len(published) != len(expected) or not np.array_equal(published, expected):
        raise SeqLensDrift(
            f"step {step_id}: scheduler mirror {expected.tolist()} != worker seq_lens "
            f"{published.tolist()}: a seq_lens producer skipped its refresh"
        )
