"""What every worker does with descriptors, whatever computes its tokens.

Each step: receive a descriptor, apply the delta to the persistent batch, plan which rows
compute, (on the overlapped path) publish the one seq_lens sync, compute and sample,
advance, reply. Only rank 0 replies. The model worker (worker.py) and the simulated one
(simulated.py) differ only in `forward_and_sample` and a few hooks, so a scheduler driving
either is exercised the same way: the same BatchState, the same seq_lens contract, the
same replies.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from gpu_worker.runtime.batch_state import BatchState, DescriptorOutOfRange, StepGapError, StepPlan
from gpu_worker.runtime.ngram_drafter import can_draft
from gpu_worker.runtime.pooling import Pooler
from gpu_worker.sim.step_profile import step_features
from trident.wire.backend import (
    BatchDescriptor,
    ForwardMode,
    ResetBatch,
    SeqLensSync,
    StepResult,
    WorkerCounters,
    WorkerError,
    WorkerInput,
    WorkerReady,
)
from trident.wire.child import ChildContext
from trident.wire.cluster import layout_of, signer_of
from trident.wire.codec import pack_int32
from trident.wire.control import PROTOCOL_VERSION, WORKER_GENERATION_ENV
from trident.wire.logprobs import PromptLogprobs
from trident.wire.transport import (
    PullSocket,
    PushSocket,
    endpoint,
    peer_id,
    scheduler_reply_endpoint,
    worker_endpoint,
)

logger = logging.getLogger(__name__)


def open_worker_inbox(ctx: ChildContext) -> PullSocket:
    """Descriptors from the scheduler: an ipc socket beside it, or, for a rank on another
    node, a signed tcp link to the scheduler's node that names this rank."""
    args, name = ctx.args, f"{ctx.name}.in"
    if layout_of(args).is_remote_rank(ctx.rank):
        address = layout_of(args).descriptor_address(ctx.dp_rank)
        return PullSocket(
            ctx.zmq_ctx, address, False, WorkerInput, name, signer_of(args), peer_id(ctx.dp_rank, ctx.rank)
        )
    return PullSocket(
        ctx.zmq_ctx, endpoint(args.run_dir, worker_endpoint(ctx.dp_rank, ctx.rank)), True, WorkerInput, name
    )


def open_reply_link(ctx: ChildContext) -> PushSocket:
    """Rank 0's results to the scheduler: ipc beside it, or signed tcp to the head when Ray
    placed the rank (it may be on any node)."""
    layout = layout_of(ctx.args)
    if layout.ranks_anywhere:
        return PushSocket(ctx.zmq_ctx, layout.reply_address(ctx.dp_rank), False, signer_of(ctx.args))
    return PushSocket(ctx.zmq_ctx, endpoint(ctx.args.run_dir, scheduler_reply_endpoint(ctx.dp_rank)), bind=False)


class WorkerLoop:
    """The descriptor loop. A subclass sets, before calling `open_sockets`: `state`, `pooler`,
    `num_pages`, `context_length`, `vocab_size`, `eos_token_ids`, `num_draft_tokens`."""

    state: BatchState
    pooler: Pooler
    num_pages: int
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    num_draft_tokens: int

    def __init__(self, ctx: ChildContext) -> None:
        self.args = ctx.args
        self.rank = ctx.rank
        self.counters = WorkerCounters()
        self.last_step_features = np.zeros(0)
        """The shape of the last step computed (step_profile.FEATURES); what profiles are fitted on."""
        self.step_started = 0.0
        """perf_counter() when the current step's descriptor began to be applied."""
        self.refused_descriptors = 0
        """Descriptors refused whole for an index out of range; counted as dropped frames."""
        self.generation = int(os.environ.get(WORKER_GENERATION_ENV) or 0)
        """Which start of this replica's worker group this worker belongs to (set by launch.py)."""

    def open_sockets(self, ctx: ChildContext) -> None:
        self.state.num_pages = self.num_pages
        self.inbox = open_worker_inbox(ctx)
        self.reply = open_reply_link(ctx) if ctx.rank == 0 else None

    # ------------------------------------------------------------------ hooks

    def agree_on_step(self, step_id: int, failed: bool) -> str | None:
        """Tensor-parallel ranks meet here before computing; a reason if they disagree."""
        return None

    def note_new_tokens(self, desc: BatchDescriptor, chunks: dict[int, tuple[np.ndarray, bool]]) -> None:
        """Prompt tokens and new rows this step brings (penalties, drafters)."""

    def draft_tokens(self, slot: int) -> np.ndarray:
        """Speculative draft tokens for a decoding row (only called with drafting on)."""
        raise NotImplementedError

    def propose_drafts(self) -> dict[int, np.ndarray]:
        """Drafts of the decoding rows that may draft, cut to the room left in their context."""
        if not self.num_draft_tokens:
            return {}
        drafts = {}
        for slot in self.state.order:
            if self.state.decoding[slot] and can_draft(self.state.sampling.params[slot]):
                room = self.context_length - int(self.state.row_lens_host[slot]) - 1
                draft = self.draft_tokens(slot)[: max(0, room)]
                if len(draft):
                    drafts[slot] = draft
        return drafts

    def forward_and_sample(self, plan: StepPlan | None) -> tuple[list[np.ndarray], list, list[PromptLogprobs]]:
        """Runs the plan and advances the batch; returns the accepted tokens of each sampling
        row, their logprobs, and the prompt logprobs of `plan.scored_chunks`. The embedding
        rows' final hidden states go to `pooler`."""
        raise NotImplementedError

    def on_reset(self) -> None:
        """Extra state to drop when the scheduler resets the batch."""

    def summary(self) -> str:
        """What this worker runs, for its ready line."""
        raise NotImplementedError

    # ------------------------------------------------------------------ loop

    def ready_message(self) -> WorkerReady:
        return WorkerReady(
            protocol_version=PROTOCOL_VERSION,
            rank=self.rank,
            num_pages=self.num_pages,
            page_size=self.args.page_size,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            eos_token_ids=list(self.eos_token_ids),
            max_running_requests=self.args.max_running_requests,
            generation=self.generation,
        )

    def run_forever(self) -> None:
        self._send(self.ready_message())
        while True:
            wait_start = time.perf_counter()
            msg = self.inbox.recv()
            step_start, cpu_start = time.perf_counter(), time.process_time()
            if isinstance(msg, BatchDescriptor):
                if self.state.order:  # waiting with rows in the batch is time the scheduler cost
                    self.counters.idle_s += step_start - wait_start
                result = self.step(msg)
                self.counters.busy_s += time.perf_counter() - step_start
                self.counters.cpu_s += time.process_time() - cpu_start
                if isinstance(result, StepResult):
                    c = result.counters
                    c.busy_s, c.idle_s, c.cpu_s = self.counters.busy_s, self.counters.idle_s, self.counters.cpu_s
                self._send(result)
            elif isinstance(msg, ResetBatch):
                self.state.reset(msg.next_step_id)
                self.on_reset()
                self._send(self.ready_message())

    def step(self, desc: BatchDescriptor) -> StepResult | WorkerError:
        self.step_started = time.perf_counter()
        failure = None
        try:
            chunks = self.state.apply(desc)
        except (StepGapError, DescriptorOutOfRange) as e:
            # Refused before any state changed, and before meeting the other ranks (each refuses
            # the same bytes alike): a stale or forged frame is a no-op here. A rank that really
            # missed a step never meets its peers again; they time out (or the scheduler's
            # watchdog restarts the group). The scheduler acts on the error only for a step it sent.
            logger.error("step %d rejected: %s", desc.step_id, e)
            self.refused_descriptors += isinstance(e, DescriptorOutOfRange)
            return WorkerError(desc.step_id, str(e))
        except Exception as e:  # a bad delta: refuse rather than compute on stale state
            failure = str(e)
        # Every rank that accepted the step id meets here, failed or not: none computes alone.
        disagreement = self.agree_on_step(desc.step_id, failed=failure is not None)
        error = failure or disagreement
        if error is not None:
            logger.error("step %d rejected: %s", desc.step_id, error)
            return WorkerError(desc.step_id, error)
        t0 = time.perf_counter()
        self.note_new_tokens(desc, chunks)
        plan = self.state.plan_step(chunks, self.propose_drafts())
        self.last_step_features = step_features(self.state.row_lens_host, plan)
        if self._is_overlapped(desc):
            self._publish_seq_lens_sync(desc.step_id)
        accepted, logprobs, prompt_logprobs = self.forward_and_sample(plan)
        if plan is not None:
            self.counters.prefill_tokens_computed += plan.num_prefill_tokens
        self.counters.steps += 1
        seq_lens = None
        if self.args.check_seq_lens:
            try:
                if not self.num_draft_tokens:  # with drafts the descriptor's sum is an estimate
                    self.state.check_seq_lens_sum(desc)
            except Exception as e:
                logger.error("%s", e)
                return WorkerError(desc.step_id, str(e))
            seq_lens = pack_int32(self.state.copy_seq_lens_to_host(for_debug_check=True))
        self.counters.seq_lens_d2h_copies = self.state.seq_lens_d2h_copies
        self.counters.dropped_frames = self.inbox.dropped + self.refused_descriptors
        flat = np.concatenate(accepted) if accepted else np.zeros(0, dtype=np.int64)
        return StepResult(
            step_id=desc.step_id,
            next_token_ids=pack_int32(flat),
            counters=WorkerCounters(**{f: getattr(self.counters, f) for f in WorkerCounters.__struct_fields__}),
            forward_time_s=time.perf_counter() - t0,
            logprobs=logprobs,
            accept_lens=pack_int32([len(a) for a in accepted]) if self.num_draft_tokens else b"",
            seq_lens=seq_lens,
            embeddings=self.pooler.take(),
            prompt_logprobs=prompt_logprobs,
        )

    def _is_overlapped(self, desc: BatchDescriptor) -> bool:
        return not self.args.disable_overlap and desc.forward_mode in (ForwardMode.DECODE, ForwardMode.MIXED)

    def _publish_seq_lens_sync(self, step_id: int) -> None:
        """The single sync point: one device-to-host copy, before the overlapped forward."""
        host = self.state.copy_seq_lens_to_host()
        self._send(SeqLensSync(step_id, pack_int32(host), int(host.sum())))

    def _send(self, msg) -> None:
        if self.reply is not None:
            self.reply.send(msg)
