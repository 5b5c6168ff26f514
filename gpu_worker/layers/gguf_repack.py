"""GGUF block formats as the two layouts our quantized linear layers take (quant_linear.py).

Every format the packaged models use converts exactly, with no new rounding, into one of:

    U4  codes uint8 [N, K] in 0..15, scales and mins float32 [N, K // 32]:  w = scale * code + min
    I8  codes int8 [N, K], scales float32 [N, K // block], block 16 or 32:   w = scale * code

    Q4_0  U4  scale d, min -8 d
    Q4_1  U4  scale d, min m
    Q4_K  U4  per 32-element sub-block: scale d * sc, min -(dmin * m), sc and m the 6-bit
              packed pair of the 256-element super-block
    Q8_0  I8  block 32, scale d
    Q5_0  I8  block 32, code q5 - 16, scale d
    Q6_K  I8  block 16, code q6 - 32, scale d * sc (sc int8)

Q5_0's codes fit 5 bits and Q6_K's 6: their I8Weights say so (`bits`), and gguf_layers.py
packs such a weight as quant_linear.py's I5 layout (5.5 bits a weight, the file's own size;
I8 takes 8.5) or I6 (8 bits with Q6_K's float32 scales; I8 takes 10): fewer bytes to read,
which makes them faster at small batches (docs/benchmarks.md, "Method"). Stacked with a
wider part (Gemma's fused q/k/v: Q5_0 q and k, Q8_0 v) the whole is I8.

"Exactly" means bitwise equal in float32 to `gguf.quants.dequantize`: d is an fp16 (11
significant bits), so every product above fits float32's 24 bits (Q6_K's d * sc * q, the
largest, needs 11 + 7 + 5 = 23), and the one rounding left, Q4_1's and Q4_K's `+ min`, is
the one gguf's own float32 dequantization makes. tests/test_gguf_repack.py checks it.

A format outside the table (Q5_1, Q2_K, Q3_K, Q5_K, IQ*, or float tensors) has no layout
here: gguf_weights.py dequantizes that tensor to dense at load and logs it, so a file
that mixes in an odd format still serves, at dense cost for that tensor alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

if TYPE_CHECKING:
    import torch

U4_BLOCK = 32
"""Elements per scale/min pair of the U4 layout."""


@dataclass(frozen=True)
class U4Weights:
    """w = scale * code + min, per row, one (scale, min) per 32 consecutive elements."""

    codes: np.ndarray
    """uint8 [N, K], values 0..15 (one code a byte: quant_linear.py packs its own layout)."""
    scales: np.ndarray
    """float32 [N, K // 32]."""
    mins: np.ndarray
    """float32 [N, K // 32]."""

    block = U4_BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: the weights as gguf dequantizes them (a multiply, then an add)."""
        products = _blockwise(self.codes, self.block) * _per_block(self.scales)
        return (products + _per_block(self.mins)).reshape(self.shape).numpy()

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> U4Weights:
        """The same operation on rows (slice, permute, pad) applied to codes, scales and mins."""
        return U4Weights(fn(self.codes), fn(self.scales), fn(self.mins))

    def columns(self, start: int, length: int) -> U4Weights:
        first, count = _block_range(start, length, self.block)
        blocks = slice(first, first + count)
        return U4Weights(self.codes[:, start : start + length], self.scales[:, blocks], self.mins[:, blocks])


@dataclass(frozen=True)
class I8Weights:
    """w = scale * code, per row, one scale per `block` consecutive elements."""

    codes: np.ndarray
    """int8 [N, K]."""
    scales: np.ndarray
    """float32 [N, K // block]."""
    block: int
    """16 (Q6_K) or 32."""
    bits: int = 8
    """The codes lie in -2^(bits-1)..2^(bits-1)-1: 5 for Q5_0 (packed as I5 then), 6 for
    Q6_K, 8 for Q8_0."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        return (_blockwise(self.codes, self.block) * _per_block(self.scales)).reshape(self.shape).numpy()

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> I8Weights:
        return I8Weights(fn(self.codes), fn(self.scales), self.block, self.bits)

    def columns(self, start: int, length: int) -> I8Weights:
        first, count = _block_range(start, length, self.block)
        blocks = slice(first, first + count)
        return I8Weights(self.codes[:, start : start + length], self.scales[:, blocks], self.block, self.bits)

    def with_block(self, block: int) -> I8Weights:
        """The same weights with a smaller block (each scale repeated): exact."""
        if self.block % block:
            raise ValueError(f"an I8 block of {self.block} cannot be split into blocks of {block}")
        return I8Weights(self.codes, np.repeat(self.scales, self.block // block, axis=1), block, self.bits)


QuantWeights = U4Weights | I8Weights


def _blockwise(codes: np.ndarray, block: int) -> torch.Tensor:
    """codes [N, K] as float32 [N, K // block, block]. Dequantizing in torch (threads, the
    scales broadcast rather than repeated) is what makes a dense load of Gemma 3 quick: numpy,
    on one thread with the scales repeated, spent most of the load on its 168M-element
    embedding."""
    import torch  # here: the launcher reads GGUF headers through this package, without torch

    rows, cols = codes.shape
    return torch.from_numpy(np.ascontiguousarray(codes)).reshape(rows, cols // block, block).float()


def _per_block(values: np.ndarray) -> torch.Tensor:
    """scales or mins [N, K // block] -> [N, K // block, 1], to broadcast over a block."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(values)).unsqueeze(-1)


def _block_range(start: int, length: int, block: int) -> tuple[int, int]:
    """The blocks that columns [start, start + length) span, which must be whole blocks."""
    if start % block or length % block:
        raise ValueError(
            f"columns {start}:{start + length} do not fall on the {block}-element blocks of the weight's "
            "quantization; this split (tensor parallelism) needs --weight-dtype bf16"
        )
    return start // block, length // block


def concat_rows(parts: Sequence[QuantWeights]) -> QuantWeights:
    """One weight from parts stacked by rows (fused q/k/v, gate/up), when the parts share a
    layout; I8 parts of blocks 16 and 32 meet at block 16, and of several code widths at the
    widest. Raises ValueError for U4 with I8."""
    if all(isinstance(p, U4Weights) for p in parts):
        return U4Weights(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins")))
    if all(isinstance(p, I8Weights) for p in parts):
        block = min(p.block for p in parts)
        same = [p.with_block(block) for p in parts]  # type: ignore[union-attr]
        codes, scales = np.concatenate([p.codes for p in same]), np.concatenate([p.scales for p in same])
        return I8Weights(codes, scales, block, max(p.bits for p in parts))  # type: ignore[union-attr]
    raise ValueError("parts of different layouts (U4 and I8) cannot be stacked into one weight")


# ------------------------------------------------------------------ formats
# Each takes the blocks of a tensor, uint8 [n_blocks, bytes_per_block], and returns the
# per-block arrays: codes [n_blocks, elements], scales (and mins) [n_blocks, sub_blocks].


def _fp16(column: np.ndarray) -> np.ndarray:
    """[n_blocks, 2] bytes -> float32 [n_blocks, 1]."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Bytes in groups of `group`: the low nibbles of a group are its first `group`
    elements, the high nibbles the next `group` (ggml's layout in Q4_0/1, Q5_0, Q4_K)."""
    n = qs.shape[0]
    grouped = qs.reshape(n, -1, 1, group)
    return (grouped >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1) & np.uint8(0x0F)).reshape(n, -1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d = _fp16(blocks[:, :2])
    return _nibbles(blocks[:, 2:], 16), d, d * np.float32(-8)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    return _nibbles(blocks[:, 4:], 16), _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes a super-block -> its eight 6-bit scales and eight 6-bit mins. Bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top bits of scales 4-7; 4-7 the same for the mins;
    8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    n = packed.shape[0]
    s = packed.reshape(n, 3, 4)
    lo, hi, mixed = s[:, 0], s[:, 1], s[:, 2]
    scales = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mins = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return scales, mins


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d, dmin = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    sc, m = _q4_k_scales(blocks[:, 4:16])
    return _nibbles(blocks[:, 16:], 32), d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8), _fp16(blocks[:, :2])


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    high_bits = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)
    fifth = (high_bits >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    q5 = _nibbles(blocks[:, 6:], 16) | (fifth.astype(np.uint8) << np.uint8(4))
    return q5.astype(np.int8) - np.int8(16), _fp16(blocks[:, :2])


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """210 bytes: ql[128] (low 4 bits), qh[64] (top 2 bits), int8 scales[16], fp16 d. Each
    128-element half: ql's 64 bytes give elements 0-63 (low nibbles) and 64-127 (high),
    qh's 32 bytes give bits 4-5 of elements 0-31, 32-63, 64-95, 96-127 (2 bits each)."""
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128], 64).reshape(n, -1, 32)
    qh = blocks[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q6 = ql | ((qh & np.uint8(0x03)).reshape(n, -1, 32) << np.uint8(4))
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return q6.reshape(n, -1).astype(np.int8) - np.int8(32), _fp16(blocks[:, 208:210]) * sc


Q = GGMLQuantizationType
U4_FORMATS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k}
I8_FORMATS = {Q.Q8_0: (_q8_0, 32, 8), Q.Q5_0: (_q5_0, 32, 5), Q.Q6_K: (_q6_k, 16, 6)}
"""format -> (its conversion, block, code bits)."""
SUPPORTED = tuple(f.name for f in (*U4_FORMATS, *I8_FORMATS))


def repack(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> QuantWeights | None:
    """A 2-D tensor's bytes (any shape holding them in order) in its GGUF format -> its U4 or
    I8 weights [rows, cols]; None for a format outside the table."""
    kind = GGMLQuantizationType(ggml_type)
    if kind not in U4_FORMATS and kind not in I8_FORMATS:
        return None
    rows, cols = shape
    elements, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    if blocks.shape[0] * elements != rows * cols or cols % elements:
        raise ValueError(f"{kind.name} tensor of shape {shape}: {raw.size} bytes do not hold whole rows of blocks")
    if kind in U4_FORMATS:
        codes, scales, mins = U4_FORMATS[kind](blocks)
        return U4Weights(codes.reshape(rows, cols), scales.reshape(rows, -1), mins.reshape(rows, -1))
    convert, block, bits = I8_FORMATS[kind]
    codes, scales = convert(blocks)
    return I8Weights(codes.reshape(rows, cols), scales.reshape(rows, -1), block, bits)
