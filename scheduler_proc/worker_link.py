"""The scheduler's side of one worker group: the steps in flight and the replies about them.

Owns `in_flight` (steps sent whose result is not processed yet, oldest first; with overlap
up to two) and the `SeqLensSync` frames that arrived before they were asked for. Decides
when the group is lost: a `WorkerError` about a step in flight, or no reply within the
watchdog time (then launch.py is told to restart the group). A reply that cannot be the
answer it claims to be (about no step in flight, out of order, or with rows and tokens that
do not fit its step) is refused and counted, never used: a worker cannot send one, so it is
stale or forged, and if the worker really broke, the watchdog still acts. A new link is
made for every worker group, so nothing of a lost group's steps survives into the next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler_proc.io import SchedulerIO
from scheduler_proc.output import embeddings_mismatch, result_mismatch
from scheduler_proc.prompt_logprobs import scoring_mismatch
from scheduler_proc.request import Req
from scheduler_proc.stats import SchedulerCounters
from trident.wire.backend import BatchDescriptor, SeqLensSync, StepResult, WorkerError, WorkerReady
from trident.wire.child import ChildContext
from trident.wire.control import RestartWorkers

logger = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """The worker group died, hung, or answered out of step: requeue and reconnect."""


@dataclass
class Step:
    """A step in flight: what was sent and who samples in it."""

    descriptor: BatchDescriptor
    sampling_reqs: list[Req]
    sampling_rows: np.ndarray
    """Batch index of each sampling request at build time."""
    expected_seq_lens: np.ndarray
    """The mirror after this step (one token per decoding row), for --check-seq-lens."""
    increments: np.ndarray
    """What this step adds to each row as built (chunk length, or 1 per decoding row)."""
    pooling_reqs: list[Req] = field(default_factory=list)
    """Embedding requests whose last prompt chunk runs in this step, in batch order: the
    step's `StepResult.embeddings` holds their vectors."""
    scoring_reqs: list[Req] = field(default_factory=list)
    """Requests whose chunk scores prompt tokens, in the descriptor's chunk order."""
    row_by_row: bool = False
    """Its results are taken row by row (`ScheduleBatch.first_outputs_row_by_row`)."""
    build_s: float = 0.0
    """Scheduler CPU time spent building this step."""
    sent_at: float = field(default_factory=time.perf_counter)


class WorkerLink:
    def __init__(
        self,
        ctx: ChildContext,
        io: SchedulerIO,
        counters: SchedulerCounters,
        on_requests: Callable[[list[Any]], None],
    ) -> None:
        self.ctx = ctx
        self.io = io
        self.counters = counters
        self.on_requests = on_requests
        """Takes in the requests that arrive while the scheduler waits for the worker."""
        self.watchdog_s = ctx.args.watchdog_timeout_s
        args = ctx.args
        self.max_tokens_per_row = 1 + (args.speculative_num_draft_tokens if args.speculative_algorithm else 0)
        """A sampling row's tokens in one step: its own plus every draft accepted."""
        self.in_flight: list[Step] = []
        self.pending_syncs: dict[int, SeqLensSync] = {}
        """SeqLensSync frames that arrived while waiting for a result, by step id."""

    def send(self, step: Step) -> None:
        self.io.send_to_workers(step.descriptor)
        self.in_flight.append(step)

    def wait_result(self) -> tuple[Step, StepResult]:
        """The result of the oldest step in flight, which leaves `in_flight`."""
        step = self.in_flight[0]
        while True:
            msg = self.next_reply()
            if isinstance(msg, StepResult):
                why = self.result_mismatch(step, msg)
                if why is not None:
                    # Forged, or a worker bug: either way no token of it is used. The real result
                    # may still come; if it never does, the watchdog restarts the group.
                    self.counters.refused_results += 1
                    logger.error("refusing the result of step %d: %s", msg.step_id, why)
                    continue
                self.in_flight.pop(0)
                return step, msg
            self.pending_syncs[msg.step_id] = msg

    def result_mismatch(self, step: Step, result: StepResult) -> str | None:
        """Why `result` is not the answer to `step`, the oldest step in flight (None if it is).
        A worker answers in order, so a result naming a later step was not sent by it."""
        if result.step_id != step.descriptor.step_id:
            return f"it names step {result.step_id} while step {step.descriptor.step_id} is the oldest in flight"
        return (
            result_mismatch(len(step.sampling_reqs), len(step.expected_seq_lens), result, self.max_tokens_per_row)
            or embeddings_mismatch(len(step.pooling_reqs), result)
            or scoring_mismatch(step.descriptor.extends, result)
        )

    def wait_seq_lens_sync(self, step: Step) -> SeqLensSync:
        """The worker's seq_lens as `step` started (published before its forward)."""
        while step.descriptor.step_id not in self.pending_syncs:
            msg = self.next_reply()
            if isinstance(msg, StepResult):
                # Only the in-flight step's own sync can be owed here, and a worker publishes
                # it before that step's result: this one was not sent by the worker.
                self.counters.refused_results += 1
                logger.error("refusing a result of step %d that came before its seq_lens sync", msg.step_id)
                continue
            self.pending_syncs[msg.step_id] = msg
        return self.pending_syncs.pop(step.descriptor.step_id)

    def next_reply(self) -> StepResult | SeqLensSync:
        """The next reply about a step in flight. Requests that arrive meanwhile are taken in;
        replies about no step in flight (stale or forged) are counted and dropped; no reply
        within the watchdog time means a hung worker."""
        deadline = time.monotonic() + self.watchdog_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                self.ctx.tell_launcher(
                    RestartWorkers(f"no step progress for {self.watchdog_s:.0f} s", self.ctx.dp_rank)
                )
                raise WorkerLost(f"watchdog: no reply for {self.watchdog_s:.0f} s")
            reply_ready, request_ready = self.io.wait_any(left_ms)
            if request_ready:
                self.on_requests(self.io.requests.recv_nowait())
            msg = self.io.replies.recv(timeout_ms=0) if reply_ready else None
            if msg is None or isinstance(msg, WorkerReady):
                continue  # a WorkerReady here answers the ResetBatch sent at (re)connection
            step_id = getattr(msg, "step_id", None)
            if all(s.descriptor.step_id != step_id for s in self.in_flight):
                self.counters.ignored_replies += 1
                logger.warning("ignoring %s for step %s, which is not in flight", type(msg).__name__, step_id)
                continue
            if isinstance(msg, WorkerError):
                reason = f"worker rejected step {msg.step_id}: {msg.error}"
                self.ctx.tell_launcher(RestartWorkers(reason, self.ctx.dp_rank))
                raise WorkerLost(reason)
            return msg
