"""One decoder layer of every family we serve, in plain torch: its norms, attention and MLP.

RMSNorm, rotary embeddings (half-split, as Hugging Face checkpoints store q/k),
grouped-query attention, a gated MLP; q/k/v and gate/up are fused into one matmul each.
What a family switches on (Gemma's (1 + w) norms and four norms a layer, GeGLU, q/k norms,
biases, a rope and a sliding window per layer) is described in families.py and read here
from `cfg.quirks` and `ModelConfig`. Attention itself lives in `attention.py`; this file
only says what a layer does. On CPU, plain decode steps run the same ops from one flat loop
(`flat_decode.py`): keep the two in step (a test compares them).

Under tensor parallelism (`parallel.py`) every module is built with this rank's slice
(`ShardPlan`); the all-reduces go through `TPGroup`, the identity at tp 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.kernels.cpu_kernels import DecodeKernel, ElementwiseKernels
from gpu_worker.model.attention import AttentionMetadata, ExtendKernel, paged_attention
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.model.sparse_moe import SparseMoeBlock
from gpu_worker.runtime.kv_pool import write_kv
from gpu_worker.runtime.parallel import ShardPlan, TPGroup


def eager_kernels(kernels: ElementwiseKernels | None) -> ElementwiseKernels | None:
    """The C++ elementwise ops, unless a graph is being compiled: inductor fuses the torch
    ops with their neighbours itself."""
    return None if kernels is None or torch.compiler.is_compiling() else kernels


class RMSNorm(nn.Module):
    """Normalised in float32, then cast, then scaled by the weight (the reference's order);
    F.rms_norm is one fused kernel where the reference spells out six ops, and the C++ op
    (csrc/rms_norm.cpp) does all of it in one pass."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        """Scale by (1 + weight), multiplied in float32 before the cast (Gemma's order)."""
        self.kernels: ElementwiseKernels | None = None
        """The C++ ops (cpu_kernels.py), set by the model on CPU; None: torch ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels := eager_kernels(self.kernels):
            return kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the next sublayer's input."""
        if kernels := eager_kernels(self.kernels):
            return kernels.add_rms_norm(x, delta, self.weight, self.eps, self.unit_offset)
        x = x + delta
        return x, self(x)


def apply_rotary(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, over [tokens, heads, dim]; the same products and sum
    as the reference, so the same bits, in four ops instead of ten. The halves are swapped
    by a cat, not `roll`: the same result, far cheaper on CPU at decode sizes."""
    cos, signed_sin = rotary
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read; o_proj is row-parallel."""

    def __init__(self, cfg: ModelConfig, layer_id: int, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads = plan.num_heads
        self.num_kv_heads = plan.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.window = cfg.window_of(layer_id)
        """Keys a query sees, counting itself (0: all): the layer's sliding window."""
        self.scale = cfg.attention_scale
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        unit_offset = cfg.quirks.norm_unit_offset
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, unit_offset) if cfg.quirks.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, unit_offset) if cfg.quirks.qk_norm else None
        kv_map = None if plan.uniform_gqa else torch.tensor(plan.kv_of_head, dtype=torch.int64)
        self.register_buffer("kv_head_map", kv_map, persistent=False)
        self.decode_kernel: DecodeKernel | None = None
        """The C++ decode attention op (cpu_kernels.py), set by the model; None: torch."""
        self.extend_kernel: ExtendKernel | None = None
        """The Triton prompt-chunk attention (--attention-backend triton); None: SDPA."""
        self.kernels: ElementwiseKernels | None = None
        """The C++ rotary (cpu_kernels.py), set by the model on CPU; None: torch ops."""

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """kv_cache: this layer's tensor of the pool (kv_pool.py)."""
        qkv = self.qkv_proj(x)
        kernels = eager_kernels(self.kernels)
        if kernels is not None and meta.reads_pool_only():
            # Attention reads K/V from the pool only: one op norms q and k (where the family
            # does), rotates q and writes the new K/V there, where the lines below take ~10
            # ops a layer.
            q = kernels.rotary_write_kv(
                qkv, *rotary, kv_cache, meta.out_cache_loc, self.num_heads, self.num_kv_heads, *self.qk_norm_args()
            )
            k = v = None
        else:
            qkv = self.norm_qk(qkv)
            # q and k sit side by side in qkv: one rotary over both heads at once.
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = kernels.rotary(qk, *rotary) if kernels else apply_rotary(qk, rotary)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
            write_kv(kv_cache, meta.out_cache_loc, k, v)
        out = paged_attention(
            q, k, v, kv_cache, meta, self.kv_head_map, self.decode_kernel, self.window, self.scale, self.extend_kernel
        )
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))

    def qk_norm_args(self) -> tuple[torch.Tensor, torch.Tensor, float, bool] | tuple[()]:
        """rotary_write_kv's trailing arguments: the q and k norms, if the family has them."""
        if self.q_norm is None or self.k_norm is None:
            return ()
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.unit_offset

    def norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each q and k head RMS-normalised (Qwen3, Gemma 3), before the rotary;
        unchanged where the family has no q/k norm."""
        if self.q_norm is None or self.k_norm is None:
            return qkv
        tokens = qkv.shape[0]
        q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.head_dim)).view(tokens, self.q_size)
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.head_dim))
        return torch.cat((q, k.view(tokens, self.kv_size), qkv[:, self.q_size + self.kv_size :]), dim=-1)


class MLP(nn.Module):
    """This rank's slice of gate and of up (column-parallel); down_proj is row-parallel."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = plan.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)
        self.activation = cfg.activation
        """"silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
        self.kernels: ElementwiseKernels | None = None
        """The C++ gated activations (cpu_kernels.py), set by the model on CPU; None: torch ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.activate(self.gate_up_proj(x))))

    def activate_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """activate as a plain function for eager steps (flat_decode.py): the C++ op itself
        where the model set one, without the per-call checks; rebuild it when kernels change."""
        if self.kernels is None:
            return self.activate
        return self.kernels.gelu_tanh_and_mul if self.activation == "gelu_tanh" else self.kernels.silu_and_mul

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """activation(gate) * up."""
        gelu = self.activation == "gelu_tanh"
        if kernels := eager_kernels(self.kernels):
            return kernels.gelu_tanh_and_mul(gate_up) if gelu else kernels.silu_and_mul(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


class DecoderLayer(nn.Module):
    """LLaMA: x += attn(input_norm(x)); x += mlp(post_attention_norm(x)). With the family's
    sandwich norms (Gemma 3): x += post_attention_norm(attn(input_norm(x)));
    x += post_feedforward_norm(mlp(pre_feedforward_norm(x)))."""

    def __init__(self, cfg: ModelConfig, layer_id: int, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        eps, unit_offset = cfg.rms_norm_eps, cfg.quirks.norm_unit_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset)
        self.self_attn = Attention(cfg, layer_id, plan, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset)
        self.mlp = SparseMoeBlock(cfg, plan, tp) if cfg.is_sparse(layer_id) else MLP(cfg, plan, tp)
        sandwich = cfg.quirks.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset) if sandwich else None

    def forward(self, x, rotary, kv_cache, meta):
        x, delta = self.forward_deferred(x, None, rotary, kv_cache, meta)
        return x + delta

    def forward_deferred(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, delta): the layer with the residual adds at its ends left to the
        norms. `pending`, the previous layer's delta (None: there is none), goes into x with
        this layer's input norm (`add_and_norm`: one op where the add is otherwise its own,
        the same bits); the layer's own output comes back as delta, for the next layer's
        input norm or the caller's `x + delta`. flat_decode.py chains its layers the same way."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, pending)
        attn = self.self_attn(h, rotary, kv_cache, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x, h = self.post_attention_layernorm.add_and_norm(x, attn)
            return x, self.mlp(h)
        x, h = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm(attn))
        return x, self.post_feedforward_layernorm(self.mlp(h))
