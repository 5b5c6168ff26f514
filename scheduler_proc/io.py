"""The scheduler's sockets: requests in, token outputs out, descriptors to every rank,
replies from rank 0. No socket code lives in the loop.

Each data-parallel replica has its own scheduler and its own set of these sockets. Ranks on
other nodes get the same descriptor bytes over one signed tcp link (`PeerSender`)."""

from __future__ import annotations

import logging
import time

import zmq

from trident.wire.backend import ResetBatch, SchedulerReply, StepResult, WorkerInput, WorkerReady
from trident.wire.child import ChildContext
from trident.wire.cluster import layout_of, signer_of
from trident.wire.codec import FrameEncoder
from trident.wire.control import check_protocol_version
from trident.wire.frontend import EmbedReq, GenerateReq, SchedulerInput
from trident.wire.recording import RECEIVED, SENT, RecordingWriter
from trident.wire.transport import (
    ENDPOINT_TOKENIZER_IN,
    PeerSender,
    PullSocket,
    PushSocket,
    endpoint,
    peer_id,
    scheduler_in_endpoint,
    scheduler_reply_endpoint,
    worker_endpoint,
)

logger = logging.getLogger(__name__)
REMOTE_RETRY_S = 0.05


class WorkerStartTimeout(RuntimeError):
    pass


class SchedulerIO:
    def __init__(self, child: ChildContext) -> None:
        args, ctx, dp = child.args, child.zmq_ctx, child.dp_rank
        run = args.run_dir
        # A request whose frame is malformed but names its rid is ended with an error, so
        # that its client is answered, not left waiting (scheduler.handle_request).
        answerable = frozenset({GenerateReq.__struct_config__.tag, EmbedReq.__struct_config__.tag})
        self.requests = PullSocket(
            ctx,
            endpoint(run, scheduler_in_endpoint(dp)),
            bind=True,
            union=SchedulerInput,
            name=f"{child.name}.in",
            answerable=answerable,
        )
        self.tokenizer = PushSocket(ctx, endpoint(run, ENDPOINT_TOKENIZER_IN), bind=False)
        layout = layout_of(args)
        # Ranks placed by Ray may be on any node: rank 0 replies over signed tcp to the head.
        self.replies = PullSocket(
            ctx,
            layout.reply_address(dp) if layout.ranks_anywhere else endpoint(run, scheduler_reply_endpoint(dp)),
            bind=True,
            union=SchedulerReply,
            name=f"{child.name}.reply",
            signer=signer_of(args) if layout.ranks_anywhere else None,
        )
        local = [r for r in range(args.tp_size) if not layout.is_remote_rank(r)]
        self.workers = [PushSocket(ctx, endpoint(run, worker_endpoint(dp, r)), bind=False) for r in local]
        self.remote_ranks = [peer_id(dp, r) for r in range(args.tp_size) if layout.is_remote_rank(r)]
        self.remote: PeerSender | None = None
        if self.remote_ranks:
            self.remote = PeerSender(
                ctx, layout.descriptor_address(dp), signer_of(args), WorkerInput, f"{child.name}.remote"
            )
        self._encoder = FrameEncoder()
        self._poller = zmq.Poller()
        self._poller.register(self.replies.sock, zmq.POLLIN)
        self._poller.register(self.requests.sock, zmq.POLLIN)
        self.recorder = RecordingWriter(args.record_batches, args) if args.record_batches else None
        self.descriptor_bytes_sent = 0
        self.last_descriptor_bytes = 0

    def connect_workers(self, timeout_s: float, newer_than: int = -1) -> WorkerReady:
        """Resets every rank's batch and waits for rank 0's WorkerReady of a generation later
        than `newer_than` (the group lost; -1 at start, where the workers running are the ones).

        Used at start (a restarted scheduler finds workers holding stale rows) and after the
        workers were restarted. Other replies still queued are skipped, and so is a ready of
        the lost group: it answers this reset before launch.py kills it, and the steps sent
        to it would be lost with it.
        """
        deadline = time.monotonic() + timeout_s
        reset = self._encoder.encode(ResetBatch(next_step_id=1))
        for w in self.workers:
            w.send_bytes(reset)
        for peer in self.remote_ranks:  # a frame to a rank not connected yet would be lost
            while not self.remote.send_bytes(peer, reset):
                if time.monotonic() > deadline:
                    raise WorkerStartTimeout(f"{peer.decode()} did not connect within {timeout_s:.0f} s")
                time.sleep(REMOTE_RETRY_S)
        while (left := deadline - time.monotonic()) > 0:
            msg = self.replies.recv(timeout_ms=int(left * 1000) + 1)
            if isinstance(msg, WorkerReady):
                check_protocol_version("worker[tp0]", msg.protocol_version)
                if msg.generation > newer_than:
                    return msg
                logger.warning("skipping the ready of worker group %d, which was lost", msg.generation)
        group = "" if newer_than < 0 else f" (of a worker group after {newer_than})"
        raise WorkerStartTimeout(f"worker rank 0 did not report ready{group} within {timeout_s:.0f} s")

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
        for peer in self.remote_ranks:  # a rank that is gone stalls rank 0: the watchdog acts
            self.remote.send_bytes(peer, frame)
        if self.recorder is not None:
            self.recorder.record(SENT, frame)

    def record_result(self, result: StepResult) -> None:
        if self.recorder is not None:
            self.recorder.record(RECEIVED, self._encoder.encode(result))

    @property
    def dropped_frames(self) -> int:
        return self.requests.dropped + self.replies.dropped

    @property
    def rejected_frames(self) -> int:
        """Frames with a bad HMAC tag sent to the cross-node port (nothing legitimate is)."""
        if self.remote is None:
            return 0
        self.remote.recv_nowait()
        return self.remote.rejected
