"""ZeroMQ sockets with the project's settings, one helper per pattern.

All sockets set LINGER 0 (a dying peer never blocks shutdown) and bounded high-water
marks. Endpoints on one node are `ipc://` paths inside the private run directory; the few
links that cross nodes are `tcp://` on the --dist-init-addr host (wire/cluster.py) and sign
every frame with a `FrameSigner`, whose bad tags are dropped and counted in `rejected`.
"""

from __future__ import annotations

import os
from typing import Any

import zmq
import zmq.asyncio

from trident.wire.codec import FrameDecoder, FrameEncoder
from trident.wire.signing import FrameSigner

HIGH_WATER_MARK = 100_000


def endpoint(run_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(run_dir, name)}"


ENDPOINT_LAUNCHER = "launcher.sock"
ENDPOINT_TOKENIZER_IN = "tokenizer_in.sock"
"""Every scheduler (one per data-parallel replica) pushes to the one tokenizer here."""


def scheduler_in_endpoint(dp_rank: int) -> str:
    return f"scheduler{dp_rank}_in.sock"


def scheduler_reply_endpoint(dp_rank: int) -> str:
    return f"scheduler{dp_rank}_reply.sock"


def worker_endpoint(dp_rank: int, rank: int) -> str:
    return f"worker{dp_rank}.{rank}_in.sock"


def _configure(sock: zmq.Socket, bind: bool, address: str) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)


class PushSocket:
    """Sends messages of one union; `send_bytes` forwards an already-encoded frame."""

    def __init__(self, ctx: zmq.Context, address: str, bind: bool, signer: FrameSigner | None = None) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        _configure(self.sock, bind, address)
        self._encoder = FrameEncoder()
        self._signer = signer

    def send(self, msg: Any) -> None:
        self.send_bytes(self._encoder.encode(msg))

    def send_bytes(self, frame: bytes) -> None:
        if self._signer is not None:
            frame = self._signer.sign(frame)
        self.sock.send(frame, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class PullSocket:
    """Receives one union; malformed frames are dropped and counted in `dropped`.

    With a signer, frames whose HMAC tag is wrong are dropped before decoding and counted
    in `rejected`. `routing_id` makes it a DEALER, for links whose sender is a ROUTER that
    addresses ranks on other nodes (`PeerSender`).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        bind: bool,
        union: Any,
        name: str,
        signer: FrameSigner | None = None,
        routing_id: bytes | None = None,
        answerable: frozenset[str] = frozenset(),
    ) -> None:
        """`answerable`: tags whose malformed frames come out as UnreadableRequest (codec.py)."""
        self.sock = ctx.socket(zmq.PULL if routing_id is None else zmq.DEALER)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        _configure(self.sock, bind, address)
        self.decoder: FrameDecoder = FrameDecoder(union, name, answerable)
        self._signer = signer

    @property
    def dropped(self) -> int:
        return self.decoder.dropped

    @property
    def rejected(self) -> int:
        return self._signer.rejected if self._signer is not None else 0

    def _decode(self, frame: bytes) -> Any | None:
        if self._signer is not None:
            frame = self._signer.verify(frame, self.decoder.socket_name)
            if frame is None:
                return None
        return self.decoder.decode(frame)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next valid message; None on timeout. Bad frames are skipped."""
        while True:
            if timeout_ms is not None and not self.sock.poll(timeout_ms):
                return None
            msg = self._decode(self.sock.recv(copy=False).bytes)
            if msg is not None:
                return msg

    def recv_nowait(self) -> list[Any]:
        """Every valid message already queued, without blocking."""
        out = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            msg = self._decode(frame.bytes)
            if msg is not None:
                out.append(msg)

    def close(self) -> None:
        self.sock.close(linger=0)


class PeerSender:
    """A ROUTER that sends signed frames to named peers on other nodes (who connect to it).

    Used where a process on node 0 feeds processes elsewhere: the scheduler's descriptors to
    its remote ranks, the launcher's commands to other nodes' launchers. The peers connect
    with a known routing id (`peer_id`), so a frame goes to the rank it names, never to
    whoever connected first; a restarted peer takes its name over (ROUTER_HANDOVER), since
    the dead one's may linger. Frames that arrive here are returned by `recv_nowait` when
    signed, else rejected and counted.
    """

    def __init__(self, ctx: zmq.Context, address: str, signer: FrameSigner, union: Any, name: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        _configure(self.sock, True, address)
        self._encoder = FrameEncoder()
        self.signer = signer
        self.decoder: FrameDecoder = FrameDecoder(union, name)

    def send_bytes(self, peer: bytes, frame: bytes) -> bool:
        """False when `peer` is not connected now (the frame is not queued)."""
        try:
            self.sock.send_multipart([peer, self.signer.sign(frame)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def send(self, peer: bytes, msg: Any) -> bool:
        return self.send_bytes(peer, self._encoder.encode(msg))

    def recv_nowait(self) -> list[tuple[bytes, Any]]:
        """(peer, message) for every valid signed frame queued; the rest are counted."""
        out = []
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(parts) != 2:
                self.signer.count_rejected(self.decoder.socket_name, "not one frame")
                continue
            frame = self.signer.verify(parts[1], self.decoder.socket_name)
            msg = self.decoder.decode(frame) if frame is not None else None
            if msg is not None:
                out.append((parts[0], msg))

    @property
    def rejected(self) -> int:
        return self.signer.rejected

    def close(self) -> None:
        self.sock.close(linger=0)


def peer_id(dp_rank: int, rank: int) -> bytes:
    """The routing id a remote worker rank connects with."""
    return f"worker{dp_rank}.{rank}".encode()


def node_peer_id(node_rank: int) -> bytes:
    """The routing id node `node_rank`'s launcher connects to node 0's launcher with."""
    return f"node{node_rank}".encode()


class PeerConnection(PullSocket):
    """The other end of a `PeerSender`: connects under a routing id, receives its signed
    frames, and sends signed frames back (a node's launcher talking to node 0's)."""

    def __init__(
        self, ctx: zmq.Context, address: str, union: Any, name: str, signer: FrameSigner, routing_id: bytes
    ) -> None:
        super().__init__(ctx, address, False, union, name, signer, routing_id)
        self._encoder = FrameEncoder()

    def send(self, msg: Any) -> None:
        self.sock.send(self._signer.sign(self._encoder.encode(msg)), copy=False)


class AsyncPushSocket:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, bind: bool) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        _configure(self.sock, bind, address)
        self._encoder = FrameEncoder()

    async def send(self, msg: Any) -> None:
        await self.sock.send(self._encoder.encode(msg), copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncPullSocket:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, bind: bool, union: Any, name: str) -> None:
        self.sock = ctx.socket(zmq.PULL)
        _configure(self.sock, bind, address)
        self.decoder: FrameDecoder = FrameDecoder(union, name)

    @property
    def dropped(self) -> int:
        return self.decoder.dropped

    async def recv(self) -> Any:
        while True:
            frame = await self.sock.recv(copy=False)
            msg = self.decoder.decode(frame.bytes)
            if msg is not None:
                return msg

    def close(self) -> None:
        self.sock.close(linger=0)
