"""Messages between the scheduler and the worker ranks.

scheduler -> every worker rank: `WorkerInput`, above all the `BatchDescriptor`, a *delta*
against the persistent batch the worker keeps (DESIGN.md §3). The batch order is the
contract both sides keep: `removed_slots` filter it (order preserved), `added` requests
are appended in order. Each step every *decoding* row computes one token; a *prefilling*
row computes only when an `ExtendChunk` names it. Rows that sample (decoding rows, and
prefilling rows whose chunk is the last) produce one token each, in batch order.

worker rank 0 -> scheduler: `SchedulerReply` (ready, seq_lens sync, step results).
"""

from __future__ import annotations

import enum

import msgspec

from wire.frontend import SamplingParams


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


class ExtendChunk(msgspec.Struct, array_like=True):
    """Prompt tokens a prefilling row runs this step, starting at its current length."""

    slot: int
    token_ids: bytes
    """int32 token ids."""
    is_last: bool
    """The prompt ends with this chunk: sample the first output token, start decoding."""


class PageAppend(msgspec.Struct, array_like=True):
    """Pages a row gained; sent only when a request's page count grows."""

    slot: int
    first_index: int
    """Index in the row's page table of the first page in page_ids."""
    page_ids: bytes
    """int32 page ids."""


class BatchDescriptor(msgspec.Struct, array_like=True, tag="batch"):
    """What changed since the previous step; encoded once, sent to every rank."""

    step_id: int
    """Monotonic from 1; a worker that sees a gap stops instead of using stale state."""
    forward_mode: int
    removed_slots: list[int]
    added: list[AddedRequest]
    page_appends: list[PageAppend]
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
    """The worker's first frame: its protocol version and what it allocated."""

    protocol_version: int
    rank: int
    num_pages: int
    page_size: int
    vocab_size: int
    context_length: int
    eos_token_ids: list[int]
    max_running_requests: int


class WorkerCounters(msgspec.Struct, array_like=True):
    """Cumulative counters of the worker, owned by it, mirrored into scheduler stats."""

    steps: int = 0
    prefill_tokens_computed: int = 0
    seq_lens_d2h_copies: int = 0
    """Copies of device seq_lens to the host made for the sync point (one per overlapped step)."""
    dropped_frames: int = 0
    """Frames this rank could not decode and dropped."""
    busy_s: float = 0.0
    """Seconds spent running steps (apply, forward, sample, reply)."""
    idle_s: float = 0.0
    """Seconds spent waiting for the next descriptor while requests were running."""


class RowLogprobs(msgspec.Struct, array_like=True):
    token_logprob: float
    top: list[tuple[int, float]]


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


class SeqLensSync(msgspec.Struct, array_like=True, tag="seq_lens_sync"):
    """The one device-to-host copy of seq_lens on the overlapped path (DESIGN.md §4)."""

    step_id: int
    seq_lens: bytes
    seq_lens_sum: int


class WorkerError(msgspec.Struct, array_like=True, tag="worker_error"):
    """The worker could not run a step; `error` is the reason."""

    step_id: int
    error: str


SchedulerReply = WorkerReady | StepResult | SeqLensSync | WorkerError
