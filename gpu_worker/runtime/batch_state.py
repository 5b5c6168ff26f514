"""The worker's persistent batch: rows, page tables, seq_lens, last sampled tokens.

The worker owns the device `seq_lens` (docs/design.md §4). `row_lens_host` is the worker's
own host-side bookkeeping of the same lengths, advanced by the token counts the worker
itself decides each step, so building attention indices never reads the device copy.
The only device-to-host copy of `seq_lens` is `copy_seq_lens_to_host`, which counts
itself.

Layout of one row (slot) in the page table, page_size = 4, seq_len = 10:

    page_table[slot] = [p7, p2, p9, .........]
    tokens            [0 1 2 3|4 5 6 7|8 9 . .]
                       valid ------------^   ^-- allocated, written by later steps
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from gpu_worker.model.attention import AttentionMetadata, DecodeGroup, ExtendRow, QueryKeys, shifted_causal_mask
from gpu_worker.runtime.host_staging import DeviceToHost, StepStaging
from gpu_worker.runtime.sampler import SamplingTable
from trident.wire.backend import BatchDescriptor
from trident.wire.codec import unpack_int32

_NO_DRAFT = np.zeros(0, dtype=np.int64)


MAX_DECODE_GROUPS = 4
"""Each group costs a handful of small ops per layer; past a few, they cost more than the
padding they save."""


def group_by_length(kv_lens: np.ndarray) -> list[list[int]]:
    """Indices of short rows in groups of similar KV length: a group holds rows longer
    than half its longest, so padding at most doubles a group's keys (the last of
    MAX_DECODE_GROUPS groups takes all the rest). Row order within a group is kept."""
    if not len(kv_lens):
        return []
    order = np.argsort(-kv_lens, kind="stable")
    groups: list[list[int]] = [[]]
    longest = kv_lens[order[0]]
    for i in order:
        if kv_lens[i] * 2 <= longest and len(groups) < MAX_DECODE_GROUPS:
            groups.append([])
            longest = kv_lens[i]
        groups[-1].append(int(i))
    return [sorted(g) for g in groups]


class StepGapError(RuntimeError):
    """The descriptor stream skipped a step: the worker's state would be stale."""


class SeqLensSumMismatch(RuntimeError):
    pass


class DescriptorOutOfRange(ValueError):
    """A descriptor names a slot, page, length or token outside what this worker holds. It
    is refused whole, before any of it touches the batch, the page table or the KV pool."""


def _within(what: str, values: np.ndarray, low: int, high: int) -> None:
    """Every value in [low, high): one vectorised min and max, not a loop per element."""
    if len(values) and (int(values.min()) < low or int(values.max()) >= high):
        bad = values[(values < low) | (values >= high)]
        raise DescriptorOutOfRange(f"{what} {int(bad[0])} is outside [{low}, {high})")


class PooledChunk(NamedTuple):
    """A prompt chunk of an embedding row in the flat batch."""

    offset: int
    """Flat index of its first token."""
    length: int
    start: int
    """The row's position of its first token (tokens of the row before this chunk)."""
    slot: int
    is_last: bool
    """The prompt ends with it: the row's vector is due this step."""


@dataclass
class StepPlan:
    """Which rows compute this step and what they run, on the host only (no tensors yet).

    The simulated worker needs no more than this; the model worker turns it into
    ForwardInputs."""

    sampling_slots: list[int]
    """Slots of the sampling rows, in batch order."""
    num_logits: list[int]
    """Logit rows per sampling row (1, or 1 + drafts), aligned with sampling_slots."""
    drafts: dict[int, np.ndarray]
    """Draft tokens per verifying slot."""
    computing_slots: np.ndarray
    q_lens: np.ndarray
    """Tokens each computing row runs this step (aligned with computing_slots)."""
    finishing_prefill_slots: list[int]
    num_prefill_tokens: int
    host_ids: np.ndarray
    """Flat input ids; a decoding row's first entry is a placeholder for its last token."""
    short_rows: list[tuple[int, int, int]]
    """Decoding rows: (flat offset, q_len, slot)."""
    extend_rows: list[tuple[int, int, int, int]]
    """Prefilling rows: (flat offset, q_len, prefix, slot)."""
    logit_positions: list[int]
    """Flat-batch indices whose logits are needed: the last token of each sampling row,
    and every position of a row verifying drafts; then the positions that score prompt
    tokens (`scored_chunks`), after all of those."""
    pooled_rows: list[PooledChunk]
    """The chunks of embedding rows (`BatchState.pooled`), in batch order: what pooling.py
    reads the final hidden states of."""
    scored_chunks: list[tuple[int, int, np.ndarray]]
    """(slot, prompt position of the first target, int32 prompt tokens it scores) of each
    chunk with score targets, in the descriptor's order; their logits are the last rows,
    in that order."""


@dataclass
class ForwardInputs(StepPlan):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    """logit_positions, on the device."""


class BatchState:
    def __init__(
        self,
        max_slots: int,
        max_pages_per_row: int,
        page_size: int,
        sampling: SamplingTable,
        device: torch.device,
        ragged_decode: bool = False,
        every_query_through_kernel: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.ragged_decode = ragged_decode
        """The model's decode attention reads each row at its own length (the C++ kernel):
        a step whose rows each have one query needs no grouping by length, so they go in one
        group (one kernel call per layer, no scatter of outputs)."""
        self.every_query_through_kernel = every_query_through_kernel
        """Batch invariance (batch_invariance.py): steps with prompt chunks or drafts carry
        `QueryKeys`, so that every query goes through the decode kernel as its own row."""
        self.page_size = page_size
        self.page_table = np.zeros((max_slots, max_pages_per_row), dtype=np.int64)
        self.row_lens_host = np.zeros(max_slots, dtype=np.int64)
        self.decoding = np.zeros(max_slots, dtype=bool)
        self.pooled = np.zeros(max_slots, dtype=bool)
        """Embedding rows (`AddedRequest.pooled`): they never sample nor decode."""
        self.staging = StepStaging(device)
        """Each step's metadata arrays on their way to the device."""
        self.readback = DeviceToHost(device)
        self.seq_lens = torch.zeros(max_slots, dtype=torch.int64, device=device)
        """Owned here: KV tokens per slot, on the device."""
        self.last_token = torch.zeros(max_slots, dtype=torch.int64, device=device)
        """The token each decoding row feeds next ("future" tokens, resolved here)."""
        self.order: list[int] = []
        """Slots in batch order; the scheduler's ScheduleBatch keeps the same order."""
        self.sampling = sampling
        self.next_step_id = 1
        self.seq_lens_d2h_copies = 0
        """Copies made for the sync point (SeqLensSync): one per overlapped step."""
        self.seq_lens_debug_copies = 0
        """Copies made only for --check-seq-lens; kept apart so the invariant stays exact."""
        self.token_table: torch.Tensor | None = None
        """Pool token index of every slot's positions on the device, [max_slots, row_capacity],
        kept from the page appends once `keep_token_table` has made it (the decode-graph
        runner's attention reads its rows: an input of fixed shape and address)."""
        self._pending_pages: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        """Page appends applied to page_table and not yet to token_table."""
        self.prompt_scores: dict[int, tuple[int, np.ndarray]] = {}
        """This step's chunks that score prompt tokens: slot -> (score_from, targets), in
        the descriptor's order; set by `apply`."""
        self.num_pages = np.iinfo(np.int32).max
        """Pages of the KV pool, which page ids must index; the worker loop sets it once the
        pool is sized (until then only the int32 range of the wire bounds them)."""

    @property
    def row_capacity(self) -> int:
        """Tokens one row's page table can address."""
        return self.page_table.shape[1] * self.page_size

    def keep_token_table(self) -> torch.Tensor:
        """Makes (once, before any row joins) and returns the device token table."""
        if self.token_table is None:
            assert not self.order, "the token table is made before any row joins"
            self.token_table = torch.zeros(
                len(self.page_table), self.row_capacity, dtype=torch.int64, device=self.device
            )
        return self.token_table

    def stage_token_table_updates(self) -> Callable[[], None] | None:
        """Stages the page appends not yet in the token table; the returned call, made after
        the flush, writes them there (None: nothing to write)."""
        if self.token_table is None or not self._pending_pages:
            return None
        slots, cols, ids = (np.concatenate(parts).astype(np.int64) for parts in zip(*self._pending_pages))
        self._pending_pages.clear()
        # A slot's column appended twice since the last update (the slot freed and handed out
        # again) keeps its last page: one write per entry, as index_put_ wants.
        _, last = np.unique((slots * self.page_table.shape[1] + cols)[::-1], return_index=True)
        keep = len(slots) - 1 - last
        slots, cols, ids = slots[keep], cols[keep], ids[keep]
        within_page = np.arange(self.page_size)
        stage = self.staging.stage
        rows = stage(np.repeat(slots, self.page_size), torch.int64)
        positions = stage((cols[:, None] * self.page_size + within_page).reshape(-1), torch.int64)
        tokens = stage((ids[:, None] * self.page_size + within_page).reshape(-1), torch.int64)
        table = self.token_table
        return lambda: table.index_put_((rows, positions), tokens)

    def reset(self, next_step_id: int) -> None:
        for slot in self.order:
            self.sampling.remove(slot)
        self.order = []
        self.decoding[:] = False
        self.pooled[:] = False
        self.row_lens_host[:] = 0
        self.seq_lens.zero_()
        self.next_step_id = next_step_id

    def check_ranges(self, desc: BatchDescriptor) -> None:
        """Every index of the descriptor against this worker's tables, before any is used:
        slots in the table and in the batch (or free, for an added one), page-table columns
        and page ids in range, token ids in the vocabulary (prompts', and those an added row's
        sampling names: stop, biased, allowed and banned tokens), and every row's KV length after
        this step (prefix, chunk, or one decoded token) within what its page table addresses.
        Raises DescriptorOutOfRange; a few numpy passes per step, nothing per element.

        The attention inputs (out_loc, the C++ decode kernel's KV indices and lengths) are
        made only from the page table and these lengths, so they stay inside the KV pool;
        drafts are the worker's own, cut to the room left in the context (worker_loop.py)."""
        max_slots, capacity, vocab = len(self.page_table), self.row_capacity, self.sampling.vocab_size
        in_batch = np.zeros(max_slots, dtype=bool)
        in_batch[self.order] = True
        # A steady decode step removes and adds nothing: those checks are skipped, not run on empty arrays.
        if desc.removed_slots:
            removed = np.asarray(desc.removed_slots, dtype=np.int64)
            _within("removed slot", removed, 0, max_slots)
            if not in_batch[removed].all():
                raise DescriptorOutOfRange(
                    f"removes slot {int(removed[~in_batch[removed]][0])}, which is not in the batch"
                )
            in_batch[removed] = False
        lens = self.row_lens_host.copy()
        decoding = self.decoding & in_batch
        if desc.added:
            added = np.asarray([a.slot for a in desc.added], dtype=np.int64)
            _within("added slot", added, 0, max_slots)
            if in_batch[added].any() or len(np.unique(added)) != len(added):
                raise DescriptorOutOfRange("adds a slot that is already in the batch")
            in_batch[added] = True
            decoding[added] = False
            lens[added] = [a.prefix_len for a in desc.added]
            _within("prefix length", lens[added], 0, capacity + 1)
            _within("generated token", unpack_int32(b"".join(a.generated_ids for a in desc.added)), 0, vocab)
            named = [t for a in desc.added for t in a.sampling.named_token_ids()]
            _within("sampling token", np.asarray(named, dtype=np.int64), 0, vocab)
        if desc.page_appends.slots:
            slots, cols, ids = desc.page_appends.scatter_indices()
            _within("page-append slot", slots, 0, max_slots)
            if not in_batch[slots].all():
                raise DescriptorOutOfRange("appends pages to a slot that is not in the batch")
            _within("page-table column", cols, 0, self.page_table.shape[1])
            _within("page id", ids, 0, self.num_pages)
        if desc.extends:
            chunk_slots = np.asarray([c.slot for c in desc.extends], dtype=np.int64)
            chunk_lens = np.asarray([len(c.token_ids) // 4 for c in desc.extends], dtype=np.int64)
            _within("chunk slot", chunk_slots, 0, max_slots)
            if not in_batch[chunk_slots].all() or len(np.unique(chunk_slots)) != len(chunk_slots):
                raise DescriptorOutOfRange("a prompt chunk names a slot not in the batch, or one twice")
            _within("chunk length", chunk_lens, 1, capacity + 1)
            _within("prompt token", unpack_int32(b"".join(c.token_ids for c in desc.extends)), 0, vocab)
            _within("scored prompt token", unpack_int32(b"".join(c.score_targets for c in desc.extends)), 0, vocab)
            for c, n in zip(desc.extends, chunk_lens.tolist()):
                if c.score_targets and (c.score_from < 0 or c.score_from + len(c.score_targets) // 4 > n):
                    raise DescriptorOutOfRange(
                        f"a chunk of {n} tokens scores {len(c.score_targets) // 4} from {c.score_from}"
                    )
            lens[chunk_slots] += chunk_lens
            decoding[chunk_slots] = False
        lens[decoding] += 1
        _within("KV length after the step", lens[in_batch], 0, capacity + 1)

    def apply(self, desc: BatchDescriptor) -> dict[int, tuple[np.ndarray, bool]]:
        """Applies the delta; returns this step's prompt chunks by slot."""
        self.check_ranges(desc)
        if desc.step_id != self.next_step_id:
            raise StepGapError(f"expected step {self.next_step_id}, got step {desc.step_id}")
        self.next_step_id += 1
        if desc.removed_slots:
            removed = set(desc.removed_slots)
            self.order = [s for s in self.order if s not in removed]
            for slot in removed:
                self.sampling.remove(slot)
                self.decoding[slot] = False
        for add in desc.added:
            self.order.append(add.slot)
            self.row_lens_host[add.slot] = add.prefix_len
            self.seq_lens[add.slot] = add.prefix_len
            self.decoding[add.slot] = False
            self.pooled[add.slot] = add.pooled
            self.sampling.add(add.slot, add.sampling, unpack_int32(add.generated_ids).tolist())
        if desc.page_appends.slots:
            slots, cols, ids = desc.page_appends.scatter_indices()
            self.page_table[slots, cols] = ids
            if self.token_table is not None:
                self._pending_pages.append((np.asarray(slots), np.asarray(cols), np.asarray(ids)))
        self.prompt_scores = {
            c.slot: (c.score_from, unpack_int32(c.score_targets)) for c in desc.extends if c.score_targets
        }
        return {c.slot: (unpack_int32(c.token_ids), c.is_last) for c in desc.extends}

    def build_forward(
        self, chunks: dict[int, tuple[np.ndarray, bool]], drafts: dict[int, np.ndarray] | None = None
    ) -> ForwardInputs | None:
        plan = self.plan_step(chunks, drafts)
        return None if plan is None else self.forward_inputs(plan)

    def plan_step(
        self, chunks: dict[int, tuple[np.ndarray, bool]], drafts: dict[int, np.ndarray] | None = None
    ) -> StepPlan | None:
        """The rows that compute this step, in batch order.

        A prefilling row runs its chunk (if it has one this step); a decoding row runs its
        last sampled token, followed by its draft tokens when it verifies a draft. An
        embedding row's chunks go to `pooled_rows`; its last one samples nothing.
        """
        drafts = drafts or {}
        host_ids: list[np.ndarray] = []
        slots, q_lens, sampling_slots, num_logits, finishing = [], [], [], [], []
        short_rows: list[tuple[int, int, int]] = []
        extend_rows: list[tuple[int, int, int, int]] = []
        logits_idx: list[int] = []
        pooled_rows: list[PooledChunk] = []
        score_offsets: dict[int, int] = {}
        offset = num_prefill = 0
        for slot in self.order:
            if slot in chunks:
                tokens, is_last = chunks[slot]
                n = len(tokens)
                host_ids.append(tokens.astype(np.int64))
                extend_rows.append((offset, n, int(self.row_lens_host[slot]), slot))
                num_prefill += n
                if slot in self.prompt_scores:
                    score_offsets[slot] = offset + self.prompt_scores[slot][0]
                if self.pooled[slot]:
                    pooled_rows.append(PooledChunk(offset, n, int(self.row_lens_host[slot]), slot, is_last))
                elif is_last:
                    finishing.append(slot)
                    sampling_slots.append(slot)
                    num_logits.append(1)
                    logits_idx.append(offset + n - 1)
            elif self.decoding[slot]:
                draft = drafts.get(slot, _NO_DRAFT)
                n = 1 + len(draft)
                host_ids.append(np.concatenate([[0], draft]).astype(np.int64))  # [0] = last token, filled later
                short_rows.append((offset, n, slot))
                sampling_slots.append(slot)
                num_logits.append(n)
                logits_idx.extend(range(offset, offset + n))
            else:
                continue  # a chunked prefill waiting for its next chunk
            slots.append(slot)
            q_lens.append(n)
            offset += n
        if not slots:
            return None
        scored = [
            (slot, int(self.row_lens_host[slot]) + score_from + 1, targets)
            for slot, (score_from, targets) in self.prompt_scores.items()
            if slot in score_offsets
        ]
        for slot, _, targets in scored:
            logits_idx.extend(range(score_offsets[slot], score_offsets[slot] + len(targets)))
        return StepPlan(
            sampling_slots=sampling_slots,
            num_logits=num_logits,
            drafts=drafts,
            computing_slots=np.asarray(slots),
            q_lens=np.asarray(q_lens),
            finishing_prefill_slots=finishing,
            num_prefill_tokens=num_prefill,
            host_ids=np.concatenate(host_ids),
            short_rows=short_rows,
            extend_rows=extend_rows,
            logit_positions=logits_idx,
            pooled_rows=pooled_rows,
            scored_chunks=scored,
        )

    def forward_inputs(self, plan: StepPlan) -> ForwardInputs:
        """The model's flat inputs and attention metadata for a plan: every array staged into
        the persistent host buffers and sent in one non-blocking copy per dtype (host_staging.py)."""
        dev, staging = self.device, self.staging
        staging.begin_step()
        starts = self.row_lens_host[plan.computing_slots]
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, plan.q_lens)])
        out_loc = self.pool_index(np.repeat(plan.computing_slots, plan.q_lens), positions)
        input_ids = staging.stage(plan.host_ids, torch.int64)
        if plan.short_rows:
            first = staging.stage([o for o, _, _ in plan.short_rows], torch.int64)
            first_slots = staging.stage([s for _, _, s in plan.short_rows], torch.int64)
        query_keys = None
        if self.every_query_through_kernel and (plan.extend_rows or len(plan.q_lens) < len(positions)):
            query_keys = self._query_keys(plan, starts, positions)
        rows = []
        for q_start, n, prefix, slot in plan.extend_rows:
            kv = staging.stage(self.pool_index(np.full(prefix + n, slot), np.arange(prefix + n)), torch.int64)
            mask = shifted_causal_mask(n, prefix, dev) if prefix and query_keys is None else None
            rows.append(ExtendRow(q_start, n, prefix, kv, mask))
        short_rows = plan.short_rows
        if self.ragged_decode and short_rows and all(n == 1 for _, n, _ in short_rows):
            grouped = [list(range(len(short_rows)))]
        else:
            grouped = group_by_length(self.row_lens_host[[s for _, _, s in short_rows]])
        alone = len(grouped) == 1 and not plan.extend_rows
        groups = [self._decode_group([short_rows[i] for i in members], alone) for members in grouped]
        meta = AttentionMetadata(staging.stage(out_loc, torch.int64), groups, rows, query_keys)
        positions_dev = staging.stage(positions, torch.int64)
        logits_indices = staging.stage(plan.logit_positions, torch.int64)
        update_token_table = self.stage_token_table_updates()
        staging.flush()
        if update_token_table is not None:
            update_token_table()
        if plan.short_rows:  # after the flush: this reads staged values on the device
            input_ids[first] = self.last_token[first_slots]
        return ForwardInputs(
            **vars(plan), input_ids=input_ids, positions=positions_dev, meta=meta, logits_indices=logits_indices
        )

    def _query_keys(self, plan: StepPlan, starts: np.ndarray, positions: np.ndarray) -> QueryKeys:
        """Each of the step's query tokens as its own row of the decode kernel: its sequence's
        keys through this step, of which it sees those up to its own position."""
        kv_lens = starts + plan.q_lens
        kv = np.arange(int(kv_lens.max()))
        table = np.where(kv[None, :] < kv_lens[:, None], self.pool_index(plan.computing_slots[:, None], kv[None, :]), 0)
        stage = self.staging.stage
        return QueryKeys(
            kv_table=stage(table, torch.int64, table.shape),
            kv_rows=stage(np.repeat(np.arange(len(kv_lens)), plan.q_lens), torch.int64),
            kv_lens=stage(positions + 1, torch.int64),
        )

    def pool_index(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        ps = self.page_size
        return self.page_table[slots, positions // ps] * ps + positions % ps

    def _decode_group(self, rows: list[tuple[int, int, int]], alone: bool) -> DecodeGroup:
        """Padded query indices, key indices and the mask bias of rows batched together;
        `alone`: they are all the rows that compute this step."""
        offsets = np.asarray([o for o, _, _ in rows])
        q_lens = np.asarray([n for _, n, _ in rows])
        slots = np.asarray([s for _, _, s in rows])
        prefix = self.row_lens_host[slots]
        max_q, kv_lens = int(q_lens.max()), prefix + q_lens
        q = np.arange(max_q)
        q_valid = q[None, :] < q_lens[:, None]
        token_idx = offsets[:, None] + np.minimum(q[None, :], q_lens[:, None] - 1)
        kv = np.arange(int(kv_lens.max()))
        kv_idx = np.where(kv[None, :] < kv_lens[:, None], self.pool_index(slots[:, None], kv[None, :]), 0)
        # Query i of a row sits at position prefix+i and sees keys 0..prefix+i.
        visible = kv[None, None, :] <= (prefix[:, None, None] + np.minimum(q, q_lens[:, None] - 1)[:, :, None])
        bias = np.where(visible, np.float32(0), np.float32(-np.inf))
        # A plain decode step: one query per row, the rows in batch order.
        covers_batch = alone and max_q == 1 and bool((offsets == np.arange(len(rows))).all())
        stage = self.staging.stage
        return DecodeGroup(
            token_idx=stage(token_idx, torch.int64, token_idx.shape),
            q_valid=stage(q_valid, torch.bool, q_valid.shape),
            kv_indices=stage(kv_idx, torch.int64, kv_idx.shape),
            kv_lens=stage(kv_lens, torch.int64),
            bias=stage(bias, torch.float32, (len(rows), 1, max_q, 1, len(kv))),
            covers_batch=covers_batch,
        )

    def advance(self, inputs: StepPlan, accepted: list[np.ndarray]) -> None:
        """After the forward: each row's length grows by the tokens whose KV is now valid
        (a chunk, or the accepted part of a verified draft); the last accepted token feeds
        the row's next step."""
        grow = dict(zip(inputs.computing_slots.tolist(), inputs.q_lens.tolist()))
        last = []
        for slot, toks in zip(inputs.sampling_slots, accepted):
            if self.decoding[slot]:
                grow[slot] = len(toks)  # drafts past the first mismatch are dropped
            last.append(int(toks[-1]))
        slots_arr = np.fromiter(grow.keys(), dtype=np.int64, count=len(grow))
        lens_arr = np.fromiter(grow.values(), dtype=np.int64, count=len(grow))
        self.row_lens_host[slots_arr] += lens_arr
        stage = self.staging.stage
        slots_dev, lens_dev = stage(slots_arr, torch.int64), stage(lens_arr, torch.int64)
        sampling_dev, last_dev = stage(inputs.sampling_slots, torch.int64), stage(last, torch.int64)
        self.staging.flush()
        self.seq_lens.index_add_(0, slots_dev, lens_dev)  # slots are distinct: the same as +=
        self.last_token.index_copy_(0, sampling_dev, last_dev)
        for slot in inputs.finishing_prefill_slots:
            self.decoding[slot] = True

    def check_seq_lens_sum(self, desc: BatchDescriptor) -> None:
        """`--check-seq-lens`: the descriptor's sum must equal this worker's after the step."""
        own = int(self.row_lens_host[self.order].sum()) if self.order else 0
        if own != desc.seq_lens_sum:
            raise SeqLensSumMismatch(
                f"step {desc.step_id}: descriptor seq_lens_sum {desc.seq_lens_sum} != worker's {own}: "
                "the scheduler read a stale sum (a producer skipped its refresh)"
            )

    def copy_seq_lens_to_host(self, for_debug_check: bool = False) -> np.ndarray:
        """seq_lens in batch order on the host; every call is counted. One non-blocking copy
        of the whole table into a pinned buffer and one event wait (host_staging.py): no
        index to send over, the batch order is applied on the host."""
        if for_debug_check:
            self.seq_lens_debug_copies += 1
        else:
            self.seq_lens_d2h_copies += 1
        return self.readback.fetch(self.seq_lens)[self.order].astype(np.int32)
