"""Random-weight mixture-of-experts checkpoints for the MoE benchmark (compare_moe.py).

A Qwen3-MoE model of a given shape (`MOE_SHAPES`), every weight matrix drawn N(0,
WEIGHT_STD) and every norm at one as dense_checkpoint.py does for dense shapes, with
SmolLM2's tokenizer, written twice:
- bf16 safetensors with transformers' Qwen3MoeConfig, the experts under the per-expert
  names Qwen's own checkpoints use (`mlp.experts.N.gate_proj.weight`), which vLLM,
  transformers and trident all read; one shard per layer, so the writer holds one layer in
  memory, not the model;
- the same weights as a `qwen3moe` GGUF (moe_gguf.py) with SmolLM2's tokenizer metadata,
  for llama.cpp and trident's GGUF path.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass

import torch
from compare_hf import resolve_model_path
from dense_checkpoint import WEIGHT_STD, progress
from moe_gguf import write_moe_gguf
from serving_workload import load_tokenizer

GGUF_QUANT = "Q8_0"
"""Every matrix of the GGUF in Q8_0 (routers and norms float32): llama.cpp and trident both
serve it, and it stays the closest of the GGUF formats to the bf16 weights."""


@dataclass(frozen=True)
class MoeShape:
    """The Qwen3MoeConfig fields that set what a decode step reads and computes."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    vocab_size: int = 49152
    """SmolLM2's tokenizer, which every random checkpoint carries."""
    tie_word_embeddings: bool = True
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960


MOE_SHAPES = {
    # Qwen3-30B-A3B's layer (hidden 2048, 128 experts top-8, expert MLP 768, 32 query and 4
    # KV heads of 128) with 6 of its 48 layers, so the bf16 files fit this host's memory
    # beside one engine at a time (docs/benchmarks.md, "Mixture of experts").
    "qwen3-30b-a3b": MoeShape(
        hidden_size=2048,
        num_hidden_layers=6,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # Written and served in seconds. Expert MLP 768: the size transformers' GGUF reader
    # assumes for qwen3moe, which trident's GGUF tokenizer conversion goes through.
    "tiny": MoeShape(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=768,
    ),
}


def _layer_shapes(shape: MoeShape, i: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of layer i's tensors, as Qwen3-MoE checkpoints name them."""
    h, d, e, m = shape.hidden_size, shape.head_dim, shape.num_experts, shape.moe_intermediate_size
    p = f"model.layers.{i}."
    out: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (shape.num_attention_heads * d, h),
        p + "self_attn.k_proj.weight": (shape.num_key_value_heads * d, h),
        p + "self_attn.v_proj.weight": (shape.num_key_value_heads * d, h),
        p + "self_attn.o_proj.weight": (h, shape.num_attention_heads * d),
        p + "self_attn.q_norm.weight": (d,),
        p + "self_attn.k_norm.weight": (d,),
        p + "mlp.gate.weight": (e, h),
    }
    for expert in range(e):
        q = f"{p}mlp.experts.{expert}."
        out |= {q + "gate_proj.weight": (m, h), q + "up_proj.weight": (m, h), q + "down_proj.weight": (h, m)}
    return out


def _random(shapes: dict[str, tuple[int, ...]], generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        name: (torch.randn(s, generator=generator) * WEIGHT_STD if len(s) >= 2 else torch.ones(s)).to(torch.bfloat16)
        for name, s in shapes.items()
    }


def write_random_moe_checkpoint(shape_name: str, checkpoint_dir: str, seed: int = 0) -> str:
    """`checkpoint_dir` holding the shape's Qwen3-MoE model in bf16 safetensors, one shard
    per layer and one for the embedding and final norm; kept as it is when it exists already.
    Written into a sibling directory first and renamed, so an interrupted write leaves none."""
    if os.path.isfile(os.path.join(checkpoint_dir, "config.json")):
        return checkpoint_dir
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    shape = MOE_SHAPES[shape_name]
    progress(f"writing a random-weight {shape_name} checkpoint (bf16) into {checkpoint_dir}")
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    config = Qwen3MoeConfig(
        **asdict(shape),
        intermediate_size=shape.moe_intermediate_size * shape.num_experts_per_tok,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=["Qwen3MoeForCausalLM"],
        dtype="bfloat16",
    )
    partial = checkpoint_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    generator = torch.Generator().manual_seed(seed)
    head = {
        "model.embed_tokens.weight": (shape.vocab_size, shape.hidden_size),
        "model.norm.weight": (shape.hidden_size,),
    }
    shards = [head] + [_layer_shapes(shape, i) for i in range(shape.num_hidden_layers)]
    weight_map, total = {}, 0
    for n, shapes in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = _random(shapes, generator)
        save_file(tensors, os.path.join(partial, name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.nbytes for t in tensors.values())
        progress(f"  {name}: {len(tensors)} tensors")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1)
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, checkpoint_dir)
    progress(f"wrote {checkpoint_dir} ({total / 1e9:.1f} GB)")
    return checkpoint_dir


def write_moe_checkpoint_gguf(checkpoint_dir: str, path: str) -> str:
    """The checkpoint as a `qwen3moe` GGUF in GGUF_QUANT with SmolLM2's tokenizer; kept
    when it exists already, written beside first and renamed."""
    if os.path.isfile(path):
        return path
    progress(f"writing {checkpoint_dir} as a {GGUF_QUANT} GGUF: {path}")
    partial = path + ".partial"
    write_moe_gguf(checkpoint_dir, partial, "qwen3moe", GGUF_QUANT, tokenizer_from=resolve_model_path("smollm2-135m"))
    os.replace(partial, path)
    progress(f"wrote {path} ({os.path.getsize(path) / 1e9:.1f} GB)")
    return path
