"""The decoder model of every family we serve (`LlamaForCausalLM`): the embedding, the
layers (decoder_layer.py), the final norm and the LM head, tied or separate, and the steps
that swap kernels and linear layers in after the load.

The forward runs each step one of three ways: plain decode steps on CPU through one flat
loop (`flat_decode.py`), or through one compiled layer (`compiled_decode.py`, --compile),
and every other step through the modules, the reference the other two must match. A
family's embedding scale and final logit softcap are applied here (families.py).

Under tensor parallelism (`parallel.py`) the model is built with this rank's slice
(`ShardPlan`) and `load_weights` (weight_loading.py) copies only that slice out of the full
checkpoint tensors; the logits all-gather goes through `TPGroup`, the identity at tp 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.kernels.cpu_kernels import DecodeKernel, ElementwiseKernels
from gpu_worker.layers.gguf_layers import QuantizedParts, stacked_linear
from gpu_worker.layers.gguf_repack import concat_rows
from gpu_worker.layers.linear_plan import MakeLinear, replace_linear_layers
from gpu_worker.layers.moe_experts import Expert, MakeFusedExperts, MakeFusedQuantExperts, MoeExperts
from gpu_worker.model.attention import AttentionMetadata, ExtendKernel, StraddlingHeadsKernel
from gpu_worker.model.compiled_decode import LayerFn, compile_layer, runs_compiled
from gpu_worker.model.decoder_layer import MLP, Attention, DecoderLayer, RMSNorm
from gpu_worker.model.flat_decode import FlatDecodeLoop
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.model.rope import RotaryEmbedding
from gpu_worker.model.sparse_moe import SparseMoeBlock
from gpu_worker.model.weight_loading import load_checkpoint_weights
from gpu_worker.runtime.kv_pool import KVPool
from gpu_worker.runtime.parallel import ShardPlan, TPGroup


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
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Runs the flat token batch; returns the logits (in the model's dtype: the sampler
        converts them when it needs float32) of the rows in logits_indices (None: of every
        row, as in a decode step, without an index copy)."""
        states = self.last_layer_states(input_ids, positions, kv_pool, meta)
        return self.logits(states if logits_indices is None else states[logits_indices])

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
            return flat.run(x, tables, kv_pool.kv, meta)
        layers = zip(self.layers, kv_pool.kv, self.rope_of_layer, strict=True)
        if self.decode_layer is not None and runs_compiled(meta):
            for layer, kv_cache, rope in layers:
                x = self.decode_layer(layer, x, tables[rope], kv_cache, meta)
            return x
        # Eager: each layer's residual add goes into the next layer's input norm.
        delta: torch.Tensor | None = None
        for layer, kv_cache, rope in layers:
            x, delta = layer.forward_deferred(x, delta, tables[rope], kv_cache, meta)
        assert delta is not None, "a model has at least one layer"
        return x + delta

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
        """(name, tensor) pairs in Hugging Face names, full and unsharded, into this rank's
        slice of the modules (weight_loading.py)."""
        load_checkpoint_weights(self, weights)
