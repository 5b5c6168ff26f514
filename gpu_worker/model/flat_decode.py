"""The decoder layers of a plain decode step as one flat loop of op calls, for eager CPU steps.

Why: at one row a bf16 decode step of a small model is mostly weight reads, but a large
share is Python around ~300 C++ op calls, and most of that Python is the module tree, not
the ops: eight `nn.Module.__call__` and ~11 submodule lookups per layer (docs/benchmarks.md,
"Method").
Here each layer is a tuple of its weights' call targets, gathered once, and the loop calls
the ops directly. The residual add at the end of a layer goes into the next layer's input
norm (`add_rms_norm`), one op fewer per layer. The family's parts (q/k norms, GeGLU,
sandwich norms, a rope and a window per layer) travel in the tuple.

The ops and their order are the module path's (decoder_layer.py), so the results are the same
bits; tests/test_flat_decode.py checks the logits of both paths for equality.

When: a plain decode step (every row one query, no prompt chunk) on a model with the C++
elementwise ops (cpu_kernels.py), at tp 1, not compiled. Anything else runs the modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from gpu_worker.kernels.cpu_kernels import DecodeKernel, ElementwiseKernels
from gpu_worker.model.attention import AttentionMetadata, paged_attention
from gpu_worker.model.decoder_layer import DecoderLayer
from gpu_worker.model.sparse_moe import SparseMoeBlock

RowsLinear = Callable[[torch.Tensor], torch.Tensor]
"""x [rows, in] -> x @ weight.T + bias [rows, out]: a linear layer as a plain function."""


def rows_linear(module: nn.Module) -> RowsLinear:
    """The cheapest call of a linear layer on 2-D rows: its own `rows_fn` where it has one
    (packed_linear.py), else its forward without `nn.Module.__call__`."""
    rows_fn = getattr(module, "rows_fn", None)
    return rows_fn() if rows_fn is not None else module.forward


class FlatLayer(NamedTuple):
    """One decoder layer's weights and calls, gathered from its modules."""

    input_norm: torch.Tensor
    qkv_proj: RowsLinear
    qk_norm_args: tuple[torch.Tensor, torch.Tensor, float, bool] | tuple[()]
    """Attention.qk_norm_args: the per-head q/k norms rotary_write_kv applies, where the
    family has them."""
    o_proj: RowsLinear
    post_attention_norm: torch.Tensor
    """LLaMA: the MLP's input norm; sandwich norms: the norm of the attention output."""
    pre_feedforward_norm: torch.Tensor | None
    """Sandwich norms only (Gemma 3): the MLP's input norm."""
    gate_up_proj: RowsLinear | None
    activate: Callable[[torch.Tensor], torch.Tensor] | None
    """MLP.activate_fn: SwiGLU or GeGLU, the C++ op itself."""
    down_proj: RowsLinear | None
    sparse_mlp: Callable[[torch.Tensor], torch.Tensor] | None
    """A mixture-of-experts layer's MLP (sparse_moe.py), in place of the three above."""
    post_feedforward_norm: torch.Tensor | None
    """Sandwich norms only: the norm of the MLP output."""
    rope: int
    """Index of the layer's rotary tables in the model's list."""
    window: int
    scale: float

    @classmethod
    def of(cls, layer: DecoderLayer, rope: int) -> FlatLayer:
        attn, mlp = layer.self_attn, layer.mlp
        pre_ffn, post_ffn = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
        sparse = isinstance(mlp, SparseMoeBlock)
        return cls(
            layer.input_layernorm.weight,
            rows_linear(attn.qkv_proj),
            attn.qk_norm_args(),
            rows_linear(attn.o_proj),
            layer.post_attention_layernorm.weight,
            None if pre_ffn is None else pre_ffn.weight,
            None if sparse else rows_linear(mlp.gate_up_proj),
            None if sparse else mlp.activate_fn(),
            None if sparse else rows_linear(mlp.down_proj),
            mlp.forward if sparse else None,
            None if post_ffn is None else post_ffn.weight,
            rope,
            attn.window,
            attn.scale,
        )


class FlatDecodeLoop:
    """A snapshot of the model's layers: build it after the last change to the modules
    (kernels set, linear layers replaced); the model drops it when they change."""

    def __init__(
        self,
        layers: Sequence[DecoderLayer],
        rope_of_layer: Sequence[int],
        kernels: ElementwiseKernels,
        decode_kernel: DecodeKernel | None,
    ) -> None:
        attn, norm = layers[0].self_attn, layers[0].input_layernorm
        self.layers = [FlatLayer.of(layer, rope) for layer, rope in zip(layers, rope_of_layer, strict=True)]
        self.kernels = kernels
        self.decode_kernel = decode_kernel
        self.eps = norm.eps
        self.unit_offset = norm.unit_offset
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.q_size = attn.q_size

    def run(
        self,
        x: torch.Tensor,
        rotary_tables: Sequence[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: Sequence[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [rows, hidden] after the embedding -> the residual stream after the last layer."""
        ops, eps, unit, loc = self.kernels, self.eps, self.unit_offset, meta.out_cache_loc
        heads, kv_heads, q_size, kernel = self.num_heads, self.num_kv_heads, self.q_size, self.decode_kernel
        rotary_write_kv, rms_norm, add_rms_norm = ops.rotary_write_kv, ops.rms_norm, ops.add_rms_norm
        whole_batch = _whole_batch_keys(meta, kernel)
        delta: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if delta is None:
                h = rms_norm(x, layer.input_norm, eps, unit)
            else:
                x, h = add_rms_norm(x, delta, layer.input_norm, eps, unit)
            qkv = layer.qkv_proj(h)
            cos, signed_sin = rotary_tables[layer.rope]
            q = rotary_write_kv(qkv, cos, signed_sin, kv_cache, loc, heads, kv_heads, *layer.qk_norm_args)
            if whole_batch is not None:
                out = kernel(q, kv_cache, *whole_batch, layer.scale, layer.window)  # type: ignore[misc]
            else:
                out = paged_attention(q, None, None, kv_cache, meta, None, kernel, layer.window, layer.scale)
            attn = layer.o_proj(out.reshape(-1, q_size))
            if layer.pre_feedforward_norm is None or layer.post_feedforward_norm is None:
                x, h = add_rms_norm(x, attn, layer.post_attention_norm, eps, unit)
                if layer.sparse_mlp is None:
                    delta = layer.down_proj(layer.activate(layer.gate_up_proj(h)))
                else:
                    delta = layer.sparse_mlp(h)
            else:
                attn = rms_norm(attn, layer.post_attention_norm, eps, unit)
                x, h = add_rms_norm(x, attn, layer.pre_feedforward_norm, eps, unit)
                if layer.sparse_mlp is None:
                    mlp_out = layer.down_proj(layer.activate(layer.gate_up_proj(h)))
                else:
                    mlp_out = layer.sparse_mlp(h)
                delta = rms_norm(mlp_out, layer.post_feedforward_norm, eps, unit)
        assert delta is not None, "a model has at least one layer"
        return x + delta


def _whole_batch_keys(meta: AttentionMetadata, kernel: DecodeKernel | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(kv_indices, kv_lens) when the step's attention is one kernel call over the batch as it
    stands (one group covering it, each row its own index row): the call paged_attention
    makes for such a step, without its dispatch in every layer. None: paged_attention decides."""
    groups = meta.decode_groups
    if kernel is None or meta.query_keys is not None or len(groups) != 1:
        return None
    g = groups[0]
    return (g.kv_indices, g.kv_lens) if g.covers_batch and g.kv_rows is None else None
