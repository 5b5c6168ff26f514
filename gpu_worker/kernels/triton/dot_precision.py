"""The precision of the attention kernels' matmuls, which take their operands in float32.

K and V are read in the pool's dtype and widened to float32: the Triton interpreter (the CPU
tests) cannot multiply bf16 operands, and widening keeps one code path on CPU and GPU. For a
bf16 or fp16 pool, TF32 tensor cores multiply the widened values exactly (TF32 keeps more
mantissa bits than bf16), and sum in float32; a float32 pool asks for IEEE float32.
"""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands that were `dtype` before widening."""
    return "ieee" if dtype == torch.float32 else "tf32"
