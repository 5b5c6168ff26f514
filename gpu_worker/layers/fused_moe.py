"""A mixture-of-experts layer's routed experts on CPU, in one C++ op (csrc/fused_moe.cpp).

`FusedMoE.from_weights(gate_up, down)` packs the experts' bf16 weights once; `forward(x,
topk_ids, topk_weights)` computes, for each token t,

    out[t] = sum over slots j = 0..k-1, in that order, of
             topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),   e = topk_ids[t, j]

Where it rounds, as the dense bf16 MLP (decoder_layer.py's MLP: a bf16 gate_up projection, then
silu_and_mul) does:
- gate_e x_t and up_e x_t: summed in float32, rounded to bf16;
- silu(gate) rounded to bf16, times up, rounded to bf16: the activation the down projection reads;
- down_e(...): summed in float32 and kept in float32 (not rounded);
- the weighted sum over slots: each product topk_weights * down rounded to float32, added in slot
  order in float32, and rounded to bf16 once at the end.

A token's output bits depend only on its own x, ids and weights: not on the other tokens of the
call, their number, its position among them, or the thread count (the op's header says why).
The op's path ("amx", "avx512_bf16" or "portable") is chosen from the CPU; the amx path's bits
differ from the other two in the last places (each is within float32 rounding of its sums).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.kernels.cpu_kernels import load_fused_moe
from gpu_worker.runtime.huge_pages import in_huge_pages

INTERMEDIATE_ALIGN = 32
"""The packed intermediate width is a multiple of this (the op's k-chunk); zeros pad it."""
ACTIVATION_COLUMNS = 16
"""Gate and up columns are interleaved in runs of this many: one packed block of 32 columns
gives 16 gate and the same 16 up columns, so the op applies the activation per block."""


def fused_moe_available() -> bool:
    """The C++ op can run on this CPU (the kernels built; every x86 CPU they build for has a path)."""
    return load_fused_moe() != ""


def interleave_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """[E, 2 I, H] (each expert's gate rows, then its up rows) -> [E, 2 I', H]: I padded with zero
    rows to I' (a multiple of 32), then runs of 16 gate rows and the same 16 up rows in turn."""
    experts, rows, hidden = gate_up.shape
    inter = rows // 2
    padded = -(-inter // INTERMEDIATE_ALIGN) * INTERMEDIATE_ALIGN
    halves = gate_up.new_zeros(experts, 2, padded, hidden)
    halves[:, :, :inter] = gate_up.view(experts, 2, inter, hidden)
    runs = halves.view(experts, 2, padded // ACTIVATION_COLUMNS, ACTIVATION_COLUMNS, hidden).transpose(1, 2)
    return runs.reshape(experts, 2 * padded, hidden)


class FusedMoE(nn.Module):
    """The routed experts of one layer, packed for csrc/fused_moe.cpp (CPU, bf16)."""

    def __init__(self, packed_gate_up: torch.Tensor, packed_down: torch.Tensor, path: str) -> None:
        super().__init__()
        self.register_buffer("packed_gate_up", packed_gate_up, persistent=False)
        self.register_buffer("packed_down", packed_down, persistent=False)
        self.path = path
        """"auto" (the CPU's best), or "amx", "avx512_bf16", "portable" (tests pin one)."""

    @classmethod
    def from_weights(cls, gate_up: torch.Tensor, down: torch.Tensor, path: str = "auto") -> FusedMoE:
        """gate_up [E, 2 I, H] bf16 (per expert the gate rows, then the up rows, like vLLM's w13);
        down [E, H, I] bf16. Builds (or loads) the kernels on first use."""
        experts, rows, hidden = gate_up.shape
        if rows % 2 or down.shape != (experts, hidden, rows // 2):
            shapes = f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)}"
            raise ValueError(f"{shapes}: want [E, 2 I, H] and [E, H, I]")
        if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
            raise ValueError(f"FusedMoE takes bf16 weights, not {gate_up.dtype} and {down.dtype}")
        if not fused_moe_available():
            raise RuntimeError("the fused MoE op needs the C++ CPU kernels, which did not build here")
        ops = torch.ops.trident
        packed_gate_up = in_huge_pages(ops.fused_moe_pack(interleave_gate_up(gate_up)))
        return cls(packed_gate_up, in_huge_pages(ops.fused_moe_pack(down)), path)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32, topk_weights [T, k] float32 -> [T, H] bf16."""
        return torch.ops.trident.fused_moe(x, topk_ids, topk_weights, self.packed_gate_up, self.packed_down, self.path)
