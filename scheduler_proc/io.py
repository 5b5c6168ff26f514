"""The scheduler's sockets: requests in, token outputs out, descriptors to every rank,
replies from rank 0. No socket code lives in the loop."""

from __future__ import annotations

import time

import zmq

from wire.backend import ResetBatch, SchedulerReply, StepResult, WorkerReady
from wire.codec import FrameEncoder
from wire.control import check_protocol_version
from wire.frontend import SchedulerInput
from wire.recording import RECEIVED, SENT, RecordingWriter
from wire.server_args import ServerArgs
from wire.transport import (
    ENDPOINT_SCHEDULER_IN,
    ENDPOINT_SCHEDULER_REPLY,
    ENDPOINT_TOKENIZER_IN,
    PullSocket,
    PushSocket,
    endpoint,
    worker_endpoint,
)


class WorkerStartTimeout(RuntimeError):
    pass


class SchedulerIO:
    def __init__(self, ctx: zmq.Context, args: ServerArgs) -> None:
        run = args.run_dir
        self.requests = PullSocket(
            ctx, endpoint(run, ENDPOINT_SCHEDULER_IN), bind=True, union=SchedulerInput, name="scheduler.in"
        )
        self.tokenizer = PushSocket(ctx, endpoint(run, ENDPOINT_TOKENIZER_IN), bind=False)
        self.replies = PullSocket(
            ctx, endpoint(run, ENDPOINT_SCHEDULER_REPLY), bind=True, union=SchedulerReply, name="scheduler.reply"
        )
        self.workers = [PushSocket(ctx, endpoint(run, worker_endpoint(r)), bind=False) for r in range(args.tp_size)]
        self._encoder = FrameEncoder()
        self._poller = zmq.Poller()
        self._poller.register(self.replies.sock, zmq.POLLIN)
        self._poller.register(self.requests.sock, zmq.POLLIN)
        self.recorder = RecordingWriter(args.record_batches, args) if args.record_batches else None
        self.descriptor_bytes_sent = 0
        self.last_descriptor_bytes = 0

    def connect_workers(self, timeout_s: float) -> WorkerReady:
        """Resets every rank's batch and waits for rank 0's WorkerReady.

        Used at start (a restarted scheduler finds workers holding stale rows) and after the
        workers were restarted; replies of an earlier generation still queued are skipped.
        """
        self.send_to_workers(ResetBatch(next_step_id=1))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.replies.recv(timeout_ms=int(left * 1000) + 1)
            if isinstance(msg, WorkerReady):
                check_protocol_version("worker[tp0]", msg.protocol_version)
                return msg
        raise WorkerStartTimeout(f"worker rank 0 did not report ready within {timeout_s:.0f} s")

    def wait_any(self, timeout_ms: int) -> tuple[bool, bool]:
        """Blocks until a reply or a request is queued: (reply ready, request ready)."""
        events = dict(self._poller.poll(timeout_ms))
        return self.replies.sock in events, self.requests.sock in events

    def send_to_workers(self, msg) -> None:
        """Encodes once; every rank gets the same bytes."""
        frame = self._encoder.encode(msg)
        self.last_descriptor_bytes = len(frame)
        self.descriptor_bytes_sent += len(frame)
        for w in self.workers:
            w.send_bytes(frame)
        if self.recorder is not None:
            self.recorder.record(SENT, frame)

    def record_result(self, result: StepResult) -> None:
        if self.recorder is not None:
            self.recorder.record(RECEIVED, self._encoder.encode(result))

    @property
    def dropped_frames(self) -> int:
        return self.requests.dropped + self.replies.dropped
