"""The decoder's shape and per-model values, read from a GGUF header or a Hugging Face config.json.

What a family does differently is in families.py; this holds the numbers of one checkpoint
(sizes, rope per layer, window per layer, attention scale, biases).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from gpu_worker.model.families import ACTIVATIONS, Family, UnsupportedModelError, WindowLayers, family_named, family_of
from gpu_worker.model.moe_spec import MoeSpec
from gpu_worker.model.rope_spec import RopeSpec


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    """The rope base of every layer when layer_rope is empty."""
    max_position: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    """A bias on q/k/v (Qwen2 always; others when the config's attention_bias says so)."""
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    family: str = "llama"
    """The families.py entry whose quirks the decoder applies."""
    activation: str = "silu"
    """The MLP gate's activation: "silu" or "gelu_tanh"."""
    o_bias: bool = False
    """A bias on o_proj (attention_bias in LLaMA, Qwen3, Gemma 3)."""
    layer_rope: tuple[RopeSpec, ...] = ()
    """Each layer's rope; empty: RopeSpec(rope_theta) for every layer."""
    layer_windows: tuple[int, ...] = ()
    """Each layer's sliding window: a query at position p sees keys p - w + 1 .. p; 0: the
    whole sequence. Empty: no layer has a window."""
    query_pre_attn_scalar: float | None = None
    """Attention scale is this ** -0.5 (Gemma); None: head_dim ** -0.5."""
    final_logit_softcap: float | None = None
    """logits = cap * tanh(logits / cap) when set (Gemma 3 configs may set it)."""
    moe: MoeSpec | None = None
    """The experts of a mixture-of-experts family (moe_spec.py); None: every layer is dense."""

    @property
    def quirks(self) -> Family:
        return family_named(self.family)

    def rope_of(self, layer: int) -> RopeSpec:
        return self.layer_rope[layer] if self.layer_rope else RopeSpec(self.rope_theta)

    def is_sparse(self, layer: int) -> bool:
        """The layer's MLP is the routed experts (moe_spec.py), not the dense MLP."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def window_of(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type == "gemma3" and "text_config" in cfg:
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        family = family_of(model_type)
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        max_position = cfg.get("max_position_embeddings", 2048)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.activation
        if act_name not in ACTIVATIONS:
            raise UnsupportedModelError(f"config.json: activation {act_name!r} is not supported")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("config.json: mlp_bias is not supported")
        if cfg.get("attn_logit_softcapping"):
            raise UnsupportedModelError("config.json: attn_logit_softcapping is not supported")
        bias = bool(cfg.get("attention_bias", False))
        layer_rope = _layer_rope(cfg, family, layers, max_position)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=layer_rope[0].theta,
            max_position=max_position,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=family.qkv_bias if family.qkv_bias is not None else bias,
            eos_token_ids=eos_ids,
            family=family.name,
            activation=ACTIVATIONS[act_name],
            o_bias=bias and family.o_bias_from_config,
            layer_rope=layer_rope,
            layer_windows=_layer_windows(cfg, family, layers),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if family.query_pre_attn_scalar else None,
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            moe=MoeSpec.from_hf(cfg, layers, family.norm_topk_prob, family.shared_expert) if family.experts else None,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_dict(json.load(f))


def _layer_types(cfg: dict, layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        if not pattern:
            return ["full_attention"] * layers
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers:
        raise UnsupportedModelError(f"config.json: {len(types)} layer_types for {layers} layers")
    return list(types)


def _layer_windows(cfg: dict, family: Family, layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window") or 0
    if not window or family.window_layers is WindowLayers.NONE:
        return ()
    if family.window_layers is WindowLayers.EVERY:
        return (window,) * layers
    return tuple(window if t == "sliding_attention" else 0 for t in _layer_types(cfg, layers))


def _layer_rope(cfg: dict, family: Family, layers: int, max_position: int) -> tuple[RopeSpec, ...]:
    """Each layer's rope from transformers v5 `rope_parameters` (one dict, or one per layer
    type) or the legacy rope_theta / rope_scaling / rope_local_base_freq keys."""
    params = cfg.get("rope_parameters")
    if params is None:
        legacy = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}
        if family.rope_per_layer_type:
            local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
            params = {"sliding_attention": local, "full_attention": legacy}
        else:
            params = legacy
    if family.rope_per_layer_type and "full_attention" in params:
        specs = {t: RopeSpec.from_hf(p, max_position) for t, p in params.items()}
        return tuple(specs[t] for t in _layer_types(cfg, layers))
    return (RopeSpec.from_hf(params, max_position),) * layers
