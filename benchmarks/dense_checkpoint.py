"""Hugging Face directories (config, bf16 safetensors, tokenizer) that trident and vLLM both serve.

Two kinds:
- `export_dense_copy`: a GGUF's weights, dequantized by transformers (vLLM's GGUF loader
  needs CUDA, so vLLM serves this copy of a packaged model);
- `write_random_checkpoint`: a model of a real architecture's shape (`SHAPES`) with random
  weights, built by transformers' own config and model classes, with SmolLM2's tokenizer:
  how fast an engine serves does not depend on what the weights say, only on their shape.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from compare_hf import DTYPES, load_hf_model, resolve_model_path
from serving_workload import load_tokenizer

WEIGHT_STD = 0.02
"""Llama's own initializer range: activations stay finite through every layer in bf16."""

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class ModelShape:
    """The config fields of a Llama-family model that set what a decode step reads and computes."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 49152
    """SmolLM2's tokenizer, which every random checkpoint carries."""
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    rope_parameters: dict[str, Any] = field(default_factory=lambda: dict(LLAMA3_ROPE))


SHAPES = {
    "llama-3.2-1b": ModelShape(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
    ),
    # Small enough to write and serve in seconds; head_dim 64, which every attention backend takes.
    "tiny": ModelShape(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def export_dense_copy(model_path: str, dtype: str, export_dir: str) -> str:
    """A Hugging Face directory (config, safetensors, tokenizer) of the GGUF's dequantized weights."""
    if os.path.isfile(os.path.join(export_dir, "config.json")):
        return export_dir
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    progress(f"writing a dense {dtype} copy of {model_path} into {export_dir}")
    directory, name = os.path.split(os.path.abspath(model_path))
    model = load_hf_model(model_path, DTYPES[dtype])
    # save_pretrained refuses a model loaded from GGUF, so write the dense tensors and the
    # config ourselves; a tied LM head is the embedding, which must be the copy kept.
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    os.makedirs(export_dir, exist_ok=True)
    save_file(state, os.path.join(export_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if config.model_type == "gemma3_text":  # transformers leaves architectures unset for a GGUF
        config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(export_dir)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(export_dir)
    return export_dir


def write_random_checkpoint(shape_name: str, checkpoint_dir: str, seed: int = 0) -> str:
    """`checkpoint_dir` holding the shape's Llama model in bf16, every weight matrix drawn
    N(0, WEIGHT_STD), norms at one; kept as it is when it exists already. Written into a
    sibling directory first and renamed, so an interrupted write leaves no half checkpoint."""
    if os.path.isfile(os.path.join(checkpoint_dir, "config.json")):
        return checkpoint_dir
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[shape_name]
    progress(f"writing a random-weight {shape_name} checkpoint (bf16) into {checkpoint_dir}")
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    config = AutoConfig.for_model(
        "llama",
        **vars(shape),
        head_dim=shape.hidden_size // shape.num_attention_heads,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=["LlamaForCausalLM"],
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:  # a tied LM head is the embedding: drawn once
                param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)
            else:
                param.fill_(1.0)
    partial = checkpoint_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, checkpoint_dir)
    progress(f"wrote {checkpoint_dir}")
    return checkpoint_dir
