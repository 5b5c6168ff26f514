"""A LLaMA-family decoder in plain torch, reading and writing the paged KV pool.

RMSNorm, rotary embeddings (half-split, as Hugging Face checkpoints store q/k),
grouped-query attention, SwiGLU MLP, optional q/k/v bias (Qwen2), tied or separate LM
head. q/k/v and gate/up are fused into one matmul each. Attention itself lives in
`attention.py`; this file only says what a layer does. On CPU, plain decode steps run the
same ops from one flat loop (`flat_decode.py`): keep the two in step (a test compares them).

Under tensor parallelism (`parallel.py`) every module is built with this rank's slice
(`ShardPlan`) and `load_weights` copies only that slice out of the full checkpoint tensors;
the all-reduces and the logits all-gather go through `TPGroup`, the identity at tp 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attention import AttentionMetadata, paged_attention
from gpu_worker.compiled_decode import LayerFn, compile_layer, run_layer, runs_compiled
from gpu_worker.cpu_kernels import Bf16LinearKernel, DecodeKernel, ElementwiseKernels
from gpu_worker.flat_decode import FlatDecodeLoop
from gpu_worker.int8_weights import Int8Linear
from gpu_worker.kv_pool import KVPool, write_kv
from gpu_worker.model_config import ModelConfig
from gpu_worker.packed_linear import PackedLinear, WideningBf16Linear, replace_linear_layers
from gpu_worker.parallel import ShardPlan, TPGroup


def eager_kernels(kernels: ElementwiseKernels | None) -> ElementwiseKernels | None:
    """The C++ elementwise ops, unless a graph is being compiled: inductor fuses the torch
    ops with their neighbours itself."""
    return None if kernels is None or torch.compiler.is_compiling() else kernels


class RMSNorm(nn.Module):
    """Normalised in float32, then cast, then scaled by the weight (the reference's order);
    F.rms_norm is one fused kernel where the reference spells out six ops, and the C++ op
    (csrc/rms_norm.cpp) does all of it in one pass."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: ElementwiseKernels | None = None
        """The C++ ops (cpu_kernels.py), set by the model on CPU; None: torch ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels := eager_kernels(self.kernels):
            return kernels.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the next sublayer's input."""
        if kernels := eager_kernels(self.kernels):
            return kernels.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by position; computed in float32 as the reference does."""

    def __init__(self, head_dim: int, theta: float, max_position: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos().repeat(1, 2), persistent=False)
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table.
        self.register_buffer("signed_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/signed sin for this batch's positions, looked up once per forward, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, over [tokens, heads, dim]; the same products and sum
    as the reference, so the same bits, in four ops instead of ten. The halves are swapped
    by a cat, not `roll`: the same result, ~10x cheaper on CPU at decode sizes."""
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
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        kv_map = None if plan.uniform_gqa else torch.tensor(plan.kv_of_head, dtype=torch.int64)
        self.register_buffer("kv_head_map", kv_map, persistent=False)
        self.decode_kernel: DecodeKernel | None = None
        """The C++ decode attention op (cpu_kernels.py), set by the model; None: torch."""
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
        if kernels is not None and not meta.extend_rows:
            # A decode step reads K/V from the pool only: one op rotates q and writes the new
            # K/V there, where the lines below take ~10 ops a layer.
            q = kernels.rotary_write_kv(qkv, *rotary, kv_cache, meta.out_cache_loc, self.num_heads, self.num_kv_heads)
            k = v = None
        else:
            # q and k sit side by side in qkv: one rotary over both heads at once.
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = kernels.rotary(qk, *rotary) if kernels else apply_rotary(qk, rotary)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
            write_kv(kv_cache, meta.out_cache_loc, k, v)
        out = paged_attention(q, k, v, kv_cache, meta, self.kv_head_map, self.decode_kernel)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    """This rank's slice of gate and of up (column-parallel); down_proj is row-parallel."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = plan.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)
        self.kernels: ElementwiseKernels | None = None
        """The C++ silu_and_mul (cpu_kernels.py), set by the model on CPU; None: torch ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels := eager_kernels(self.kernels):
            activated = kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            activated = F.silu(gate) * up
        return self.tp.all_reduce(self.down_proj(activated))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, plan, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, plan, tp)

    def forward(self, x, rotary, kv_cache, meta):
        x, h = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        )
        return x + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.plan = plan or ShardPlan.build(cfg, 0, 1)
        self.tp = tp or TPGroup()
        rows = self.plan.vocab_rows
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.plan, self.tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, rows, bias=False)
        # The pool's KV head behind each head of the decode gather: one per KV head, or one per
        # query head when this rank's heads straddle KV groups.
        heads_of_gather = range(self.plan.num_kv_heads) if self.plan.uniform_gqa else self.plan.kv_of_head
        self.register_buffer(
            "gather_kv_heads", torch.tensor(list(heads_of_gather), dtype=torch.int64), persistent=False
        )
        self.decode_layer: LayerFn | None = None
        """The compiled layer of plain decode steps (compiled_decode.py); None: eager."""
        self.decode_kernel: DecodeKernel | None = None
        """The C++ decode attention op every layer uses (cpu_kernels.py); None: torch."""
        self.flat_decode_enabled = True
        """Plain decode steps through FlatDecodeLoop where it applies (flat_decode.py);
        use_flat_decode turns it off for A/B runs and tests."""
        self._flat_decode: FlatDecodeLoop | None = None
        """Built at the first step that takes it, from the modules as they are then;
        dropped whenever the kernels or the linear layers change."""

    def compile_decode(self) -> None:
        self.decode_layer = compile_layer()

    def use_flat_decode(self, enabled: bool) -> None:
        """Plain decode steps through flat_decode.py (True) or the modules; either way the
        loop is rebuilt from the current modules at its next use (call this after swapping
        modules by hand)."""
        self.flat_decode_enabled = enabled
        self._flat_decode = None

    def _flat_decode_loop(self, meta: AttentionMetadata) -> FlatDecodeLoop | None:
        kernels = self.norm.kernels
        if (
            not self.flat_decode_enabled
            or kernels is None
            or self.tp.size > 1
            or self.decode_layer is not None
            or not meta.is_plain_decode()
        ):
            return None
        if self._flat_decode is None:
            self._flat_decode = FlatDecodeLoop(self.layers, kernels, self.decode_kernel, self.cfg.rms_norm_eps)
        return self._flat_decode

    def use_elementwise_kernels(self, kernels: ElementwiseKernels | None) -> None:
        """Norms, rotary and SwiGLU through the C++ ops in eager steps (None: torch ops)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels
        self._flat_decode = None

    def use_decode_kernel(self, kernel: DecodeKernel | None) -> None:
        """Decode attention through the C++ kernel (None: through torch). The kernel reads KV
        head h // group for query head h, so a tensor-parallel rank whose heads straddle KV
        groups keeps the torch path."""
        if not self.plan.uniform_gqa:
            kernel = None
        self.decode_kernel = kernel
        for layer in self.layers:
            layer.self_attn.decode_kernel = kernel
        self._flat_decode = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Runs the flat token batch; returns the logits (in the model's dtype: the sampler
        converts them when it needs float32) of the rows in logits_indices."""
        x = self.tp.embed(input_ids, self.embed_tokens.weight, self.plan.vocab)
        meta.prepare_gather(self.plan.num_kv_heads, self.gather_kv_heads, self.decode_kernel)
        rotary = self.rope.tables(positions, x.dtype)
        if (flat := self._flat_decode_loop(meta)) is not None:
            x = flat.run(x, rotary, kv_pool.kv, meta)
        else:
            run = self.decode_layer if self.decode_layer is not None and runs_compiled(meta) else run_layer
            for layer, kv_cache in zip(self.layers, kv_pool.kv):
                x = run(layer, x, rotary, kv_cache, meta)
        x = self.norm(x[logits_indices])
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        return self.tp.gather_vocab(logits, self.cfg.vocab_size)

    def quantize_weights_int8(self) -> None:
        """Every linear layer and the LM head to weight-only int8 (int8_weights.py); call
        after load_weights and the cast to the activation dtype."""
        self._replace_linear_layers(Int8Linear)

    def pack_linear_weights(self, vnni: Bf16LinearKernel | None = None) -> None:
        """Every linear layer and the LM head to oneDNN-packed weights (packed_linear.py),
        and decode batches through the `vnni` kernel when given; call after load_weights
        and the cast."""
        self._replace_linear_layers(lambda weight, bias: PackedLinear(weight, bias, vnni))

    def widen_linear_weights(self, kernel: Bf16LinearKernel) -> None:
        """Every linear layer and the LM head to `WideningBf16Linear` (packed_linear.py), for
        bf16 on CPUs without bf16 arithmetic; call after load_weights and the cast."""
        self._replace_linear_layers(lambda weight, bias: WideningBf16Linear(weight, bias, kernel))

    def _replace_linear_layers(self, make) -> None:
        """`make(weight, bias)` for every linear layer and for the LM head; a tied head gets
        its own copy (the embedding lookup keeps reading the plain rows)."""
        replace_linear_layers(self.layers, make)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head = make(head.data, None)
        self._flat_decode = None

    def load_weights(self, weights) -> None:
        """Takes (name, tensor) pairs in Hugging Face LLaMA names (full, unsharded tensors);
        fuses q/k/v and gate/up and keeps only this rank's slice of each sharded weight."""
        params = dict(self.named_parameters())
        plan, hd = self.plan, self.cfg.head_dim
        q, kv, inter = plan.num_heads * hd, plan.num_kv_heads * hd, plan.intermediate_size
        heads = (plan.heads[0] * hd, q)
        kv_heads = (plan.kv_heads[0] * hd, kv)
        inter_slice = (plan.intermediate[0], inter)
        # checkpoint name -> (fused target, row offset in the target, (start, length) in the source)
        fused = {
            "q_proj": ("qkv_proj", 0, heads),
            "k_proj": ("qkv_proj", q, kv_heads),
            "v_proj": ("qkv_proj", q + kv, kv_heads),
            "gate_proj": ("gate_up_proj", 0, inter_slice),
            "up_proj": ("gate_up_proj", inter, inter_slice),
        }
        row_parallel = {"o_proj": heads, "down_proj": inter_slice}  # sliced along the input dim
        vocab = (plan.vocab[0], plan.vocab[1] - plan.vocab[0])
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, offset, (start, length) = fused[parts[-2]]
                name = ".".join(parts[:-2] + [target, parts[-1]])
                tensor = tensor.narrow(0, start, length)
                dst = params[name].data.narrow(0, offset, length)
            elif len(parts) >= 2 and parts[-2] in row_parallel and name in params:
                tensor = tensor.narrow(1, *row_parallel[parts[-2]])
                dst = params[name].data
            elif name in ("embed_tokens.weight", "lm_head.weight") and name in params:
                tensor = tensor.narrow(0, *vocab)
                dst = params[name].data.narrow(0, 0, vocab[1])  # rows past the vocabulary stay zero
                params[name].data.zero_()
            elif name in params:
                dst = params[name].data
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dst.copy_(tensor.to(dst.dtype))
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
