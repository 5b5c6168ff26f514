"""Messages between the scheduler and the worker ranks.

scheduler -> every worker rank: `WorkerInput`, above all the `BatchDescriptor`, a *delta*
against the persistent batch the worker keeps (docs/design.md §3). The batch order is the
contract both sides keep: `removed_slots` filter it (order preserved), `added` requests
are appended in order. Each step every *decoding* row computes one token; a *prefilling*
row computes only when an `ExtendChunk` names it. Rows that sample (decoding rows, and
prefilling rows whose chunk is the last) produce one token each, in batch order. An
embedding row (`AddedRequest.pooled`) never samples: its last chunk produces its pooled
vector instead (`StepResult.embeddings`), and it never decodes.

worker rank 0 -> scheduler: `SchedulerReply` (ready, seq_lens sync, step results).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from trident.wire.codec import pack_int32
from trident.wire.frontend import SamplingParams
from trident.wire.logprobs import PromptLogprobs


class ForwardMode(enum.IntEnum):
    IDLE = 0
    EXTEND = 1
    """Only prefilling rows compute."""
    DECODE = 2
    """Only decoding rows compute."""
    MIXED = 3
    """Both: a chunked prefill rides along with the running decodes."""


class AddedRequest(msgspec.Struct, array_like=True):
    """A request joining the worker's batch (merge_batch)."""

    slot: int
    """Row of the worker's per-request tables; the scheduler owns slot allocation."""
    prefix_len: int
    """Tokens whose KV is already in the pool (prefix cache hit): the row starts there."""
    sampling: SamplingParams
    generated_ids: bytes = b""
    """int32 tokens this request generated before a retraction or restart; penalties
    count them. They are also part of the prompt it is resumed with."""
    pooled: bool = False
    """An embedding request (`EmbedReq`): the row samples no token; the final hidden states
    of its prompt are pooled (`--pooling`) into one vector, returned in the `StepResult`
    of the step that runs its last chunk (`StepResult.embeddings`)."""


class ExtendChunk(msgspec.Struct, array_like=True):
    """Prompt tokens a prefilling row runs this step, starting at its current length."""

    slot: int
    token_ids: bytes
    """int32 token ids."""
    is_last: bool
    """The prompt ends with this chunk: sample the first output token, start decoding."""
    score_from: int = -1
    """Index in token_ids of the first position whose logits score the prompt token after
    it (prompt logprobs, trident/wire/logprobs.py); -1: this chunk scores nothing."""
    score_targets: bytes = b""
    """int32 prompt tokens scored, one per position from score_from on: token_ids[score_from
    + 1:], then, for a chunk that is not the last, the first token of the row's next chunk
    (the scheduler holds the whole prompt, the worker only this chunk)."""


class PageAppends(msgspec.Struct, array_like=True, omit_defaults=True):
    """Pages rows gained since the previous step, column-wise (every field int32 bytes).

    Row i of these columns appends the next `counts[i]` ids of `page_ids` (one id if
    `counts` is empty) to the page table of slot `slots[i]`, starting at index
    `first_index[i]`. Written by the scheduler (one
    numpy pass over the batch: with page size 1 every decoding row gains a page every
    step, and a struct per row cost more than the rest of the step); applied by the
    worker's BatchState in one scatter."""

    slots: bytes = b""
    first_index: bytes = b""
    page_ids: bytes = b""
    counts: bytes = b""
    """Empty when every row gains one page (the decode step at page size 1)."""

    def __post_init__(self) -> None:
        """Runs on decode too: columns that disagree make the frame fail to decode."""
        if any(len(b) % 4 for b in (self.slots, self.first_index, self.counts, self.page_ids)):
            raise ValueError("page append columns must be int32")
        if len(self.slots) != len(self.first_index):
            raise ValueError("page append columns differ in length")
        if not self.counts:
            if len(self.page_ids) != len(self.slots):
                raise ValueError("one page per row, but page ids and rows differ in number")
            return
        counts = np.frombuffer(self.counts, dtype="<i4")
        if len(self.counts) != len(self.slots) or (counts < 0).any() or int(counts.sum()) * 4 != len(self.page_ids):
            raise ValueError("page append counts do not add up to the page ids")

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[int, int, Sequence[int]]]) -> PageAppends:
        """From (slot, first index, page ids) per row: for tests and tools."""
        rows = [r for r in rows if len(r[2])]
        return cls.of_columns(
            [r[0] for r in rows], [r[1] for r in rows], [int(p) for r in rows for p in r[2]], [len(r[2]) for r in rows]
        )

    @classmethod
    def of_columns(
        cls, slots: list[int], first_index: list[int], page_ids: list[int], counts: list[int]
    ) -> PageAppends:
        if not slots:
            return cls()
        one_each = len(page_ids) == len(slots)
        return cls(
            pack_int32(slots), pack_int32(first_index), pack_int32(page_ids), b"" if one_each else pack_int32(counts)
        )

    def scatter_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slot, page-table column, page id) of every appended page."""
        ids = np.frombuffer(self.page_ids, dtype="<i4")
        if not self.counts:
            return np.frombuffer(self.slots, dtype="<i4"), np.frombuffer(self.first_index, dtype="<i4"), ids
        counts = np.frombuffer(self.counts, dtype="<i4").astype(np.int64)
        slots = np.repeat(np.frombuffer(self.slots, dtype="<i4"), counts)
        # Column of page j of row i: first_index[i] + j, with j counted from the row's start.
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        cols = np.repeat(np.frombuffer(self.first_index, dtype="<i4"), counts) + np.arange(len(ids)) - starts
        return slots, cols, ids


class BatchDescriptor(msgspec.Struct, array_like=True, tag="batch"):
    """What changed since the previous step; encoded once, sent to every rank."""

    step_id: int
    """Monotonic from 1; a worker that sees a gap stops instead of using stale state."""
    forward_mode: int
    removed_slots: list[int]
    added: list[AddedRequest]
    page_appends: PageAppends
    extends: list[ExtendChunk]
    seq_lens_sum: int
    """Sum of the batch's seq_lens before this step (the scheduler's mirror, refreshed
    through refresh_seq_lens_cpu); sizes the worker's attention index buffer."""


class ResetBatch(msgspec.Struct, array_like=True, tag="reset"):
    """Drop every row (a scheduler that just started); step ids restart at `next_step_id`.
    The worker answers with WorkerReady."""

    next_step_id: int


WorkerInput = BatchDescriptor | ResetBatch


class WorkerReady(msgspec.Struct, array_like=True, tag="worker_ready"):
    """Rank 0's first frame, and its answer to every ResetBatch: its protocol version and
    what it allocated."""

    protocol_version: int
    rank: int
    num_pages: int
    page_size: int
    vocab_size: int
    context_length: int
    eos_token_ids: list[int]
    max_running_requests: int
    generation: int = 0
    """Which start of the replica's worker group sent this (launch.py's count, from
    WORKER_GENERATION_ENV; 0 for a worker not started by launch.py). Written by the worker.
    A scheduler that lost generation g accepts only a ready of a later one: the lost group
    answers the reconnection ResetBatch (or a forged one) before launch.py kills it, and a
    scheduler that took that answer would send its steps to a group about to vanish."""


class WorkerCounters(msgspec.Struct, array_like=True):
    """Cumulative counters of the worker, owned by it, mirrored into scheduler stats."""

    steps: int = 0
    prefill_tokens_computed: int = 0
    seq_lens_d2h_copies: int = 0
    """Copies of device seq_lens to the host made for the sync point (one per overlapped step)."""
    dropped_frames: int = 0
    """Frames this rank could not decode and dropped, plus descriptors it refused for an
    index out of range (gpu_worker/runtime/batch_state.py check_ranges)."""
    busy_s: float = 0.0
    """Seconds spent running steps (apply, forward, sample, reply)."""
    idle_s: float = 0.0
    """Seconds spent waiting for the next descriptor while requests were running."""
    cpu_s: float = 0.0
    """CPU seconds of the worker process, all its threads, over those steps. cpu_s / busy_s
    is how many cores the steps kept: a step slower served than alone at the same CPU
    seconds was kept off its cores by other processes; with more, it computed (or spun
    waiting) longer on them."""


class RowLogprobs(msgspec.Struct, array_like=True):
    token_logprob: float
    top: list[tuple[int, float]]


class Embeddings(msgspec.Struct, array_like=True):
    """The pooled vectors of the embedding rows (`AddedRequest.pooled`) whose last prompt
    chunk ran in a step. Written by rank 0 (gpu_worker/runtime/pooling.py), read by the
    scheduler, which passes each vector on to its request's `RowExtras.embedding`."""

    dim: int
    """Floats per vector (the model's hidden size)."""
    vectors: bytes
    """Little-endian float32, one L2-normalized vector of `dim` per such row, back to back,
    in batch order."""

    def __post_init__(self) -> None:
        """Runs on decode too: a frame whose vectors do not split into rows fails to decode."""
        if self.dim < 1 or len(self.vectors) % (4 * self.dim):
            raise ValueError(f"{len(self.vectors)} bytes of vectors do not split into float32 rows of {self.dim}")

    @property
    def rows(self) -> int:
        return len(self.vectors) // (4 * self.dim)

    def row(self, i: int) -> bytes:
        """Vector i as its little-endian float32 bytes."""
        size = 4 * self.dim
        return self.vectors[i * size : (i + 1) * size]


class StepResult(msgspec.Struct, array_like=True, tag="result"):
    """The outcome of one step, from rank 0."""

    step_id: int
    next_token_ids: bytes
    """int32, one per sampling row, in batch order."""
    counters: WorkerCounters
    forward_time_s: float
    logprobs: list[RowLogprobs | None] = []
    """Per sampling row when any row asked for logprobs, else empty."""
    accept_lens: bytes = b""
    """int32 tokens per sampling row (speculative decoding: 1 + accepted drafts); empty
    means one token per row. next_token_ids holds them back to back."""
    seq_lens: bytes | None = None
    """int32 device seq_lens of the batch rows after the step (only with --check-seq-lens)."""
    embeddings: Embeddings | None = None
    """The vectors of the embedding rows whose prompt ended this step; None when none did."""
    prompt_logprobs: list[PromptLogprobs] = []
    """One per `ExtendChunk` with score targets, in the descriptor's order."""


class SeqLensSync(msgspec.Struct, array_like=True, tag="seq_lens_sync"):
    """The one device-to-host copy of seq_lens on the overlapped path (docs/design.md §4)."""

    step_id: int
    seq_lens: bytes
    seq_lens_sum: int


class WorkerError(msgspec.Struct, array_like=True, tag="worker_error"):
    """The worker could not run a step; `error` is the reason."""

    step_id: int
    error: str


SchedulerReply = WorkerReady | StepResult | SeqLensSync | WorkerError
