"""RMSNorm, alone or fused with the residual add before it: one program per row (on the GPU).

The reference's rounding order (decoder_layer.py, `RMSNorm`): the sum x + delta rounded to the
model's dtype (it is the residual stream), normalised in float32, cast, then scaled by the
weight in the dtype (LLaMA) or by (1 + weight) in float32 before the cast (Gemma).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(
    X,
    Delta,
    Weight,
    Sum,
    Out,
    rows,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    ok = (r < rows) & (c < HIDDEN)
    at = r.to(tl.int64) * HIDDEN + c
    x = tl.load(X + at, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(Delta + at, mask=ok, other=0.0).to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(Sum + at, x, mask=ok)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 1) / HIDDEN + eps)[:, None]
    w = tl.load(Weight + c, mask=c < HIDDEN, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = normed * (1.0 + w)
    else:
        out = normed.to(Out.dtype.element_ty).to(tl.float32) * w
    tl.store(Out + at, out.to(Out.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool):
    hidden = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else out
    rows = x.numel() // hidden
    # A GPU takes a row per program; the interpreter, which runs programs one by one, a block.
    block_rows = 16 if x.device.type == "cpu" else 1
    if rows:
        _add_rms_norm[(triton.cdiv(rows, block_rows),)](
            x,
            x if delta is None else delta.contiguous(),
            weight,
            total,
            out,
            rows,
            eps,
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            BLOCK_ROWS=block_rows,
            HAS_DELTA=delta is not None,
            UNIT_OFFSET=unit_offset,
        )
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm(x) over the last dim (ElementwiseKernels.rms_norm)."""
    return _launch(x, None, weight, eps, unit_offset)[1]


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) in one pass (ElementwiseKernels.add_rms_norm)."""
    return _launch(x, delta, weight, eps, unit_offset)
