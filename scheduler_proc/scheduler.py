"""The scheduler process: request queue, continuous batching, KV ownership, its loops.

Two loops sit side by side. The plain loop builds a step, sends it, waits for its result
and processes it. The overlap loop builds and sends step N+1 before it processes step N,
so the worker never waits for the scheduler; tokens of step N that step N+1 needs are
resolved by the worker from its own state (the descriptor never carries them).
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np

from scheduler_proc.io import SchedulerIO
from scheduler_proc.kv_cache import KVCacheManager
from scheduler_proc.output import finished_alone, take_step_embeddings, take_step_tokens, unreadable_request
from scheduler_proc.prefill import PrefillPlanner, WaitingQueue
from scheduler_proc.prompt_logprobs import take_prompt_logprobs
from scheduler_proc.request import FinishReason, Req
from scheduler_proc.schedule_batch import ScheduleBatch, check_seq_lens
from scheduler_proc.stats import SchedulerCounters
from scheduler_proc.worker_link import Step, WorkerLink, WorkerLost
from trident.wire.backend import ForwardMode, StepResult, WorkerReady
from trident.wire.child import ChildContext
from trident.wire.codec import UnreadableRequest, unpack_int32
from trident.wire.control import PROTOCOL_VERSION, check_protocol_version
from trident.wire.frontend import (
    AbortReq,
    EmbedReq,
    FlushCacheDone,
    FlushCacheReq,
    GenerateReq,
    SamplingParams,
    ServerInfo,
    TokenizerHello,
    WorkerGroupLost,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100


class Scheduler:
    def __init__(self, ctx: ChildContext) -> None:
        self.ctx = ctx
        self.args = args = ctx.args
        self.boot_id = uuid.uuid4().hex
        self.io = SchedulerIO(ctx)
        self.reqs: dict[str, Req] = {}
        self.tokenizer_pid: int | None = None
        self.num_draft_tokens = args.speculative_num_draft_tokens if args.speculative_algorithm else 0
        self.waiting = WaitingQueue(args.schedule_policy)
        self.counters = SchedulerCounters(self)
        self.install_workers(self.io.connect_workers(args.startup_timeout_s))
        # A restarted scheduler announces itself: the tokenizer resubmits what it still holds.
        self.io.tokenizer.send(self.server_info())

    def install_workers(self, ready: WorkerReady) -> None:
        """Fresh KV bookkeeping and an empty batch for a worker group that just reported ready."""
        self.worker = ready
        self.eos_ids = frozenset(ready.eos_token_ids)
        self.kv = KVCacheManager(ready.num_pages, ready.page_size, self.args.disable_radix_cache)
        self.waiting.kv = self.kv
        self.prefill = PrefillPlanner(
            self.kv,
            self.args.max_prefill_tokens,
            self.args.chunked_prefill_size,
            self.args.max_running_requests,
            self.args.pooling,
        )
        self.batch = ScheduleBatch()
        self.next_step_id = 1
        self.link = WorkerLink(self.ctx, self.io, self.counters, self.handle_requests)

    # ------------------------------------------------------------------ loops

    def run(self) -> None:
        loop = self.event_loop_normal if self.args.disable_overlap else self.event_loop_overlap
        while True:
            try:
                loop()
            except WorkerLost as e:
                self.recover_from_worker_loss(str(e))

    def event_loop_normal(self) -> None:
        while True:
            self.recv_requests(block=not self.has_work())
            step = self.schedule_step()
            if step is None:
                continue
            self.launch(step)
            self.process_result(*self.link.wait_result())

    def event_loop_overlap(self) -> None:
        while True:
            self.recv_requests(block=not self.has_work() and not self.link.in_flight)
            step = self.schedule_step()
            if step is not None:
                self.launch(step)
            # Step N+1 is on the worker: now process step N.
            if len(self.link.in_flight) > (1 if step is not None else 0):
                self.process_result(*self.link.wait_result())

    # ------------------------------------------------------------------ receive

    def has_work(self) -> bool:
        return bool(self.batch.reqs) or bool(self.waiting)

    def recv_requests(self, block: bool) -> None:
        msgs = self.io.requests.recv_nowait()
        if not msgs and block:
            if self.io.recorder is not None:
                self.io.recorder.flush()
            first = self.io.requests.recv(timeout_ms=IDLE_POLL_MS)
            msgs = ([first] if first is not None else []) + self.io.requests.recv_nowait()
        self.handle_requests(msgs)
        self.counters.maybe_publish()

    def handle_requests(self, msgs: list) -> None:
        """Takes in every message; a WorkerGroupLost among them is raised only after the rest,
        so that the requests queued behind it are not dropped with it."""
        lost = None
        for msg in msgs:
            try:
                self.handle_request(msg)
            except WorkerLost as e:
                lost = e
        if lost is not None:
            raise lost

    def handle_request(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            self.handle_generate(msg)
        elif isinstance(msg, EmbedReq):
            self.handle_embed(msg)
        elif isinstance(msg, AbortReq):
            self.handle_abort(msg.rid)
        elif isinstance(msg, TokenizerHello):
            self.handle_tokenizer_hello(msg)
        elif isinstance(msg, FlushCacheReq):
            self.handle_flush()
        elif isinstance(msg, UnreadableRequest):
            self.io.tokenizer.send(unreadable_request(msg.rid, msg.why))
        elif isinstance(msg, WorkerGroupLost):
            if msg.generation < self.worker.generation:
                # The scheduler found that loss itself and is connected to the replacement.
                logger.info("worker group %d, already replaced, was lost: %s", msg.generation, msg.reason)
                return
            raise WorkerLost(f"launch.py reports the worker group lost: {msg.reason}")

    def handle_tokenizer_hello(self, msg: TokenizerHello) -> None:
        check_protocol_version("tokenizer", msg.protocol_version)
        # Only a starting tokenizer says hello, so one whose pid is not the one we know is new:
        # the old one's clients are gone, so is their work. A restarted scheduler knows no pid
        # yet, and holds what the old tokenizer resubmitted to it.
        if msg.pid != self.tokenizer_pid and self.reqs:
            logger.warning("tokenizer restarted (pid %d): aborting its %d open requests", msg.pid, len(self.reqs))
            for rid in list(self.reqs):
                self.handle_abort(rid)
        self.tokenizer_pid = msg.pid
        self.io.tokenizer.send(self.server_info())

    def server_info(self) -> ServerInfo:
        w = self.worker
        # A request that cannot fit the KV pool alone can never run: advertise the smaller
        # limit, so the tokenizer answers such prompts with a 400 at admission.
        return ServerInfo(
            PROTOCOL_VERSION,
            min(w.context_length, self.kv.total_tokens),
            w.vocab_size,
            self.args.max_running_requests,
            self.kv.total_tokens,
            list(w.eos_token_ids),
            self.boot_id,
            self.ctx.dp_rank,
        )

    def handle_generate(self, msg: GenerateReq) -> None:
        if msg.scheduler_boot_id and msg.scheduler_boot_id != self.boot_id:
            # Sent to a predecessor that died first; the tokenizer resubmits it to this boot.
            self.counters.stale_requests += 1
            return
        req = Req(
            msg.rid,
            unpack_int32(msg.input_ids).copy(),
            msg.sampling,
            self.eos_ids,
            self.worker.context_length,
            unpack_int32(msg.resumed_ids).tolist(),
            cache_salt=msg.cache_salt,
            priority=msg.priority,
        )
        self.admit(req, need=len(req.prompt_ids) + 1)

    def handle_embed(self, msg: EmbedReq) -> None:
        """An embedding request: queued like a prompt, it needs KV for its prompt alone.

        It shares the radix cache as a prompt does: with last-token pooling it takes a cached
        prefix (embedding models prefix every query with the same instruction, whose KV is then
        computed once) and, like any request, offers the KV it wrote when it leaves; LRU
        eviction drops one-off documents first. With mean pooling it takes none (prefill.py)."""
        if msg.scheduler_boot_id and msg.scheduler_boot_id != self.boot_id:
            self.counters.stale_requests += 1
            return
        ids = unpack_int32(msg.input_ids).copy()
        req = Req(
            msg.rid, ids, SamplingParams(max_new_tokens=0), context_length=self.worker.context_length, embedding=True
        )
        self.admit(req, need=len(ids))

    def admit(self, req: Req, need: int) -> None:
        """Queues a new request, or finishes it at once with an error when it cannot run:
        `need` is the KV it takes (its prompt, plus its first output if it generates)."""
        if req.rid in self.reqs:
            req.finish(FinishReason.ERROR, f"request id {req.rid!r} is already running")
        elif len(req.prompt_ids) == 0 or need > self.worker.context_length or need > self.kv.total_tokens:
            req.finish(
                FinishReason.ERROR,
                f"prompt of {len(req.prompt_ids)} tokens does not fit the "
                f"context ({self.worker.context_length}) or the KV pool ({self.kv.total_tokens})",
            )
        if req.finished:
            self.io.tokenizer.send(finished_alone(req))
            return
        self.reqs[req.rid] = req
        self.waiting.push(req)
        self.counters.totals.prompt_tokens += len(req.prompt_ids)

    def handle_abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        req.finish(FinishReason.ABORT)
        self.io.tokenizer.send(finished_alone(req))
        if self.waiting.remove(rid) is not None:
            self.reqs.pop(rid, None)
        # A running request leaves the batch when the next step is built.

    def handle_flush(self) -> None:
        if self.batch.reqs or self.waiting or self.link.in_flight:
            self.io.tokenizer.send(
                FlushCacheDone(False, "cannot flush the cache while requests are running", self.ctx.dp_rank)
            )
            return
        self.kv.flush()
        self.io.tokenizer.send(FlushCacheDone(True, "", self.ctx.dp_rank))

    # ------------------------------------------------------------------ schedule

    def schedule_step(self) -> Step | None:
        """Builds the next descriptor: sync the mirror, drop finished rows, grow decodes, add prefill."""
        t0 = time.perf_counter()
        if self.link.in_flight and self.is_overlapped(self.link.in_flight[-1]):
            self.apply_seq_lens_sync(self.link.in_flight[-1])
        self.remove_rows([r for r in self.batch.reqs if r.finish_reason is not None or r.ends_with_steps_in_flight()])
        decoding = self.reserve_decode_pages()
        self.batch.prepare_for_decode(decoding)
        self.prefill.plan(self.batch, self.waiting, decoding)
        if not self.batch.reqs:
            return None  # rows that left are told with the next descriptor
        rows = np.flatnonzero(self.batch.sampling_mask)
        sampling = [self.batch.reqs[i] for i in rows.tolist()]
        pooling = self.batch.pooling_reqs
        for req in sampling + pooling:
            req.pending_results += 1
        increments = self.batch.step_increments.copy()
        scoring, row_by_row = self.batch.scoring_reqs, self.batch.first_outputs_row_by_row
        desc = self.batch.build_descriptor(self.next_step_id)
        self.next_step_id += 1
        return Step(
            desc,
            sampling,
            rows,
            self.batch.seq_lens_cpu.copy(),
            increments,
            pooling_reqs=pooling,
            scoring_reqs=scoring,
            row_by_row=row_by_row,
            build_s=time.perf_counter() - t0,
        )

    def decoding_rows(self) -> np.ndarray:
        reqs = self.batch.reqs
        return np.fromiter((r.decoding for r in reqs), dtype=bool, count=len(reqs))

    def reserve_decode_pages(self) -> np.ndarray:
        """Every decoding row needs room for one more token: one allocation for all of them,
        or, if the pool is short, row by row, retracting rows until the rest fit. Returns
        which rows decode (after any retraction)."""
        decoding = self.decoding_rows()
        rows = np.flatnonzero(decoding)
        reqs = [self.batch.reqs[i] for i in rows.tolist()]
        rooms = np.fromiter((self.draft_room(r) for r in reqs), np.int64, len(reqs)) if self.num_draft_tokens else 1
        if self.kv.grow_rows(reqs, self.batch.seq_lens_cpu[rows] + rooms):
            return decoding
        i = 0
        while i < len(self.batch.reqs):
            req = self.batch.reqs[i]
            if not req.decoding or self.kv.grow(req, self.batch.seq_len(i) + self.draft_room(req)):
                i += 1
                continue
            if len(self.batch.reqs) == 1:
                req.finish(FinishReason.ERROR, "the KV pool is too small for this request")
                self.io.tokenizer.send(finished_alone(req))
                self.remove_rows([req])
                break
            self.retract(max(self.batch.reqs, key=lambda r: (r.priority, r.remaining_new_tokens(), r.arrival_time)))
            i = 0  # rows moved; rows already grown pass straight through
        return self.decoding_rows()

    def retract(self, req: Req) -> None:
        logger.warning(
            "KV pool short: retracting %s (%d tokens generated) back to the queue", req.rid, len(req.output_ids)
        )
        self.remove_rows([req])
        req.decoding = False
        req.num_retractions += 1
        self.counters.totals.retractions += 1
        self.waiting.push_front(req)

    def remove_rows(self, reqs: list[Req]) -> None:
        if not reqs:
            return
        for req in reqs:
            index = self.batch.reqs.index(req)
            self.kv.release(req, self.batch.seq_len(index))
        self.batch.filter_batch(reqs)
        for req in reqs:
            self.prefill.release_slot(req)
            if req.finished:
                self.reqs.pop(req.rid, None)

    # ------------------------------------------------------------------ launch and results

    def launch(self, step: Step) -> None:
        self.link.send(step)
        self.counters.totals.overlapped_steps += self.is_overlapped(step)

    def recover_from_worker_loss(self, reason: str) -> None:
        """Every running request goes back to the front of the queue as a prefill of its
        prompt plus the tokens it already produced; KV and prefix cache start empty.

        Running means in the batch, or owed a token by a step that was in flight: a request
        whose last tokens are in flight has already left the batch (`ends_with_steps_in_flight`)
        and would otherwise be held by nobody, its client never answered."""
        queued = set(self.waiting.queue)
        in_flight = [r for step in self.link.in_flight for r in step.sampling_reqs + step.pooling_reqs]
        running = [r for r in dict.fromkeys([*self.batch.reqs, *in_flight]) if not r.finished and r not in queued]
        for req in reversed(running):
            req.reset_kv_state()
            self.waiting.push_front(req)
        for req in self.waiting.queue:
            req.pending_results = 0
        # The lost group's rows are dropped whole: a finished one (aborted, or ended by a
        # processed step) was told already, and no remove_rows will forget it now.
        self.reqs = {rid: r for rid, r in self.reqs.items() if not r.finished}
        self.counters.totals.resumed_requests += len(running)
        logger.warning("worker group lost (%s): %d requests requeued; reconnecting", reason, len(running))
        self.install_workers(self.io.connect_workers(self.args.startup_timeout_s, newer_than=self.worker.generation))
        logger.warning("worker group back: %d requests resume from their prompt plus output", len(running))

    def is_overlapped(self, step: Step) -> bool:
        return not self.args.disable_overlap and step.descriptor.forward_mode in (ForwardMode.DECODE, ForwardMode.MIXED)

    def apply_seq_lens_sync(self, step: Step) -> None:
        """The one sync point: the worker's seq_lens before `step` ran (published before its
        forward), plus what the step adds, become the mirror. The batch has not changed since
        `step` was built, so the rows line up."""
        sync = self.link.wait_seq_lens_sync(step)
        self.counters.seq_lens_syncs += 1
        published = unpack_int32(sync.seq_lens).astype(np.int64) + step.increments
        if self.args.check_seq_lens and not self.num_draft_tokens:
            check_seq_lens(self.batch.seq_lens_cpu, published, sync.step_id)
        self.batch.refresh_seq_lens_cpu(sync=True, published=published)
        step.expected_seq_lens = published  # with drafts, the build-time guess was short
        self.trim_draft_pages()

    def draft_room(self, req: Req) -> int:
        """KV tokens a decoding row may need past its mirrored length for the next step."""
        if not self.num_draft_tokens or not req.sampling.drafts_allowed():
            return 1
        # Overlap: the step in flight may accept up to K+1 tokens the mirror does not know yet.
        k = self.num_draft_tokens
        return 1 + k + (0 if self.args.disable_overlap else k)

    def trim_draft_pages(self) -> None:
        """Frees pages reserved for drafts that were not accepted."""
        if not self.num_draft_tokens:
            return
        for i, req in enumerate(self.batch.reqs):
            if req.decoding:
                self.kv.trim(req, self.batch.seq_len(i) + self.draft_room(req))

    def process_result(self, step: Step, result: StepResult) -> None:
        self.io.record_result(result)
        self.counters.on_step(step, result)
        if self.args.check_seq_lens and result.seq_lens is not None:
            expected = step.expected_seq_lens.copy()
            if result.accept_lens:
                expected[step.sampling_rows] += unpack_int32(result.accept_lens) - 1
            check_seq_lens(expected, unpack_int32(result.seq_lens), result.step_id)
        if self.num_draft_tokens:
            counts = (
                unpack_int32(result.accept_lens) if result.accept_lens else np.ones(len(step.sampling_reqs), np.int32)
            )
            self.counters.on_drafts(counts)
            if self.args.disable_overlap:  # the CPU mirror is authoritative: correct it here
                self.batch.add_accepted_drafts(step.sampling_rows, counts.astype(np.int64) - 1)
                self.trim_draft_pages()
        take_prompt_logprobs(step.scoring_reqs, result)
        outputs = take_step_tokens(step.sampling_reqs, result, step.row_by_row)
        embedded = take_step_embeddings(step.pooling_reqs, result)
        for req in outputs.finished + embedded.finished:
            # No slot: it left the batch before this result (retracted into the queue, or
            # removed as ending with its steps in flight), so no later step will drop it.
            if req.slot is None:
                self.waiting.remove(req.rid)
                self.reqs.pop(req.rid, None)
        self.counters.totals.generation_tokens += outputs.tokens
        for batch in (outputs.batch, embedded.batch):
            if batch is not None:
                self.io.tokenizer.send(batch)
