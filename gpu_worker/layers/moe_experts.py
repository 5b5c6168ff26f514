"""The routed experts of a mixture-of-experts layer: each token through its top-k SwiGLU
experts, weighted and summed.

    out[t] = sum over slots j = 0..k-1, in that order, of
             topk_weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = topk_ids[t, j]

accumulated in float32. Two implementations share this contract:
- the torch path here: the token slots are sorted by expert, so each expert's weights are
  read once a step for all of its tokens, through the expert's own linear layers. Those are
  `nn.Linear` modules, so the model's linear plan (linear_plan.py) swaps in its kind for
  every expert as for any layer: our bf16 kernels (batch invariant: each row summed alone,
  in one order), int8, or a GGUF's own formats (`install_quantized_weights`, quant_linear.py).
  Each slot's output is then weighted and the k slots summed in slot order, so a token's
  output does not depend on which other tokens share its experts.
- a fused kernel (`FusedExperts`, csrc), installed with `MoeExperts.use_fused`: the stacked
  bf16 weights go to its constructor and the per-expert layers are dropped; or, for a GGUF's
  quantized experts (fused_moe_gguf.py), built by the model from the parts its load kept
  aside and handed over with `MoeExperts.use_fused_kernel`.

Under tensor parallelism every rank holds a slice of each expert's intermediate dimension
(gate/up rows, down columns); the caller all-reduces the sum (model/sparse_moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.kernels.cpu_kernels import ElementwiseKernels

if TYPE_CHECKING:
    from gpu_worker.layers.gguf_repack import QuantWeights


class FusedExperts(Protocol):
    """A fused MoE kernel with this module's contract (the module docstring)."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor: ...


MakeFusedExperts = Callable[[torch.Tensor, torch.Tensor], FusedExperts]
"""(gate_up [E, 2I, H], down [E, H, I]) -> the kernel: gate rows then up rows per expert."""
MakeFusedQuantExperts = Callable[[list["QuantWeights"], list["QuantWeights"]], FusedExperts]
"""(per expert gate_up [2I, H] and down [H, I], in a GGUF's quantized formats) -> the kernel."""


def swiglu(gate_up: torch.Tensor, kernels: ElementwiseKernels | None) -> torch.Tensor:
    """silu(gate) * up of [rows, 2I] (gate first), through the C++ op where set."""
    if kernels is not None and not torch.compiler.is_compiling():
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Expert(nn.Module):
    """One SwiGLU expert's share on this rank: gate_up_proj (gate rows, then up rows), down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.kernels: ElementwiseKernels | None = None
        """The C++ SwiGLU (cpu_kernels.py), set by the model on CPU; None: torch ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x), self.kernels))


class MoeExperts(nn.ModuleList):
    """Expert e is `self[e]` (checkpoint names `experts.e.gate_proj` ... fill it), until
    `use_fused` hands the stacked weights to a fused kernel."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(Expert(hidden_size, intermediate_size) for _ in range(num_experts))
        self.num_experts = num_experts
        self.fused: FusedExperts | None = None

    def use_fused(self, make: MakeFusedExperts) -> None:
        """Every expert through the fused kernel `make(gate_up, down)` builds; call after the
        load and the cast, before the linear plan replaces the experts' nn.Linear layers."""
        experts = list(self)
        gate_up = torch.stack([e.gate_up_proj.weight.data for e in experts])
        down = torch.stack([e.down_proj.weight.data for e in experts])
        self.use_fused_kernel(make(gate_up, down))

    def use_fused_kernel(self, kernel: FusedExperts) -> None:
        """Every expert through `kernel`, built from their weights; the per-expert layers go."""
        del self[:]
        # Kept out of the list's children (a kernel that is an nn.Module would otherwise
        # register as one): the children are the experts by index.
        object.__setattr__(self, "fused", kernel)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids int [T, k], topk_weights float32 [T, k] -> [T, H] in x's dtype."""
        if self.fused is not None:
            return self.fused.forward(x, topk_ids, topk_weights)
        tokens, k = topk_ids.shape
        slots = topk_ids.reshape(-1)
        # Slots grouped by expert; within an expert, in token order (a stable sort).
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.num_experts).tolist()
        slot_out = torch.empty(tokens * k, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in zip(self, counts, strict=True):
            if count:
                chosen = order[start : start + count]
                slot_out[chosen] = expert(x[chosen // k]).float()
                start += count
        weighted = slot_out.view(tokens, k, -1) * topk_weights.unsqueeze(-1)
        out = weighted[:, 0]
        for j in range(1, k):  # slot order, whatever the batch
            out = out + weighted[:, j]
        return out.to(x.dtype)
