"""MessagePack encoding of wire messages: decoding is validation.

Each socket carries one tagged union of `msgspec.Struct`s (`array_like`, so a frame is a
plain MessagePack array `[tag, field, ...]` that the `msgpack` package reads too). A frame
that does not decode into that union is logged, counted and dropped by `FrameDecoder`;
the receiving process keeps running. No pickle anywhere.

Large integer arrays (token ids, page ids) travel as raw little-endian int32 `bytes`
fields; `pack_int32` / `unpack_int32` convert without a Python-level loop.
"""

from __future__ import annotations

import logging
import struct
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
import numpy as np

logger = logging.getLogger(__name__)

T = TypeVar("T")

_plain_encoder = msgspec.msgpack.Encoder()


def encode_plain(obj: Any) -> bytes:
    return _plain_encoder.encode(obj)


def decode_plain(data: bytes, type_: type[T]) -> T:
    return msgspec.msgpack.decode(data, type=type_)


def pack_int32(values: Any) -> bytes:
    """Token or page ids (list, numpy array or CPU tensor) as little-endian int32 bytes."""
    if isinstance(values, list):  # the common small case (a few page ids): no array round trip
        return struct.pack(f"<{len(values)}i", *values)
    if hasattr(values, "numpy"):
        values = values.numpy()
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_int32(data: bytes) -> np.ndarray:
    """A zero-copy, read-only int32 view of bytes made by `pack_int32`."""
    return np.frombuffer(data, dtype="<i4")


class UnreadableRequest(NamedTuple):
    """A malformed frame that still names its request: what `FrameDecoder` gives in its place
    for an `answerable` tag, so that the receiver can end that request with an error rather
    than leave its client waiting. Never sent: it stands in for the frame it was read from."""

    rid: str
    why: str


class FrameDecoder(Generic[T]):
    """Decodes the frames of one socket into its message union, dropping bad frames.

    `dropped` counts frames that failed to decode; the owning process exposes it as a
    metric. A bad frame never raises out of `decode`. A bad frame of an `answerable` tag
    (a tagged array whose second item is the request id) comes back as an UnreadableRequest.
    """

    def __init__(self, union: Any, socket_name: str, answerable: frozenset[str] = frozenset()) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self.socket_name = socket_name
        self.dropped = 0
        self._answerable = answerable

    def decode(self, frame: bytes) -> T | UnreadableRequest | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.dropped += 1
            logger.warning(
                "dropped malformed frame on %s (%d bytes): %s (%d dropped so far)",
                self.socket_name,
                len(frame),
                e,
                self.dropped,
            )
            rid = self._request_id(frame)
            return None if rid is None else UnreadableRequest(rid, str(e))

    def _request_id(self, frame: bytes) -> str | None:
        if not self._answerable:
            return None
        try:
            value = msgspec.msgpack.decode(frame)
        except (msgspec.DecodeError, RecursionError):  # nesting deeper than msgspec will go
            return None
        if isinstance(value, list) and len(value) >= 2 and value[0] in self._answerable and isinstance(value[1], str):
            return value[1]
        return None


class FrameEncoder:
    """Encodes messages of a socket's union; one instance per sending socket."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)
