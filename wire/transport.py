"""ZeroMQ sockets with the project's settings, one helper per pattern.

All sockets set LINGER 0 (a dying peer never blocks shutdown) and bounded high-water
marks. Endpoints are `ipc://` paths inside the private run directory.
"""

from __future__ import annotations

import os
from typing import Any

import zmq
import zmq.asyncio

from wire.codec import FrameDecoder, FrameEncoder

HIGH_WATER_MARK = 100_000


def endpoint(run_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(run_dir, name)}"


ENDPOINT_LAUNCHER = "launcher.sock"
ENDPOINT_SCHEDULER_IN = "scheduler_in.sock"
ENDPOINT_TOKENIZER_IN = "tokenizer_in.sock"
ENDPOINT_SCHEDULER_REPLY = "scheduler_reply.sock"


def worker_endpoint(rank: int) -> str:
    return f"worker{rank}_in.sock"


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

    def __init__(self, ctx: zmq.Context, address: str, bind: bool) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        _configure(self.sock, bind, address)
        self._encoder = FrameEncoder()

    def send(self, msg: Any) -> None:
        self.sock.send(self._encoder.encode(msg), copy=False)

    def send_bytes(self, frame: bytes) -> None:
        self.sock.send(frame, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class PullSocket:
    """Receives one union; malformed frames are dropped and counted in `dropped`."""

    def __init__(self, ctx: zmq.Context, address: str, bind: bool, union: Any, name: str) -> None:
        self.sock = ctx.socket(zmq.PULL)
        _configure(self.sock, bind, address)
        self.decoder: FrameDecoder = FrameDecoder(union, name)

    @property
    def dropped(self) -> int:
        return self.decoder.dropped

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next valid message; None on timeout. Bad frames are skipped."""
        while True:
            if timeout_ms is not None and not self.sock.poll(timeout_ms):
                return None
            msg = self.decoder.decode(self.sock.recv(copy=False).bytes)
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
            msg = self.decoder.decode(frame.bytes)
            if msg is not None:
                out.append(msg)

    def close(self) -> None:
        self.sock.close(linger=0)


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
