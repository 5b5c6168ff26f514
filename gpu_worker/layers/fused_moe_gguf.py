"""A mixture-of-experts layer's routed experts in a GGUF's own quantized formats, in one C++ op
(csrc/fused_moe_gguf.cpp), with moe_experts.py's contract:

    out[t] = sum over slots j = 0..k-1, in that order, of
             topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),   e = topk_ids[t, j]

`FusedQuantMoE.from_weights(gate_up, down)` takes each expert's weights as the load kept them
(gguf_repack.py's U4/I8 weights) and packs each projection of all the experts as one
QuantLinear (quant_linear.py) of their stacked rows, so that every expert shares one layout
and scale type: gate_up [E * 2 I, H], each expert's gate and up rows in runs of 16 in turn
(the op applies the activation per pair of 16-column panels), and down [E * H, I].

The op computes every dot product as quant_linear does (int8 activations, each output summed
block by block in k order) and rounds where each expert's own QuantLinear layers and the
SwiGLU op round (gate and up to x's dtype, silu(gate), then its product with up), but keeps
the down projection in float32 until the weighted sum, which it rounds once. In float32
activations it is bit for bit each expert's own layers weighted in slot order; in bf16 it
differs from them by their rounding of each slot's down output. A token's bits depend only
on its own x, ids and weights: not on the other tokens of the call or their number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from gpu_worker.kernels.cpu_kernels import load_quant_linear
from gpu_worker.layers.gguf_layers import quant_linear
from gpu_worker.layers.gguf_repack import QuantWeights, concat_rows
from gpu_worker.layers.quant_linear import PANEL_COLUMNS, QuantLinear


def fused_quant_moe_path() -> str:
    """The op's path on this CPU ("avx512_vnni" or "avx2", quant_linear's); "": none (the
    kernels did not build, or the CPU has neither)."""
    return load_quant_linear()


def gate_up_in_runs(experts: int, inter: int) -> np.ndarray:
    """The row order of the stacked gate_up [E * 2 I, H] (each expert's I gate rows, then its I
    up rows) that puts 16 gate rows and the same 16 up rows in turn."""
    expert = np.arange(experts).reshape(-1, 1, 1, 1) * 2 * inter
    run = np.arange(inter // PANEL_COLUMNS).reshape(1, -1, 1, 1) * PANEL_COLUMNS
    half = np.arange(2).reshape(1, 1, -1, 1) * inter
    return (expert + run + half + np.arange(PANEL_COLUMNS)).reshape(-1)


class FusedQuantMoE(nn.Module):
    """The routed experts of one layer in their quantized formats, for csrc/fused_moe_gguf.cpp."""

    def __init__(self, gate_up: QuantLinear, down: QuantLinear, path: str) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.path = path
        """"auto" (the CPU's best), or "avx512_vnni", "avx2" (tests pin one)."""

    @classmethod
    def from_weights(
        cls, gate_up: Sequence[QuantWeights], down: Sequence[QuantWeights], path: str = "auto"
    ) -> FusedQuantMoE:
        """Per expert, gate_up [2 I, H] (its gate rows, then its up rows) and down [H, I], each
        projection in one layout for every expert. Raises ValueError where a projection's
        experts or gate and up do not stack into one layout (U4 beside I8)."""
        if not fused_quant_moe_path():
            raise RuntimeError("the fused GGUF MoE op needs the C++ quantized kernels, which do not run here")
        experts, (hidden, inter) = len(down), down[0].shape
        if any(w.shape != (2 * inter, hidden) for w in gate_up) or any(w.shape != (hidden, inter) for w in down):
            raise ValueError(
                f"expert weights of several shapes: want gate_up [{2 * inter}, {hidden}], down {down[0].shape}"
            )
        stacked_down = quant_linear(concat_rows(down), None)  # first: it checks that I is a multiple of 32
        runs = gate_up_in_runs(experts, inter)
        return cls(quant_linear(concat_rows(gate_up).map_rows(lambda a: a[runs]), None), stacked_down, path)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids [T, k] int32, topk_weights [T, k] float32 -> [T, H] in x's dtype."""
        gate_up, down = self.gate_up, self.down
        return torch.ops.trident.fused_moe_gguf(
            x,
            topk_ids,
            topk_weights,
            gate_up.packed,
            gate_up.layout,
            gate_up.block,
            gate_up.scale_dtype == torch.float16,
            down.packed,
            down.layout,
            down.block,
            down.scale_dtype == torch.float16,
            self.path,
        )

    def extra_repr(self) -> str:
        return f"path {self.path}"
