"""The decoder layers of a plain decode step as one flat loop of op calls, for eager CPU steps.

Why: at one row a bf16 decode step of SmolLM2 is ~12 ms of weight reads and ~4 ms of
Python around ~300 C++ op calls. Most of that Python is the module tree, not the ops:
eight `nn.Module.__call__` and ~11 submodule lookups per layer, each a microsecond or more.
Here each layer is a tuple of its weights' call targets, gathered once, and the loop calls
the ops directly. The residual add at the end of a layer goes into the next layer's input
norm (`add_rms_norm`), one op fewer per layer.

The ops and their order are the module path's (model.py), so the results are the same
bits; tests/test_flat_decode.py checks the logits of both paths for equality.

When: a plain decode step (every row one query, no prompt chunk) on a model with the C++
elementwise ops (cpu_kernels.py), at tp 1, not compiled. Anything else runs the modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from gpu_worker.attention import AttentionMetadata, paged_attention
from gpu_worker.cpu_kernels import DecodeKernel, ElementwiseKernels

if TYPE_CHECKING:
    from gpu_worker.model import DecoderLayer

RowsLinear = Callable[[torch.Tensor], torch.Tensor]
"""x [rows, in] -> x @ weight.T + bias [rows, out]: a linear layer as a plain function."""


def rows_linear(module: nn.Module) -> RowsLinear:
    """The cheapest call of a linear layer on 2-D rows: its own `rows_fn` where it has one
    (packed_linear.py), else its forward without `nn.Module.__call__`."""
    rows_fn = getattr(module, "rows_fn", None)
    return rows_fn() if rows_fn is not None else module.forward


class FlatLayer(NamedTuple):
    """One decoder layer's weights and linear calls, gathered from its modules."""

    input_norm: torch.Tensor
    qkv_proj: RowsLinear
    o_proj: RowsLinear
    post_norm: torch.Tensor
    gate_up_proj: RowsLinear
    down_proj: RowsLinear

    @classmethod
    def of(cls, layer: DecoderLayer) -> FlatLayer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            layer.input_layernorm.weight,
            rows_linear(attn.qkv_proj),
            rows_linear(attn.o_proj),
            layer.post_attention_layernorm.weight,
            rows_linear(mlp.gate_up_proj),
            rows_linear(mlp.down_proj),
        )


class FlatDecodeLoop:
    """A snapshot of the model's layers: build it after the last change to the modules
    (kernels set, linear layers replaced); the model drops it when they change."""

    def __init__(
        self,
        layers: Sequence[DecoderLayer],
        kernels: ElementwiseKernels,
        decode_kernel: DecodeKernel | None,
        eps: float,
    ) -> None:
        attn = layers[0].self_attn
        self.layers = [FlatLayer.of(layer) for layer in layers]
        self.kernels = kernels
        self.decode_kernel = decode_kernel
        self.eps = eps
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.q_size = attn.q_size

    def run(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: Sequence[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [rows, hidden] after the embedding -> the residual stream after the last layer."""
        ops, eps, loc = self.kernels, self.eps, meta.out_cache_loc
        cos, signed_sin = rotary
        delta: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if delta is None:
                h = ops.rms_norm(x, layer.input_norm, eps)
            else:
                x, h = ops.add_rms_norm(x, delta, layer.input_norm, eps)
            qkv = layer.qkv_proj(h)
            q = ops.rotary_write_kv(qkv, cos, signed_sin, kv_cache, loc, self.num_heads, self.num_kv_heads)
            out = paged_attention(q, None, None, kv_cache, meta, None, self.decode_kernel)
            x, h = ops.add_rms_norm(x, layer.o_proj(out.reshape(-1, self.q_size)), layer.post_norm, eps)
            delta = layer.down_proj(ops.silu_and_mul(layer.gate_up_proj(h)))
        assert delta is not None, "a model has at least one layer"
        return x + delta
