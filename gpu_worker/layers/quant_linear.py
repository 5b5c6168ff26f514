"""Linear layers that compute on quantized weights, as GGUF files ship them.

Every GGUF format the served models use converts exactly into one of two canonical layouts
(the loader does that; this module takes the canonical codes):
- U4: unsigned 4-bit codes 0..15, a float32 scale and a float32 min per block of 32 along
  k: w = scale * code + min (Q4_0, Q4_1, Q4_K);
- I8: signed 8-bit codes, a float32 scale per block of 16 or 32 along k: w = scale * code
  (Q8_0, Q5_0, Q6_K).

`QuantLinear` repacks them once for csrc/quant_linear.cpp (its header describes the layout
and the kernels): columns in panels of 16, codes interleaved for vpdpbusd, U4 codes two to a
byte, and scales (and mins) stored as float16 where every one of them is exactly a float16
(Q4_0, Q4_1, Q5_0, Q8_0), else as float32 (Q4_K, Q6_K). I8 codes that fit 5 bits (Q5_0's,
block 32) can be packed as I5 instead, U4's nibbles plus a plane of fifth bits, and those
that fit 6 bits in blocks of 16 (Q6_K's) as I6, nibbles plus a plane of top bit pairs.
Nothing is rounded: dequantize() gives scale * code (+ min) in float32. Resident bits per
weight: U4 5 (float16 scales) or 6, I5 5.5 or 6, I6 7 or 8, I8 8.5 to 10.

Without the kernels (a CPU without AVX2, a failed build opted out of), forward dequantizes
the weights and runs a float32 matmul: correct, and slow.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.kernels.cpu_kernels import load_quant_linear
from gpu_worker.runtime.huge_pages import huge_page_empty

PANEL_COLUMNS = 16
U4, I8, I5, I6 = 0, 1, 2, 3
"""The layout numbers csrc/quant_linear.cpp takes."""
LAYOUT_NAMES = {U4: "U4", I8: "I8", I5: "I5", I6: "I6"}
CODE_BITS = {U4: 4, I5: 5, I6: 6, I8: 8}
CODE_BIAS = {U4: 0, I5: 16, I6: 32, I8: 128}
"""What the stored (unsigned) code exceeds the code by."""
I6_BLOCK = 16
U4_BLOCK = 32


def _fits_float16(values: torch.Tensor) -> bool:
    """Every value is exactly a float16 (a NaN or an overflow is not)."""
    return bool(torch.equal(values.to(torch.float16).to(torch.float32), values))


def _per_panel(values: torch.Tensor, panels: int) -> torch.Tensor:
    """[n, blocks] -> [panels, blocks, 16], zero columns past n."""
    n, blocks = values.shape
    padded = values.new_zeros(panels * PANEL_COLUMNS, blocks)
    padded[:n] = values
    return padded.view(panels, PANEL_COLUMNS, blocks).transpose(1, 2)


def _as_bytes(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[panels, blocks, 16] float -> [panels, blocks, 16 * itemsize] uint8 in `dtype`."""
    return values.to(dtype).contiguous().view(torch.uint8)


def _concat_packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, dim=2) into 2 MB-page memory (huge_pages.py: a decode step streams
    these bytes, and in 4 KB pages it walks the page tables every 4 KB)."""
    panels, blocks = parts[0].shape[:2]
    out = huge_page_empty((panels, blocks, sum(part.shape[2] for part in parts)))
    return torch.cat(parts, dim=2, out=out)


def _code_groups(codes: torch.Tensor, panels: int, block: int) -> torch.Tensor:
    """uint8 [n, k] -> [panels, k / block, block / 4, 16, 4]: each (block, group) 16 columns
    of 4 consecutive k, the order of one vpdpbusd operand."""
    n, k = codes.shape
    padded = codes.new_zeros(panels * PANEL_COLUMNS, k)
    padded[:n] = codes
    return padded.view(panels, PANEL_COLUMNS, k // block, block // 4, 4).permute(0, 2, 3, 1, 4)


class QuantLinear(nn.Module):
    """`y = x @ w.T + bias` on a U4, I5, I6 or I8 weight held packed (module docstring)."""

    def __init__(
        self,
        packed: torch.Tensor,
        layout: int,
        block: int,
        scale_dtype: torch.dtype,
        shape: tuple[int, int],
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("bias", bias)
        self.layout, self.block, self.scale_dtype = layout, block, scale_dtype
        self.out_features, self.in_features = shape
        self.kernel_path = load_quant_linear()

    @property
    def kernel_path(self) -> str:
        """ "amx_int8", "avx512_vnni" or "avx2": the kernel's path on this CPU (the tests set the
        others too); "": the torch fallback."""
        return self._kernel_path

    @kernel_path.setter
    def kernel_path(self, path: str) -> None:
        self._kernel_path = path
        self._rows = self.rows_fn()

    @classmethod
    def from_u4(
        cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None
    ) -> QuantLinear:
        """codes uint8 [n, k] (0..15), scales and mins float32 [n, k / 32]: w = scales * codes + mins."""
        n, k = codes.shape
        if (
            codes.dtype != torch.uint8
            or k % U4_BLOCK
            or scales.shape != (n, k // U4_BLOCK)
            or mins.shape != scales.shape
        ):
            raise ValueError(
                f"U4 weights: codes uint8 [n, k], k a multiple of 32, scales and mins [n, k / 32]; got "
                f"{tuple(codes.shape)} {codes.dtype}, {tuple(scales.shape)}, {tuple(mins.shape)}"
            )
        panels = -(-n // PANEL_COLUMNS)
        groups = _code_groups(codes, panels, U4_BLOCK)  # [panels, blocks, 8, 16, 4]
        nibbles = groups[:, :, :4] | (groups[:, :, 4:] << 4)  # low nibble k 0..15, high k 16..31
        scales, mins = scales.float(), mins.float()
        scale_dtype = torch.float16 if _fits_float16(scales) and _fits_float16(mins) else torch.float32
        packed = _concat_packed(
            [
                nibbles.reshape(panels, k // U4_BLOCK, -1),
                _as_bytes(_per_panel(scales, panels), scale_dtype),
                _as_bytes(_per_panel(mins, panels), scale_dtype),
            ]
        )
        return cls(packed, U4, U4_BLOCK, scale_dtype, (n, k), bias)

    @classmethod
    def from_i8(cls, codes: torch.Tensor, scales: torch.Tensor, block: int, bias: torch.Tensor | None) -> QuantLinear:
        """codes int8 [n, k], scales float32 [n, k / block] (block 16 or 32): w = scales * codes."""
        n, k = codes.shape
        if codes.dtype != torch.int8 or block not in (16, 32) or k % 32 or scales.shape != (n, k // block):
            raise ValueError(
                f"I8 weights: codes int8 [n, k], k a multiple of 32, block 16 or 32, scales [n, k / "
                f"block]; got {tuple(codes.shape)} {codes.dtype}, block {block}, {tuple(scales.shape)}"
            )
        panels = -(-n // PANEL_COLUMNS)
        biased = codes.view(torch.uint8) ^ 0x80  # c + 128, unsigned as vpdpbusd multiplies them (no int16 copy)
        groups = _code_groups(biased, panels, block)
        scales = scales.float()
        scale_dtype = torch.float16 if _fits_float16(scales) else torch.float32
        packed = _concat_packed(
            [groups.reshape(panels, k // block, -1), _as_bytes(_per_panel(scales, panels), scale_dtype)]
        )
        return cls(packed, I8, block, scale_dtype, (n, k), bias)

    @classmethod
    def from_i5(cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        """codes int8 [n, k] in -16..15, scales float32 [n, k / 32]: w = scales * codes, packed
        as I5 (the nibbles of codes + 16 as U4's, then their fifth bits as 8 masks of 64)."""
        n, k = codes.shape
        if codes.dtype != torch.int8 or k % U4_BLOCK or scales.shape != (n, k // U4_BLOCK):
            raise ValueError(
                f"I5 weights: codes int8 [n, k], k a multiple of 32, scales [n, k / 32]; got "
                f"{tuple(codes.shape)} {codes.dtype}, {tuple(scales.shape)}"
            )
        if codes.numel() and (codes.min() < -16 or codes.max() > 15):
            raise ValueError("I5 weights: codes must lie in -16..15 (Q5_0's); use from_i8")
        panels = -(-n // PANEL_COLUMNS)
        groups = _code_groups((codes + 16).to(torch.uint8), panels, U4_BLOCK)  # [panels, blocks, 8, 16, 4]
        nibbles = (groups[:, :, :4] & 15) | ((groups[:, :, 4:] & 15) << 4)
        # Mask 2g + h holds the fifth bits of vector g's low (h 0: groups[g]) or high (h 1:
        # groups[4 + g]) nibbles, bit i for byte i: 64 bits, least significant first.
        vectors = torch.stack([groups[:, :, :4], groups[:, :, 4:]], dim=3)  # [panels, blocks, g, h, 16, 4]
        bits = ((vectors >> 4) & 1).reshape(panels, k // U4_BLOCK, -1, 8)
        masks = (bits << torch.arange(8, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)
        scales = scales.float()
        scale_dtype = torch.float16 if _fits_float16(scales) else torch.float32
        packed = _concat_packed(
            [nibbles.reshape(panels, k // U4_BLOCK, -1), masks, _as_bytes(_per_panel(scales, panels), scale_dtype)]
        )
        return cls(packed, I5, U4_BLOCK, scale_dtype, (n, k), bias)

    @classmethod
    def from_i6(cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        """codes int8 [n, k] in -32..31, scales float32 [n, k / 16]: w = scales * codes, packed
        as I6 (per block, code vectors g 0..3 as I8's of block 16, of codes + 32: the nibbles of
        vectors 0, 1 low and 2, 3 high in two vectors, then one of top bits, 2g..2g+1 for g)."""
        n, k = codes.shape
        if codes.dtype != torch.int8 or k % U4_BLOCK or scales.shape != (n, k // I6_BLOCK):
            raise ValueError(
                f"I6 weights: codes int8 [n, k], k a multiple of 32, scales [n, k / 16]; got "
                f"{tuple(codes.shape)} {codes.dtype}, {tuple(scales.shape)}"
            )
        if codes.numel() and (codes.min() < -32 or codes.max() > 31):
            raise ValueError("I6 weights: codes must lie in -32..31 (Q6_K's); use from_i8")
        panels = -(-n // PANEL_COLUMNS)
        groups = _code_groups((codes + 32).to(torch.uint8), panels, I6_BLOCK)  # [panels, blocks, 4, 16, 4]
        nibbles = (groups[:, :, :2] & 15) | ((groups[:, :, 2:] & 15) << 4)
        top = sum(((groups[:, :, g] >> 4) & 3) << (2 * g) for g in range(4))
        scales = scales.float()
        scale_dtype = torch.float16 if _fits_float16(scales) else torch.float32
        blocks = k // I6_BLOCK
        packed = _concat_packed(
            [
                nibbles.reshape(panels, blocks, -1),
                top.reshape(panels, blocks, -1),
                _as_bytes(_per_panel(scales, panels), scale_dtype),
            ]
        )
        return cls(packed, I6, I6_BLOCK, scale_dtype, (n, k), bias)

    def _code_bytes(self) -> int:
        return self.block * 16 * CODE_BITS[self.layout] // 8

    def _unpack(self, panels: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
        """float32 weight rows of the given panels ([p, blocks, bytes]): all 16 columns of each
        ([p * 16, k]), or with `columns` ([p]) the one column of each ([p, k])."""
        p, blocks, _ = panels.shape
        code_bytes, itemsize = self._code_bytes(), self.scale_dtype.itemsize
        scales = panels[:, :, code_bytes : code_bytes + PANEL_COLUMNS * itemsize].contiguous().view(self.scale_dtype)
        if self.layout == I8:
            groups = panels[:, :, :code_bytes].reshape(p, blocks, -1, PANEL_COLUMNS, 4)
        elif self.layout == I6:
            nibbles = panels[:, :, : self.block * 8].reshape(p, blocks, 2, PANEL_COLUMNS, 4)
            top = panels[:, :, self.block * 8 : code_bytes].reshape(p, blocks, 1, PANEL_COLUMNS, 4)
            top_bits = (top >> torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1, 1)) & 3  # code vector g at 2g
            groups = torch.cat([nibbles & 15, nibbles >> 4], dim=2) | (top_bits << 4)
        else:
            nibbles = panels[:, :, : self.block * 8].reshape(p, blocks, -1, PANEL_COLUMNS, 4)
            groups = torch.cat([nibbles & 15, nibbles >> 4], dim=2)
        if self.layout == U4:
            mins = panels[:, :, code_bytes + PANEL_COLUMNS * itemsize :].contiguous().view(self.scale_dtype)
        if self.layout == I5:
            masks = panels[:, :, self.block * 8 : code_bytes].reshape(p, blocks, -1, 1)
            bits = (masks >> torch.arange(8, dtype=torch.uint8)) & 1  # [p, blocks, 64 bytes, 8]: mask 2g + h
            fifth = bits.reshape(p, blocks, 4, 2, PANEL_COLUMNS, 4).transpose(2, 3)  # h, then g: as groups
            groups = groups | (fifth.reshape(groups.shape) << 4)
        if columns is None:
            codes = groups.permute(0, 3, 1, 2, 4).reshape(p * PANEL_COLUMNS, blocks, self.block)
            select = lambda per_column: per_column.transpose(1, 2).reshape(p * PANEL_COLUMNS, blocks, 1)  # noqa: E731
        else:
            codes = groups[torch.arange(p), :, :, columns].reshape(p, blocks, self.block)
            select = lambda per_column: per_column[torch.arange(p), :, columns].reshape(p, blocks, 1)  # noqa: E731
        codes = codes.float() - CODE_BIAS[self.layout]
        w = select(scales).float() * codes
        if self.layout == U4:
            w = w + select(mins).float()
        return w.reshape(w.shape[0], self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The weight, float32 [n, k]: scale * code (+ min), rounded as float32 computes it."""
        return self._unpack(self.packed, None)[: self.out_features]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight as `dtype` [len(ids), k]: the embedding lookup
        when this layer is a tied LM head."""
        if self.kernel_path:
            half = self.scale_dtype == torch.float16
            n = self.out_features
            return torch.ops.trident.quant_linear_rows(self.packed, ids, n, self.layout, self.block, half, dtype)
        ids = ids.reshape(-1).long()
        return self._unpack(self.packed[ids // PANEL_COLUMNS], ids % PANEL_COLUMNS).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self._rows(x)
        return self._rows(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def rows_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward on 2-D rows as a plain function (flat_decode.py): a decode step makes ~200
        calls, and each attribute lookup and check in forward costs a few microseconds."""
        packed, bias, n, layout, block = self.packed, self.bias, self.out_features, self.layout, self.block
        if not self.kernel_path:
            return lambda rows: F.linear(rows.float(), self.dequantize(), None if bias is None else bias.float()).to(
                rows.dtype
            )
        op, half, path = torch.ops.trident.quant_linear.default, self.scale_dtype == torch.float16, self.kernel_path
        return lambda rows: op(rows, packed, bias, n, layout, block, half, path)

    def extra_repr(self) -> str:
        kind = LAYOUT_NAMES[self.layout] if self.layout != I8 else f"I8 block {self.block}"
        path = self.kernel_path or "torch"
        return f"{self.in_features} -> {self.out_features}, {kind}, {self.scale_dtype} scales, {path}"
