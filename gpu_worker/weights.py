"""Reading weights into Hugging Face LLaMA names: from a GGUF file or safetensors.

GGUF stores q/k projections permuted for llama.cpp's interleaved RoPE; `_unpermute_qk`
puts them back into the half-split layout the Hugging Face checkpoints (and our model)
use, so both sources feed one model definition.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import numpy as np
import torch
from tqdm import tqdm

from gpu_worker.model_config import ModelConfig

logger = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: str) -> ModelConfig:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{path}: architecture {arch!r} is not a LLaMA-family decoder")
    hidden = int(_gguf_field(reader, f"{arch}.embedding_length"))
    heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _gguf_field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_gguf_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_gguf_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(_gguf_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(path)
    for t in tqdm(reader.tensors, desc="Loading GGUF weights", unit="tensor", leave=False):
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        if t.name in _GGUF_GLOBAL_NAMES:
            name = _GGUF_GLOBAL_NAMES[t.name]
        else:
            _, layer, kind, suffix = t.name.split(".")
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
            if kind == "attn_q":
                data = _unpermute_qk(data, cfg.num_heads)
            elif kind == "attn_k":
                data = _unpermute_qk(data, cfg.num_kv_heads)
        yield name, torch.from_numpy(np.array(data, dtype=np.float32, copy=True))


def iter_safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for file in tqdm(files, desc="Loading safetensors", unit="file", leave=False):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_config(model_path: str) -> ModelConfig:
    if model_path.endswith(".gguf"):
        return gguf_config(model_path)
    return ModelConfig.from_hf_dir(model_path)


def iter_weights(model_path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if model_path.endswith(".gguf"):
        return iter_gguf_weights(model_path, cfg)
    return iter_safetensors_weights(model_path)
