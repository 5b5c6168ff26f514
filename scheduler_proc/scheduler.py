"""The scheduler process: request queue, continuous batching, KV ownership, its loops.

Two loops sit side by side. The plain loop builds a step, sends it, waits for its result
and processes it. The overlap loop builds and sends step N+1 before it processes step N,
so the worker never waits for the scheduler; tokens of step N that step N+1 needs are
resolved by the worker from its own state (the descriptor never carries them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from scheduler_proc.io import SchedulerIO
from scheduler_proc.kv_cache import KVCacheManager
from scheduler_proc.output import append_token, token_out
from scheduler_proc.prefill import PrefillPlanner, WaitingQueue
from scheduler_proc.request import FinishReason, Req
from scheduler_proc.schedule_batch import ScheduleBatch, check_seq_lens
from scheduler_proc.stats import SchedulerCounters
from wire.backend import (
    BatchDescriptor, PageAppend, SeqLensSync, Shutdown, StepResult, WorkerError, WorkerReady,
)
from wire.child import ChildContext
from wire.codec import pack_int32, unpack_int32
from wire.control import PROTOCOL_VERSION, check_protocol_version
from wire.frontend import (
    AbortReq, FlushCacheDone, FlushCacheReq, GenerateReq, ServerInfo, TokenizerHello, TokenOut, TokenOutBatch,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100


class WorkerFailed(RuntimeError):
    pass


@dataclass
class Step:
    """A step in flight: what was sent and who samples in it."""

    descriptor: BatchDescriptor
    sampling_reqs: list[Req]
    expected_seq_lens: np.ndarray
    """The mirror after this step, kept for --check-seq-lens."""
    sent_at: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, ctx: ChildContext) -> None:
        self.args = args = ctx.args
        self.io = SchedulerIO(ctx.zmq_ctx, args)
        self.worker: WorkerReady = self.io.wait_worker_ready(args.startup_timeout_s)
        self.eos_ids = frozenset(self.worker.eos_token_ids)
        self.kv = KVCacheManager(self.worker.num_pages, self.worker.page_size, args.disable_radix_cache)
        self.waiting = WaitingQueue(args.schedule_policy, self.kv)
        self.prefill = PrefillPlanner(self.kv, args.max_prefill_tokens, args.chunked_prefill_size,
                                      args.max_running_requests)
        self.batch = ScheduleBatch()
        self.reqs: dict[str, Req] = {}
        self.next_step_id = 1
        self.in_flight: list[Step] = []
        self.counters = SchedulerCounters(self)

    # ------------------------------------------------------------------ loops

    def event_loop_normal(self) -> None:
        while True:
            self.recv_requests(block=not self.has_work())
            step = self.schedule_step()
            if step is None:
                continue
            self.launch(step)
            self.process_result(self.wait_result())

    def event_loop_overlap(self) -> None:
        while True:
            self.recv_requests(block=not self.has_work() and not self.in_flight)
            step = self.schedule_step()
            if step is not None:
                self.launch(step)
            if len(self.in_flight) > (1 if step is not None else 0):
                self.process_result(self.wait_result())

    # ------------------------------------------------------------------ receive

    def has_work(self) -> bool:
        return bool(self.batch.reqs) or bool(self.waiting)

    def recv_requests(self, block: bool) -> None:
        msgs = self.io.requests.recv_nowait()
        if not msgs and block:
            first = self.io.requests.recv(timeout_ms=IDLE_POLL_MS)
            msgs = ([first] if first is not None else []) + self.io.requests.recv_nowait()
        for msg in msgs:
            if isinstance(msg, GenerateReq):
                self.handle_generate(msg)
            elif isinstance(msg, AbortReq):
                self.handle_abort(msg.rid)
            elif isinstance(msg, TokenizerHello):
                check_protocol_version("tokenizer", msg.protocol_version)
                self.io.tokenizer.send(self.server_info())
            elif isinstance(msg, FlushCacheReq):
                self.handle_flush()
        self.counters.maybe_publish()

    def server_info(self) -> ServerInfo:
        w = self.worker
        return ServerInfo(PROTOCOL_VERSION, w.context_length, w.vocab_size, self.args.max_running_requests,
                          self.kv.total_tokens, list(w.eos_token_ids))

    def handle_generate(self, msg: GenerateReq) -> None:
        req = Req(msg.rid, unpack_int32(msg.input_ids).copy(), msg.sampling)
        need = len(req.prompt_ids) + 1
        if msg.rid in self.reqs:
            req.finish(FinishReason.ERROR, f"request id {msg.rid!r} is already running")
        elif len(req.prompt_ids) == 0 or need > self.worker.context_length or need > self.kv.total_tokens:
            req.finish(FinishReason.ERROR, f"prompt of {len(req.prompt_ids)} tokens does not fit the "
                       f"context ({self.worker.context_length}) or the KV pool ({self.kv.total_tokens})")
        if req.finished:
            self.io.tokenizer.send(TokenOutBatch([token_out(req, [])]))
            return
        self.reqs[req.rid] = req
        self.waiting.push(req)
        self.counters.prompt_tokens += len(req.prompt_ids)

    def handle_abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        req.finish(FinishReason.ABORT)
        self.io.tokenizer.send(TokenOutBatch([token_out(req, [])]))
        if self.waiting.remove(rid) is not None:
            self.reqs.pop(rid, None)
        # A running request leaves the batch when the next step is built.

    def handle_flush(self) -> None:
        if self.batch.reqs or self.waiting or self.in_flight:
            self.io.tokenizer.send(FlushCacheDone(False, "cannot flush the cache while requests are running"))
            return
        self.kv.flush()
        self.io.tokenizer.send(FlushCacheDone(True))

    # ------------------------------------------------------------------ schedule

    def schedule_step(self) -> Step | None:
        """Builds the next descriptor: drop finished rows, grow decodes, add prefill."""
        self.remove_rows([r for r in self.batch.reqs if r.finished])
        self.reserve_decode_pages()
        self.batch.prepare_for_decode(np.asarray([r.decoding for r in self.batch.reqs], dtype=np.int64))
        self.prefill.plan(self.batch, self.waiting)
        if not self.batch.reqs:
            return None  # rows that left are told with the next descriptor
        sampling = [r for r in self.batch.reqs if r.decoding]
        for req in sampling:
            req.pending_results += 1
        desc = self.batch.build_descriptor(self.next_step_id, self.collect_page_appends())
        self.next_step_id += 1
        return Step(desc, sampling, self.batch.seq_lens_cpu.copy())

    def reserve_decode_pages(self) -> None:
        """Every decoding row needs room for one more token; retract rows if the pool is short."""
        i = 0
        while i < len(self.batch.reqs):
            req = self.batch.reqs[i]
            if not req.decoding or self.kv.grow(req, self.batch.seq_len(i) + 1):
                i += 1
                continue
            if len(self.batch.reqs) == 1:
                req.finish(FinishReason.ERROR, "the KV pool is too small for this request")
                self.io.tokenizer.send(TokenOutBatch([token_out(req, [])]))
                self.remove_rows([req])
                return
            self.retract(max(self.batch.reqs, key=lambda r: (r.remaining_new_tokens(), r.arrival_time)))
            i = 0  # rows moved; rows already grown pass straight through

    def retract(self, req: Req) -> None:
        logger.warning("KV pool short: retracting %s (%d tokens generated) back to the queue",
                       req.rid, len(req.output_ids))
        self.remove_rows([req])
        req.decoding = False
        req.num_retractions += 1
        self.counters.retractions += 1
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

    def collect_page_appends(self) -> list[PageAppend]:
        appends = []
        for req in self.batch.reqs:
            if len(req.pages) > req.pages_sent:
                appends.append(PageAppend(req.slot, req.pages_sent, pack_int32(req.pages[req.pages_sent :])))
                req.pages_sent = len(req.pages)
        return appends

    # ------------------------------------------------------------------ launch and results

    def launch(self, step: Step) -> None:
        self.io.send_to_workers(step.descriptor)
        self.in_flight.append(step)

    def wait_result(self) -> tuple[Step, StepResult]:
        step = self.in_flight.pop(0)
        while True:
            msg = self.io.replies.recv()
            if isinstance(msg, SeqLensSync):
                self.apply_seq_lens_sync(msg)
            elif isinstance(msg, WorkerError):
                raise WorkerFailed(f"worker rejected step {msg.step_id}: {msg.error}")
            elif isinstance(msg, StepResult):
                if msg.step_id != step.descriptor.step_id:
                    raise WorkerFailed(f"expected result of step {step.descriptor.step_id}, got {msg.step_id}")
                return step, msg

    def apply_seq_lens_sync(self, sync: SeqLensSync) -> None:
        self.counters.seq_lens_syncs += 1

    def process_result(self, done: tuple[Step, StepResult]) -> None:
        step, result = done
        self.counters.on_step(step, result)
        if self.args.check_seq_lens and result.seq_lens is not None:
            check_seq_lens(step.expected_seq_lens, unpack_int32(result.seq_lens), result.step_id)
        tokens = unpack_int32(result.next_token_ids).tolist()
        outputs: list[TokenOut] = []
        for i, (req, token) in enumerate(zip(step.sampling_reqs, tokens)):
            req.pending_results -= 1
            if req.finished:
                continue  # overlap ran one token past the finish (or an abort): discard it
            append_token(req, token, self.eos_ids, self.worker.context_length)
            self.counters.generation_tokens += 1
            lp = [result.logprobs[i]] if result.logprobs and result.logprobs[i] is not None else []
            outputs.append(token_out(req, lp))
            if req.finished and self.waiting.remove(req.rid) is not None:
                self.reqs.pop(req.rid, None)
        if outputs:
            self.io.tokenizer.send(TokenOutBatch(outputs))

    def shutdown(self) -> None:
        self.io.send_to_workers(Shutdown())
