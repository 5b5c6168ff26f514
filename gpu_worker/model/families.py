"""Every model family we serve, as how it differs from the plain LLaMA decoder.

The decoder (decoder.py, its layer in decoder_layer.py) is one: RMSNorm, rotary attention
with grouped KV heads, a gated MLP, a final norm and an LM head. A family only switches
parts of it on or off; the values that vary per checkpoint (rope bases and scaling, windows
per layer, the attention scale, biases) are read into `ModelConfig` (model_config.py) from
config.json or a GGUF header.

| family  | norm        | act       | q/k norm | bias   | emb*sqrt(h) | 4 norms | window      | checkpoint   |
|---------|-------------|-----------|----------|--------|-------------|---------|-------------|--------------|
| llama   | x*w         | silu      | -        | config | -           | -       | -           | q,k,v split  |
| qwen2   | x*w         | silu      | -        | q,k,v  | -           | -       | layer_types | q,k,v split  |
| qwen3   | x*w         | silu      | yes      | config | -           | -       | layer_types | q,k,v split  |
| mistral | x*w         | silu      | -        | -      | -           | -       | every layer | q,k,v split  |
| gemma3  | x*(1+w) f32 | gelu_tanh | yes      | config | yes         | yes     | layer_types | q,k,v split  |
| phi3    | x*w         | silu      | -        | -      | -           | -       | every layer | qkv, gate_up |

Gemma 3 also gives local (sliding) and global layers their own rope parameters and scales
attention by query_pre_attn_scalar**-0.5; both are per-model values in ModelConfig.

The mixture-of-experts families are their dense namesakes' attention with a routed MLP
(moe_spec.py holds the numbers, model/sparse_moe.py the layer):

| family    | attention as | top-k weights renormalised | shared expert | checkpoint experts        |
|-----------|--------------|----------------------------|---------------|---------------------------|
| qwen3_moe | qwen3        | norm_topk_prob             | -             | mlp.experts.N.*_proj      |
| qwen2_moe | qwen2        | norm_topk_prob             | sigmoid-gated | mlp.experts.N.*_proj      |
| mixtral   | mistral      | always                     | -             | block_sparse_moe.*.w1/w2/w3 |

Other MoE types (DeepSeek, gpt-oss: grouped routing, sigmoid scores, biased experts) are
not served: their model types are not listed, so they get the one-line refusal below.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class WindowLayers(Enum):
    """Which layers use the config's `sliding_window`."""

    NONE = "none"
    EVERY = "every"
    """Every layer (Mistral, Phi-3), when the config sets a window."""
    LAYER_TYPES = "layer_types"
    """Layers whose `layer_types` entry is "sliding_attention" (Gemma 3, Qwen2/3)."""


@dataclass(frozen=True)
class Family:
    """How one family's decoder differs from LLaMA's; the defaults are LLaMA."""

    name: str
    model_types: tuple[str, ...]
    """config.json `model_type` values (and GGUF `general.architecture`) of this family."""
    norm_unit_offset: bool = False
    """RMSNorm scales by (1 + w) and multiplies in float32 before the cast (Gemma), not by w
    after the cast (LLaMA). The model folds the 1 into the weight at load and keeps it in float32."""
    activation: str = "silu"
    """The gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k (the family's norm style) before the rotary (Qwen3, Gemma 3)."""
    qkv_bias: bool | None = None
    """Bias on q/k/v regardless of the config (Qwen2: True); None: the config's attention_bias."""
    o_bias_from_config: bool = True
    """attention_bias also puts a bias on o_proj (LLaMA, Qwen3, Gemma 3; not Qwen2)."""
    embed_scale: bool = False
    """Embeddings multiplied by sqrt(hidden_size), rounded to the model dtype (Gemma)."""
    sandwich_norms: bool = False
    """Four norms a layer (Gemma 3): input norm, attention, post-attention norm on its output,
    residual add; pre-feedforward norm, MLP, post-feedforward norm on its output, residual add.
    LLaMA has two: input norm and post_attention_layernorm (which feeds the MLP)."""
    window_layers: WindowLayers = WindowLayers.NONE
    rope_per_layer_type: bool = False
    """`rope_parameters` holds one entry per layer type (Gemma 3: local base 10k, global 1M)."""
    query_pre_attn_scalar: bool = False
    """Attention scale query_pre_attn_scalar**-0.5 (Gemma), not head_dim**-0.5."""
    fused_checkpoint: bool = False
    """The checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3)."""
    experts: bool = False
    """Sparse layers route each token to top-k SwiGLU experts (moe_spec.py)."""
    shared_expert: bool = False
    """Sparse layers also run a shared expert behind a sigmoid gate (Qwen2-MoE)."""
    norm_topk_prob: bool | None = None
    """Renormalise the top-k weights regardless of the config (Mixtral: True); None: the
    config's norm_topk_prob."""


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",)),
    Family("qwen2", ("qwen2",), qkv_bias=True, o_bias_from_config=False, window_layers=WindowLayers.LAYER_TYPES),
    Family("qwen3", ("qwen3",), qk_norm=True, window_layers=WindowLayers.LAYER_TYPES),
    Family("mistral", ("mistral",), window_layers=WindowLayers.EVERY),
    Family(
        "gemma3",
        ("gemma3_text", "gemma3"),
        norm_unit_offset=True,
        activation="gelu_tanh",
        qk_norm=True,
        embed_scale=True,
        sandwich_norms=True,
        window_layers=WindowLayers.LAYER_TYPES,
        rope_per_layer_type=True,
        query_pre_attn_scalar=True,
    ),
    Family("phi3", ("phi3",), window_layers=WindowLayers.EVERY, fused_checkpoint=True),
    Family("qwen3_moe", ("qwen3_moe",), qk_norm=True, window_layers=WindowLayers.LAYER_TYPES, experts=True),
    Family(
        "qwen2_moe",
        ("qwen2_moe",),
        qkv_bias=True,
        o_bias_from_config=False,
        window_layers=WindowLayers.LAYER_TYPES,
        experts=True,
        shared_expert=True,
    ),
    Family("mixtral", ("mixtral",), window_layers=WindowLayers.EVERY, experts=True, norm_topk_prob=True),
)

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
"""config.json hidden_act / hidden_activation -> the decoder's activation."""


class UnsupportedModelError(ValueError):
    """A checkpoint of a family (or a feature of one) this decoder does not serve."""


def supported_model_types() -> str:
    return ", ".join(t for f in FAMILIES for t in f.model_types)


def family_of(model_type: str | None, source: str = "config.json") -> Family:
    """The family serving `model_type`, or an UnsupportedModelError naming the supported ones."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(
        f"{source}: model type {model_type!r} is not supported; supported: {supported_model_types()}"
    )


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise UnsupportedModelError(f"unknown family {name!r}; supported: {', '.join(f.name for f in FAMILIES)}")
