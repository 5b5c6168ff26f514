"""The worker's persistent batch: rows, page tables, seq_lens, last sampled tokens.

The worker owns the device `seq_lens` (DESIGN.md §4). `row_lens_host` is the worker's
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

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention import AttentionMetadata, ExtendRow, shifted_causal_mask
from gpu_worker.sampler import SamplingTable
from wire.backend import BatchDescriptor
from wire.codec import unpack_int32


class StepGapError(RuntimeError):
    """The descriptor stream skipped a step: the worker's state would be stale."""


class SeqLensSumMismatch(RuntimeError):
    pass


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    """Flat-batch index of the last token of each sampling row."""
    sampling_slots: list[int]
    """Slots of the sampling rows, in batch order."""
    computing_slots: np.ndarray
    q_lens: np.ndarray
    """Tokens each computing row runs this step (aligned with computing_slots)."""
    finishing_prefill_slots: list[int]
    num_prefill_tokens: int


class BatchState:
    def __init__(self, max_slots: int, max_pages_per_row: int, page_size: int,
                 sampling: SamplingTable, device: torch.device) -> None:
        self.device = device
        self.page_size = page_size
        self.page_table = np.zeros((max_slots, max_pages_per_row), dtype=np.int64)
        self.row_lens_host = np.zeros(max_slots, dtype=np.int64)
        self.decoding = np.zeros(max_slots, dtype=bool)
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

    def reset(self, next_step_id: int) -> None:
        for slot in self.order:
            self.sampling.remove(slot)
        self.order = []
        self.decoding[:] = False
        self.row_lens_host[:] = 0
        self.seq_lens.zero_()
        self.next_step_id = next_step_id

    def apply(self, desc: BatchDescriptor) -> dict[int, tuple[np.ndarray, bool]]:
        """Applies the delta; returns this step's prompt chunks by slot."""
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
            self.sampling.add(add.slot, add.sampling, unpack_int32(add.generated_ids).tolist())
        for pa in desc.page_appends:
            ids = unpack_int32(pa.page_ids)
            self.page_table[pa.slot, pa.first_index : pa.first_index + len(ids)] = ids
        return {c.slot: (unpack_int32(c.token_ids), c.is_last) for c in desc.extends}

    def build_forward(self, chunks: dict[int, tuple[np.ndarray, bool]]) -> ForwardInputs | None:
        ps = self.page_size
        host_ids: list[np.ndarray] = []
        slots, q_lens, sampling_slots, finishing = [], [], [], []
        decode_flat_idx, decode_slots, extend_rows = [], [], []
        logits_idx = []
        offset = 0
        num_prefill = 0
        for slot in self.order:
            if slot in chunks:
                tokens, is_last = chunks[slot]
                n = len(tokens)
                host_ids.append(tokens.astype(np.int64))
                extend_rows.append((offset, n, int(self.row_lens_host[slot]), slot))
                num_prefill += n
                if is_last:
                    finishing.append(slot)
            elif self.decoding[slot]:
                n = 1
                host_ids.append(np.zeros(1, dtype=np.int64))
                decode_flat_idx.append(offset)
                decode_slots.append(slot)
            else:
                continue  # a chunked prefill waiting for its next chunk
            slots.append(slot)
            q_lens.append(n)
            if slot not in chunks or chunks[slot][1]:
                sampling_slots.append(slot)
                logits_idx.append(offset + n - 1)
            offset += n
        if not slots:
            return None

        slots_arr = np.asarray(slots)
        q_lens_arr = np.asarray(q_lens)
        starts = self.row_lens_host[slots_arr]
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, q_lens_arr)])
        row_of_token = np.repeat(slots_arr, q_lens_arr)
        out_loc = self.page_table[row_of_token, positions // ps] * ps + positions % ps

        dev = self.device
        input_ids = torch.from_numpy(np.concatenate(host_ids)).to(dev)
        decode_idx_t = torch.tensor(decode_flat_idx, dtype=torch.int64, device=dev)
        if decode_slots:
            input_ids[decode_idx_t] = self.last_token[torch.tensor(decode_slots, device=dev)]
        kv_idx, kv_mask = self._decode_kv_indices(np.asarray(decode_slots, dtype=np.int64))
        rows = []
        for q_start, n, prefix, slot in extend_rows:
            kv_pos = np.arange(prefix + n)
            kv = self.page_table[slot, kv_pos // ps] * ps + kv_pos % ps
            mask = shifted_causal_mask(n, prefix, dev) if prefix else None
            rows.append(ExtendRow(q_start, n, prefix, torch.from_numpy(kv).to(dev), mask))
        meta = AttentionMetadata(
            out_cache_loc=torch.from_numpy(out_loc).to(dev),
            decode_token_idx=decode_idx_t,
            decode_kv_indices=kv_idx,
            decode_mask=kv_mask,
            extend_rows=rows,
        )
        return ForwardInputs(
            input_ids=input_ids,
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            sampling_slots=sampling_slots,
            computing_slots=slots_arr,
            q_lens=q_lens_arr,
            finishing_prefill_slots=finishing,
            num_prefill_tokens=num_prefill,
        )

    def _decode_kv_indices(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded pool indices for decode rows, including the token written this step."""
        ps = self.page_size
        kv_lens = self.row_lens_host[slots] + 1
        max_len = int(kv_lens.max()) if len(slots) else 0
        pos = np.arange(max_len)
        valid = pos[None, :] < kv_lens[:, None]
        idx = self.page_table[slots[:, None], pos[None, :] // ps] * ps + pos[None, :] % ps
        idx = np.where(valid, idx, 0)
        mask = torch.from_numpy(valid).to(self.device)[:, None, None, :]
        return torch.from_numpy(idx).to(self.device), mask

    def advance(self, inputs: ForwardInputs, next_tokens: torch.Tensor) -> None:
        """After the forward: lengths grow by what each row ran; sampled tokens feed next."""
        self.row_lens_host[inputs.computing_slots] += inputs.q_lens
        slots_t = torch.from_numpy(inputs.computing_slots).to(self.device)
        self.seq_lens[slots_t] += torch.from_numpy(inputs.q_lens).to(self.device)
        if inputs.sampling_slots:
            self.last_token[torch.tensor(inputs.sampling_slots, device=self.device)] = next_tokens
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
        """A device-to-host copy of seq_lens in batch order; every call is counted."""
        if for_debug_check:
            self.seq_lens_debug_copies += 1
        else:
            self.seq_lens_d2h_copies += 1
        order = torch.tensor(self.order, dtype=torch.int64, device=self.device)
        return self.seq_lens[order].to("cpu", dtype=torch.int32).numpy()
