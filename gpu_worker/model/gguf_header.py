"""Reading a GGUF file's header (metadata and tensor table) and its tensors' bytes.

gguf.GGUFReader builds numpy views for every item of every array, which for a 262k-token
vocabulary (Gemma 3) takes tens of seconds; this reads string arrays as a list of bytes and
numeric arrays in one frombuffer, so the launcher can check a file before any child starts
and the worker can load it without that wait. Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF value type -> struct format (8 = string, 9 = array are read apart)."""
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF (bad magic, cut short, or inconsistent)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """Row-major (numpy / PyTorch) order: the reverse of GGUF's dims."""
    ggml_type: int
    offset: int
    """Absolute byte offset of the data in the file."""
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, Any]
    """Metadata: scalars as Python values, strings as str, string arrays as lists of bytes,
    numeric arrays as numpy arrays."""
    tensors: tuple[TensorInfo, ...]
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @property
    def data_end(self) -> int:
        """Where the last tensor's data ends; a file shorter than this is truncated."""
        return max((t.offset + t.nbytes for t in self.tensors), default=0)


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("the header is cut short")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def raw_string(self) -> bytes:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("the header is cut short")
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def string_array(self, count: int) -> list[bytes]:
        """`raw_string` `count` times in one loop over locals: a vocabulary's tokens (and
        merges) are nearly all of a GGUF header's items, and each process that opens the
        file (the launcher's check, the worker's config and weights) reads them."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _LENGTH.unpack_from
        out: list[bytes] = [b""] * count
        for i in range(count):
            if pos + 8 > end:
                raise GGUFFormatError("the header is cut short")
            n = length(buf, pos)[0]
            pos += 8
            if pos + n > end:
                raise GGUFFormatError("the header is cut short")
            out[i] = buf[pos : pos + n].tobytes()
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.raw_string().decode("utf-8", errors="replace")
        if kind == _ARRAY:
            item_kind, count = self.take("<I"), self.take("<Q")
            if item_kind == _STRING:
                return self.string_array(count)
            if item_kind not in _SCALARS:
                return [self.value(item_kind) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item_kind])
            if self.pos + count * dtype.itemsize > len(self.buf):
                raise GGUFFormatError("the header is cut short")
            out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return out
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def _nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except ValueError:
        raise GGUFFormatError(f"unknown tensor type {ggml_type}") from None
    return int(np.prod(shape, dtype=np.int64)) // block * type_size


def read_gguf_header(path: str) -> GGUFHeader:
    """The metadata and tensor table; raises GGUFFormatError for a file that is not GGUF.

    Read once per version of the file in a process: the launcher (its check and the sampling
    defaults) and the worker (its config and its weights) each ask twice, and the vocabulary
    makes each read cost a fifth of a second. The header is frozen; share it, do not change it."""
    st = os.stat(path)
    return _read_gguf_header(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    """`size` and `mtime_ns` key the cache: a file replaced in place is read again."""
    if size < 24:  # magic, version, two counts
        raise GGUFFormatError("not a GGUF file (shorter than a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        cur = _Cursor(view)
        try:
            if bytes(cur.buf[:4]) != _MAGIC:
                raise GGUFFormatError("not a GGUF file (bad magic bytes)")
            cur.pos = 4
            version, n_tensors, n_fields = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
            if version < 2:
                raise GGUFFormatError(f"GGUF version {version} is too old (2 or later)")
            fields = {}
            for _ in range(n_fields):
                key = cur.raw_string().decode()
                fields[key] = cur.value(cur.take("<I"))
            table = []
            for _ in range(n_tensors):
                name = cur.raw_string().decode()
                dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
                table.append((name, tuple(reversed(dims)), cur.take("<I"), cur.take("<Q")))
            alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
            data_start = -(-cur.pos // alignment) * alignment
            tensors = tuple(
                TensorInfo(name, shape, kind, data_start + offset, _nbytes(shape, kind))
                for name, shape, kind, offset in table
            )
            return GGUFHeader(fields, tensors, len(mm))
        except (UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise GGUFFormatError(f"the GGUF header is corrupt: {e}") from None
        finally:
            view.release()  # before the mmap closes


def tensor_bytes(file: np.memmap, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes in the row layout gguf.quants.dequantize takes (a view of `file`,
    the whole file as `np.memmap(path, dtype=np.uint8, mode="r")`)."""
    from gguf import quant_shape_to_byte_shape

    raw = file[info.offset : info.offset + info.nbytes]
    return raw.reshape(quant_shape_to_byte_shape(info.shape, info.ggml_type))
