"""A GGUF file as a Hugging Face checkpoint: its header as a config.json, its tensors under
Hugging Face names with Hugging Face values, so both sources feed one model definition.

Where llama.cpp's converter changed a tensor, it is changed back, as transformers' GGUF
loader does (transformers loads these files and is our reference):
- q/k projections of the `llama` arch are permuted for llama.cpp's interleaved rotary;
  `_unpermute_qk` restores the half-split layout. Only `llama` (and Mistral, written as
  `llama`) is permuted: qwen2, qwen3, gemma3 and phi3 use the half-split (NeoX) rotary.
- Gemma norms are stored as 1 + w (llama.cpp's norm_shift); Hugging Face stores w.
- Phi-3's `attn_qkv` and `ffn_up` are already the fused qkv_proj and gate_up_proj.
- Mixture-of-experts files stack each projection's experts in one 3-D tensor
  (`ffn_gate_exps` [experts, rows, cols]): yielded one expert at a time. llama.cpp writes
  Mixtral as a `llama` with experts; we serve it as mixtral.

What the header does not say, llama.cpp fixes per arch and so do we: Gemma 3 makes every
sixth layer global and the rest local with rope base 10k, and scales attention by
head_dim**-0.5 (hidden/heads for the 62-layer 27B).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from gpu_worker.layers.gguf_repack import SUPPORTED, QuantWeights, repack
from gpu_worker.model.families import UnsupportedModelError
from gpu_worker.model.gguf_header import GGUFHeader, read_gguf_header, tensor_bytes
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.model.moe_checkpoint import expert_name, stacked_projection

if TYPE_CHECKING:
    import torch
    from gguf import GGMLQuantizationType

logger = logging.getLogger(__name__)

GGUF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
}
"""GGUF general.architecture -> config.json model_type (families.py)."""

_PERMUTED_QK_ARCHS = ("llama", "mistral")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
"""The experts come stacked, [experts, rows, cols]: iter_gguf_weights yields one entry per
expert (moe_checkpoint.py's names)."""
_ARCH_LAYER_NAMES = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

END_OF_TURN_MARKERS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")
"""Control tokens that end a turn, so stop generation, whether or not the header names them
(llama.cpp treats them alike): Gemma's <end_of_turn> is not its eos."""

_CONTROL_TOKEN = 3
"""tokenizer.ggml.token_type of a control (special) token."""


def gguf_arch(header: GGUFHeader, path: str) -> str:
    arch = header.get("general.architecture")
    if arch not in GGUF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_MODEL_TYPES)}"
        )
    return arch


def hf_name(arch: str, gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one the decoder has no use for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    _, layer, kind, suffix = parts
    name = _ARCH_LAYER_NAMES.get(arch, {}).get(kind) or _LAYER_NAMES.get(kind)
    return None if name is None else f"model.layers.{layer}.{name}.{suffix}"


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of a GGUF tensor: the shared expert's gate is [hidden] in a
    GGUF, [1, hidden] in a checkpoint."""
    return (1, *shape) if name.endswith("shared_expert_gate.weight") and len(shape) == 1 else shape


def stop_token_ids(header: GGUFHeader) -> list[int]:
    """eos, eot and eom ids from the header, and every control token that ends a turn."""
    ids = [header.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    control = _control_tokens(header)
    found = {int(i) for i in ids if i is not None} | {control[m] for m in END_OF_TURN_MARKERS if m in control}
    return sorted(found)


def _control_tokens(header: GGUFHeader) -> dict[str, int]:
    """Text -> id of each control token (a few hundred of Gemma's 262k tokens)."""
    tokens, types = header.get("tokenizer.ggml.tokens"), header.get("tokenizer.ggml.token_type")
    if tokens is None or types is None:
        return {}
    return {tokens[i].decode(errors="replace"): int(i) for i in np.flatnonzero(types == _CONTROL_TOKEN)}


def hf_config_dict(header: GGUFHeader, path: str) -> dict:
    """The header as the config.json a Hugging Face checkpoint of this model would carry."""
    arch = gguf_arch(header, path)
    names = {t.name for t in header.tensors}
    for odd in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if odd in names:
            raise UnsupportedModelError(f"{path}: rope frequency factors ({odd}) in a GGUF are not supported")
    hidden = int(header.get(f"{arch}.embedding_length"))
    heads = int(header.get(f"{arch}.attention.head_count"))
    head_dim = header.get(f"{arch}.attention.key_length") or header.get(f"{arch}.rope.dimension_count")
    vocab = header.get(f"{arch}.vocab_size") or len(header.get("tokenizer.ggml.tokens", ()))
    cfg = {
        "model_type": GGUF_MODEL_TYPES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(
            header.get(f"{arch}.feed_forward_length") or header.get(f"{arch}.expert_feed_forward_length")
        ),
        "num_hidden_layers": int(header.get(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(header.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(header.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(header.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        "sliding_window": header.get(f"{arch}.attention.sliding_window"),
        "eos_token_id": stop_token_ids(header),
    }
    scaling = _rope_scaling(header, arch)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if header.get(f"{arch}.expert_count"):
        cfg.update(
            num_experts=int(header.get(f"{arch}.expert_count")),
            num_experts_per_tok=int(header.get(f"{arch}.expert_used_count")),
            moe_intermediate_size=int(header.get(f"{arch}.expert_feed_forward_length") or cfg["intermediate_size"]),
            shared_expert_intermediate_size=int(header.get(f"{arch}.expert_shared_feed_forward_length", 0)),
            # llama.cpp renormalises the top-k weights of qwen3moe (and Mixtral), not of qwen2moe.
            norm_topk_prob=arch == "qwen3moe",
        )
        if arch == "llama":  # llama.cpp writes Mixtral as a llama with experts
            cfg["model_type"] = "mixtral"
    if arch == "gemma3":
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window_pattern=int(header.get(f"{arch}.attention.sliding_window_pattern", 6)),
            rope_local_base_freq=float(header.get(f"{arch}.rope.freq_base_swa", 10000.0)),
            query_pre_attn_scalar=hidden // heads if cfg["num_hidden_layers"] == 62 else cfg["head_dim"],
        )
    return cfg


def _rope_scaling(header: GGUFHeader, arch: str) -> dict | None:
    kind = header.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(header.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = header.get(f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original)}
    raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn are)")


def gguf_config(path: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_config_dict(read_gguf_header(path), path))


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


QUANTIZABLE_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
"""Hugging Face names of the weights `--weight-dtype gguf` keeps in the file's formats: the
linear layers, the embedding and the LM head. Norms and biases are float tensors anyway."""


def iter_gguf_weights(
    path: str, cfg: ModelConfig, quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantWeights]]:
    """(Hugging Face name, float32 tensor) of every tensor, dequantized (K-quants included).
    `quantized`: the linear, embedding and LM-head weights in a format of gguf_repack.py's
    table come as its U4/I8 weights instead; one outside it is dequantized, and logged."""
    from gguf import GGMLQuantizationType
    from tqdm import tqdm

    header = read_gguf_header(path)
    arch = gguf_arch(header, path)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    dense_fallbacks: dict[str, int] = {}
    for t in tqdm(header.tensors, desc="Loading GGUF weights", unit="tensor", leave=False):
        name = hf_name(arch, t.name)
        if name is None:
            raise UnsupportedModelError(f"{path}: tensor {t.name} has no place in the decoder")
        kind = GGMLQuantizationType(t.ggml_type)
        raw = tensor_bytes(file, t)
        keep = quantized and name.endswith(QUANTIZABLE_SUFFIXES)
        if len(t.shape) == 3:  # stacked experts: one entry per expert
            projection = stacked_projection(name)
            assert projection is not None, name
            for e in range(t.shape[0]):
                data = _decoded(raw[e], kind, t.shape[1:], keep, dense_fallbacks)
                yield expert_name(name, e, projection), _as_torch(data)
            continue
        data = _decoded(raw, kind, t.shape, keep, dense_fallbacks)
        if arch in _PERMUTED_QK_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _unpermute_rows(data, cfg.num_heads)
        elif arch in _PERMUTED_QK_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _unpermute_rows(data, cfg.num_kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            data = data - 1.0
        elif isinstance(data, np.ndarray):
            data = data.reshape(hf_shape(name, data.shape))
        yield name, _as_torch(data)
    if dense_fallbacks:
        logger.warning(
            "--weight-dtype gguf: %s dequantized to dense (formats served as shipped: %s)",
            ", ".join(f"{n} {kind} tensors" for kind, n in sorted(dense_fallbacks.items())),
            ", ".join(SUPPORTED),
        )


def _decoded(
    raw: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...], keep: bool, dense_fallbacks: dict[str, int]
) -> np.ndarray | QuantWeights:
    """A tensor's U4/I8 weights where `keep` and gguf_repack.py has its format, else float32
    (a 2-D one that `keep` asked for counted in dense_fallbacks by format)."""
    from gguf.quants import dequantize

    packed = repack(raw, kind, shape) if len(shape) == 2 else None
    if keep and packed is not None:
        return packed
    if keep and len(shape) == 2:
        dense_fallbacks[kind.name] = dense_fallbacks.get(kind.name, 0) + 1
    # The same float32 as gguf's own dequantization (gguf_repack.py), much faster.
    return packed.dequantize() if packed is not None else dequantize(raw, kind)


def _as_torch(data: np.ndarray | QuantWeights) -> torch.Tensor | QuantWeights:
    import torch

    if isinstance(data, np.ndarray):
        # Copied only where not already a writable float32 array of our own (a view of the
        # read-only file mapping is not).
        return torch.from_numpy(np.require(data, dtype=np.float32, requirements=["C", "W"]))
    return data


def _unpermute_rows(data: np.ndarray | QuantWeights, n_heads: int) -> np.ndarray | QuantWeights:
    if isinstance(data, np.ndarray):
        return _unpermute_qk(data, n_heads)
    return data.map_rows(lambda rows: np.ascontiguousarray(_unpermute_qk(rows, n_heads)))
