"""Weight-only int8 linear layers (`--weight-dtype int8`), for CPU decoding at small batches.

One decode stream is bound by reading the weights: every step reads all of them for one
token. Stored as int8 with one scale per output channel, they are half the bytes of
bf16, and `torch.ops.aten._weight_int8pack_mm` (torch's CPU kernel for exactly this:
activations in bf16/fp32, int8 weights, per-channel scales) reads them at about twice
the speed at batch 1. From batch ~8 up the step is bound by arithmetic instead, where
the kernel is slower than the bf16 matmul: this is for latency, not for throughput.

Activations, the KV cache, norms and embeddings keep --dtype; the tied LM head gets an
int8 copy (the embedding lookup still reads the original rows).
"""

from __future__ import annotations

import torch
from torch import nn


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale per output row: weight ~ q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q, scale = quantize_per_channel(weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(weight.dtype))
        self.register_buffer("bias", bias)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    if device.type != "cpu":
        raise ValueError("--weight-dtype int8 uses torch's CPU kernel (_weight_int8pack_mm); it runs on --device cpu")
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(f"--weight-dtype int8 needs floating-point activations, not {dtype}")
