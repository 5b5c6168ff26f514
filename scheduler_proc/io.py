"""The scheduler's sockets: requests in, token outputs out, descriptors to every rank,
replies from rank 0. No socket code lives in the loop."""

from __future__ import annotations

import zmq

from wire.backend import SchedulerReply, WorkerReady
from wire.codec import FrameEncoder
from wire.control import check_protocol_version
from wire.frontend import SchedulerInput
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
        self.descriptor_bytes_sent = 0
        self.last_descriptor_bytes = 0

    def wait_worker_ready(self, timeout_s: float) -> WorkerReady:
        msg = self.replies.recv(timeout_ms=int(timeout_s * 1000))
        if msg is None:
            raise WorkerStartTimeout(f"worker rank 0 did not report ready within {timeout_s:.0f} s")
        if not isinstance(msg, WorkerReady):
            raise RuntimeError(f"expected WorkerReady from the worker, got {type(msg).__name__}")
        check_protocol_version("worker[tp0]", msg.protocol_version)
        return msg

    def send_to_workers(self, msg) -> None:
        """Encodes once; every rank gets the same bytes."""
        frame = self._encoder.encode(msg)
        self.last_descriptor_bytes = len(frame)
        self.descriptor_bytes_sent += len(frame)
        for w in self.workers:
            w.send_bytes(frame)

    @property
    def dropped_frames(self) -> int:
        return self.requests.dropped + self.replies.dropped
