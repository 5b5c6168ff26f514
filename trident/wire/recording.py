"""The descriptor recording file: what `--record-batches FILE` writes, what replay reads.

Layout (all integers little-endian):

    b"TRIDENTREC1\\n"
    u32 n, n bytes       ServerArgs as MessagePack (the run being recorded)
    repeated:
      u8 kind            b"D": a frame sent to the workers; b"R": a StepResult received
      f64 t              seconds since the recording started
      u32 n, n bytes     the frame, exactly as it crossed the socket (MessagePack)
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from typing import BinaryIO

from trident.wire.codec import decode_plain, encode_plain
from trident.wire.server_args import ServerArgs

MAGIC = b"TRIDENTREC1\n"
SENT = b"D"
RECEIVED = b"R"
_RECORD = struct.Struct("<cdI")


class RecordingWriter:
    """Appends frames to a recording; owned by the scheduler's IO."""

    def __init__(self, path: str, args: ServerArgs) -> None:
        # A restarted scheduler starts a new file beside the first rather than truncating it.
        base, k = path, 0
        while os.path.exists(path) and os.path.getsize(path) > 0:
            k += 1
            path = f"{base}.{k}"
        self.path = path
        self._f: BinaryIO = open(path, "wb")  # noqa: SIM115 - kept open for the process's life
        header = encode_plain(args)
        self._f.write(MAGIC + struct.pack("<I", len(header)) + header)
        self._t0 = time.perf_counter()

    def record(self, kind: bytes, frame: bytes) -> None:
        self._f.write(_RECORD.pack(kind, time.perf_counter() - self._t0, len(frame)))
        self._f.write(frame)

    def flush(self) -> None:
        self._f.flush()


def read_recording(path: str) -> tuple[ServerArgs, Iterator[tuple[bytes, float, bytes]]]:
    f = open(path, "rb")  # noqa: SIM115 - closed by the generator
    if f.read(len(MAGIC)) != MAGIC:
        f.close()
        raise ValueError(f"{path}: not a trident descriptor recording")
    (n,) = struct.unpack("<I", f.read(4))
    args = decode_plain(f.read(n), ServerArgs)

    def records() -> Iterator[tuple[bytes, float, bytes]]:
        with f:
            while head := f.read(_RECORD.size):
                if len(head) < _RECORD.size:
                    return  # a recording cut short by a kill: keep what is whole
                kind, t, size = _RECORD.unpack(head)
                frame = f.read(size)
                if len(frame) < size:
                    return
                yield kind, t, frame

    return args, records()
