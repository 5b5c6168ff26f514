"""The decoder of every family we serve, in plain torch, reading and writing the paged KV pool.

RMSNorm, rotary embeddings (half-split, as Hugging Face checkpoints store q/k),
grouped-query attention, a gated MLP, tied or separate LM head; q/k/v and gate/up are
fused into one matmul each. What a family switches on (Gemma's (1 + w) norms and four
norms a layer, GeGLU, q/k norms, biases, embedding scale, a rope and a sliding window per
layer) is described in families.py and read here from `cfg.quirks` and `ModelConfig`. Attention itself lives in
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

from gpu_worker.kernels.cpu_kernels import DecodeKernel, ElementwiseKernels
from gpu_worker.layers.gguf_layers import QuantizedParts, narrow, pad_rows, stacked_linear
from gpu_worker.layers.gguf_repack import concat_rows
from gpu_worker.layers.linear_plan import MakeLinear, replace_linear_layers
from gpu_worker.layers.moe_experts import Expert, MakeFusedExperts, MakeFusedQuantExperts, MoeExperts
from gpu_worker.model.attention import AttentionMetadata, ExtendKernel, StraddlingHeadsKernel, paged_attention
from gpu_worker.model.compiled_decode import LayerFn, compile_layer, run_layer, runs_compiled
from gpu_worker.model.flat_decode import FlatDecodeLoop
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.model.moe_checkpoint import per_expert_weights
from gpu_worker.model.rope import RotaryEmbedding
from gpu_worker.model.sparse_moe import SparseMoeBlock
from gpu_worker.runtime.kv_pool import KVPool, write_kv
from gpu_worker.runtime.parallel import ShardPlan, TPGroup

__all__ = ["LlamaForCausalLM", "RMSNorm", "RotaryEmbedding", "apply_rotary"]


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
        attn = self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x, h = self.post_attention_layernorm.add_and_norm(x, attn)
            return x + self.mlp(h)
        x, h = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm(attn))
        return x + self.post_feedforward_layernorm(self.mlp(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.plan = plan or ShardPlan.build(cfg, 0, 1)
        self.tp = tp or TPGroup()
        rows = self.plan.vocab_rows
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.plan, self.tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.quirks.norm_unit_offset)
        specs = [cfg.rope_of(i) for i in range(cfg.num_layers)]
        distinct = list(dict.fromkeys(specs))
        self.rope = nn.ModuleList(RotaryEmbedding(cfg.head_dim, spec, cfg.max_position) for spec in distinct)
        """One table per distinct rope (Gemma 3: local and global); kept in float32 by the worker."""
        self.rope_of_layer = [distinct.index(spec) for spec in specs]
        self.windows = {cfg.window_of(i) for i in range(cfg.num_layers)} - {0}
        """The sliding windows some layer uses: their masks are built once per forward."""
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
        self.quantized_parts = QuantizedParts()
        """Weights loaded in a GGUF's own formats, waiting for install_quantized_weights."""
        self.quantized_embedding: nn.Module | None = None
        """The embedding as a QuantLinear read by rows (gguf_layers.py); None: embed_tokens."""

    def compile_decode(self) -> None:
        self.decode_layer = compile_layer(len({layer.self_attn.window for layer in self.layers}))

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
            self._flat_decode = FlatDecodeLoop(self.layers, self.rope_of_layer, kernels, self.decode_kernel)
        return self._flat_decode

    def use_elementwise_kernels(self, kernels: ElementwiseKernels | None) -> None:
        """Norms, rotary and SwiGLU through the C++ ops in eager steps (None: torch ops)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP | Expert):
                module.kernels = kernels
        self._flat_decode = None

    def use_decode_kernel(self, kernel: DecodeKernel | None) -> None:
        """Decode attention through the C++ kernel (None: through torch). The kernel reads KV
        head h // group for query head h; a tensor-parallel rank whose heads straddle KV
        groups hands it its heads in the slots of whole groups (StraddlingHeadsKernel)."""
        if kernel is not None and not self.plan.uniform_gqa:
            group = self.cfg.num_heads // self.cfg.num_kv_heads
            slots = [kv * group + h % group for h, kv in zip(range(*self.plan.heads), self.plan.kv_of_head)]
            kernel = StraddlingHeadsKernel(kernel, slots, group, self.plan.num_kv_heads)
        self.decode_kernel = kernel
        for layer in self.layers:
            layer.self_attn.decode_kernel = kernel
        self._flat_decode = None

    def use_extend_kernel(self, kernel: ExtendKernel | None) -> None:
        """Prompt chunks' attention through `kernel` (Triton; None: SDPA)."""
        for layer in self.layers:
            layer.self_attn.extend_kernel = kernel

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
        return self.logits(self.last_layer_states(input_ids, positions, kv_pool, meta)[logits_indices])

    @torch.inference_mode()
    def last_layer_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: KVPool, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Runs the flat token batch through every layer; returns the last layer's output of
        every token, before the final norm (`self.norm` of a row is its final hidden state)."""
        x = self.tp.embed(input_ids, self._embedding_rows, self.plan.vocab)
        if self.cfg.quirks.embed_scale:
            x = x * torch.tensor(self.cfg.hidden_size**0.5).to(x.dtype)  # float32, then the dtype: Gemma's rounding
        meta.prepare_gather(self.plan.num_kv_heads, self.gather_kv_heads, self.decode_kernel)
        meta.prepare_windows(self.windows, self.decode_kernel)
        tables = [rope.tables(positions, x.dtype) for rope in self.rope]
        if (flat := self._flat_decode_loop(meta)) is not None:
            x = flat.run(x, tables, kv_pool.kv, meta)
        else:
            run = self.decode_layer if self.decode_layer is not None and runs_compiled(meta) else run_layer
            for layer, kv_cache, rope in zip(self.layers, kv_pool.kv, self.rope_of_layer, strict=True):
                x = run(layer, x, tables[rope], kv_cache, meta)
        return x

    @torch.inference_mode()
    def final_hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of `last_layer_states` through the final norm: what embeddings pool."""
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of rows of `last_layer_states`."""
        x = self.norm(x)
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        logits = self.tp.gather_vocab(logits, self.cfg.vocab_size)
        if cap := self.cfg.final_logit_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_embedding is None:
            return F.embedding(ids, self.embed_tokens.weight)
        return self.quantized_embedding.rows(ids, self.norm.weight.dtype)

    def install_quantized_weights(self) -> None:
        """The weights load_weights kept in the file's formats, as QuantLinear layers
        (gguf_layers.py); call after the cast to the activation dtype (which would cast
        their scales). A tied head and the embedding share one."""
        modules = dict(self.named_modules())
        for name in list(self.quantized_parts.parts):
            path = name.removesuffix(".weight")
            parent_path, _, attr = path.rpartition(".")
            old = modules[path]
            rows = self.plan.vocab_rows if attr == "embed_tokens" else old.out_features
            bias = getattr(old, "bias", None)
            layer = stacked_linear(self.quantized_parts.pop_stacked(name, rows), None if bias is None else bias.data)
            if attr == "embed_tokens":
                self.quantized_embedding = layer
                if self.lm_head is None:
                    self.lm_head = layer
            else:
                setattr(modules[parent_path] if parent_path else self, attr, layer)
        self._flat_decode = None

    def use_fused_experts(self, make: MakeFusedExperts) -> None:
        """Every sparse layer's experts through the fused kernel `make(gate_up, down)` builds
        (layers/moe_experts.py); call after the load and the cast, before the linear plan's install."""
        for module in self.modules():
            if isinstance(module, MoeExperts):
                module.use_fused(make)
        self._flat_decode = None

    def use_fused_quantized_experts(self, make: MakeFusedQuantExperts) -> list[str]:
        """Every sparse layer's experts still in the file's quantized formats through the fused
        kernel `make(gate_up, down)` builds from each expert's weights (gate_up: its gate rows,
        then its up rows); call before install_quantized_weights, which then leaves them be.
        Returns the layers left on their experts' own layers, each with why (a format that was
        dequantized at load; gate and up in two layouts)."""
        parts, left = self.quantized_parts, []
        for path, module in self.named_modules():
            if not isinstance(module, MoeExperts):
                continue
            hidden, inter = module[0].down_proj.out_features, module[0].down_proj.in_features
            names = [(f"{path}.{e}.gate_up_proj.weight", f"{path}.{e}.down_proj.weight") for e in range(len(module))]
            if not all(gate_up in parts and down in parts for gate_up, down in names):
                left.append(f"{path}: experts dequantized at load")
                continue
            try:
                gate_up = [concat_rows(parts.stacked(name, 2 * inter)) for name, _ in names]
                kernel = make(gate_up, [concat_rows(parts.stacked(name, hidden)) for _, name in names])
            except ValueError as e:
                left.append(f"{path}: {e}")
                continue
            for gate_up_name, down_name in names:
                parts.discard(gate_up_name)
                parts.discard(down_name)
            module.use_fused_kernel(kernel)
        self._flat_decode = None
        return left

    def replace_router_layers(self, make: MakeLinear) -> None:
        """`make(weight, bias)` for each dense linear layer left in a sparse layer's MLP (its
        router and shared-expert gate) after install_quantized_weights."""
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                replace_linear_layers(module, make)
        self._flat_decode = None

    def replace_linear_layers(self, make: MakeLinear) -> None:
        """`make(weight, bias)` for every linear layer and for the LM head (the linear kind
        layers/linear_plan.py chose); call after load_weights and the cast to the activation
        dtype. A tied head gets its own copy (the embedding lookup keeps reading the plain rows)."""
        replace_linear_layers(self.layers, make)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head = make(head.data, None)
        self._flat_decode = None

    def load_weights(self, weights) -> None:
        """Takes (name, tensor) pairs in Hugging Face names (full, unsharded tensors); fuses
        q/k/v and gate/up and keeps only this rank's slice of each sharded weight."""
        if self.cfg.quirks.fused_checkpoint:
            weights = split_fused_weights(weights, self.cfg)
        if self.cfg.moe is not None:
            weights = per_expert_weights(weights)
        params = dict(self.named_parameters())
        plan, hd = self.plan, self.cfg.head_dim
        q, kv = plan.num_heads * hd, plan.num_kv_heads * hd
        heads = (plan.heads[0] * hd, q)
        kv_heads = (plan.kv_heads[0] * hd, kv)
        # checkpoint name -> (fused target, row offset in the target, (start, length) in the source)
        attention = {
            "q_proj": ("qkv_proj", 0, heads),
            "k_proj": ("qkv_proj", q, kv_heads),
            "v_proj": ("qkv_proj", q + kv, kv_heads),
        }
        vocab = (plan.vocab[0], plan.vocab[1] - plan.vocab[0])
        loaded: set[str] = set()
        dense: set[str] = set()
        for name, tensor in weights:
            # Gemma 3's multimodal checkpoints hold the decoder under language_model.
            name = name.removeprefix("model.").removeprefix("language_model.").removeprefix("model.")
            if (
                "rotary_emb" in name
                or (name == "lm_head.weight" and self.lm_head is None)
                or name.startswith(("vision_tower.", "multi_modal_projector."))
            ):
                continue
            parts = name.split(".")
            offset = 0
            inter_slice = self._intermediate_slice(name)
            fused = attention | {
                "gate_proj": ("gate_up_proj", 0, inter_slice),
                "up_proj": ("gate_up_proj", inter_slice[1], inter_slice),
            }
            row_parallel = {"o_proj": heads, "down_proj": inter_slice}  # sliced along the input dim
            if len(parts) >= 2 and parts[-2] in fused:
                target, offset, (start, length) = fused[parts[-2]]
                name = ".".join(parts[:-2] + [target, parts[-1]])
                tensor = narrow(tensor, 0, start, length)
                dst = None if name in self.quantized_parts else params[name].data.narrow(0, offset, length)
            elif len(parts) >= 2 and parts[-2] in row_parallel and parts[-1] == "bias" and name in params:
                # The all-reduce sums the ranks' outputs: one rank adds the bias.
                tensor = tensor if plan.rank == 0 else torch.zeros_like(tensor)
                dst = params[name].data
            elif len(parts) >= 2 and parts[-2] in row_parallel and name in params:
                tensor = narrow(tensor, 1, *row_parallel[parts[-2]])
                dst = params[name].data
            elif name in ("embed_tokens.weight", "lm_head.weight") and not isinstance(tensor, torch.Tensor):
                tensor, dst = pad_rows(narrow(tensor, 0, *vocab), plan.vocab_rows), None
            elif name in ("embed_tokens.weight", "lm_head.weight") and name in params:
                tensor = tensor.narrow(0, *vocab)
                dst = params[name].data.narrow(0, 0, vocab[1])  # rows past the vocabulary stay zero
                params[name].data.zero_()
            elif name in params:
                dst = params[name].data
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if isinstance(tensor, torch.Tensor):
                if name in self.quantized_parts:
                    raise ValueError(f"{name}: its parts mix quantized and dense formats; use --weight-dtype bf16")
                dst.copy_(tensor.to(dst.dtype))
                dense.add(name)
            else:
                if name in dense:
                    raise ValueError(f"{name}: its parts mix quantized and dense formats; use --weight-dtype bf16")
                self.quantized_parts.add(name, offset, tensor)
                params[name].data = torch.empty(0)  # never written: no dense copy (gguf_layers.py)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")

    def _intermediate_slice(self, name: str) -> tuple[int, int]:
        """(start, length) of this rank's share of the intermediate dimension of the MLP or
        expert that weight `name` belongs to."""
        plan = self.plan
        if ".experts." in name:
            start, end = plan.expert_intermediate
        elif ".shared_expert." in name:
            start, end = plan.shared_intermediate
        else:
            start, end = plan.intermediate
        return start, end - start


def split_fused_weights(weights, cfg: ModelConfig):
    """Phi-3's fused qkv_proj and gate_up_proj tensors as the q/k/v and gate/up tensors
    load_weights slices and fuses for this rank."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    splits = {
        "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
        "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
    }
    for name, tensor in weights:
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in splits:
            yield name, tensor
            continue
        sizes = splits[parts[-2]]
        if tensor.shape[0] != sum(size for _, size in sizes):
            raise ValueError(f"{name}: {tensor.shape[0]} rows, the config gives {sum(s for _, s in sizes)}")
        for (part, _), piece in zip(sizes, tensor.split([size for _, size in sizes]), strict=True):
            yield ".".join([*parts[:-2], part, parts[-1]]), piece
