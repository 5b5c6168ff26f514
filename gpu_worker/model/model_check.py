"""Refusing, before any child starts, a model that the decoder cannot serve correctly.

The launcher reads what the worker would read (config.json or the GGUF header, through the
same `ModelConfig` parser, which refuses unsupported families and features) and compares the
tensors the checkpoint holds, by name and shape, with those its config implies: read from
safetensors headers and the GGUF tensor table, no weight is loaded. A file cut short is
caught here too. Each problem is one `UnservableModel` line; launch.py prints it and exits 2.

It sits with the model because the tensors it expects are the ones the decoder loads; the
launcher (trident/model_source.py) uses `check_model` and `UnservableModel`, and
(trident/generation_config.py) `recommended_sampling`: what the model says a request's
sampling defaults are, read from the same files.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

import numpy as np

from gpu_worker.model.families import UnsupportedModelError
from gpu_worker.model.gguf_header import GGUFFormatError, read_gguf_header
from gpu_worker.model.gguf_weights import hf_config_dict, hf_name, hf_shape
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.model.moe_checkpoint import per_expert_shapes

Shapes = dict[str, tuple[int, ...]]

_MULTIMODAL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
"""Where a Gemma 3 multimodal checkpoint keeps its text decoder -> the text-only names."""

_GENERATIVE_HEADS = ("ForCausalLM", "ForConditionalGeneration")
"""config.json `architectures` whose weights end in an LM head (Gemma 3's multimodal
checkpoints say ForConditionalGeneration), not a classifier or an encoder."""


class UnservableModel(ValueError):
    pass


def check_model(path: str) -> None:
    if os.path.isdir(path):
        cfg = _dir_config(path)
        _compare(per_expert_shapes(_safetensors_shapes(path)), expected_shapes(cfg), "the checkpoint")
    elif path.endswith(".gguf"):
        _check_gguf(path)
    else:
        raise UnservableModel("expected a .gguf file or a Hugging Face-style directory")


_GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
"""A GGUF's recommended sampler settings (llama.cpp's names) -> generation_config.json's. Its
others (mirostat, XTC, the sampler order) have no counterpart here."""


def recommended_sampling(path: str) -> dict[str, Any]:
    """The sampling the model's makers recommend, under generation_config.json's names: a
    directory's generation_config.json (all of it) or a GGUF's general.sampling.* metadata
    (absent: {}). Values are as the file holds them; trident/generation_config.py picks the
    fields it takes and checks them."""
    if path.endswith(".gguf"):
        fields = read_gguf_header(path).fields
        return {name: _shortest(fields[key]) for key, name in _GGUF_SAMPLING_KEYS.items() if key in fields}
    return generation_config_file(os.path.join(path, "generation_config.json"), required=False)


def _shortest(value: Any) -> Any:
    """A GGUF float32 as the decimal it was written from (0.7, not 0.699999988079071)."""
    return float(str(np.float32(value))) if isinstance(value, float) else value


def generation_config_file(path: str, required: bool) -> dict[str, Any]:
    """A generation_config.json's object ({} when absent and not `required`); raises
    UnservableModel for one that is unreadable or not an object."""
    if not os.path.isfile(path):
        if required:
            raise UnservableModel(f"{path}: no such file")
        return {}
    return _json_object(path, path)


def _json_object(path: str, shown: str) -> dict[str, Any]:
    """The JSON object the file holds; UnservableModel (naming the file as `shown`) otherwise."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise UnservableModel(f"{shown} is unreadable: {e}") from None
    if not isinstance(raw, dict):
        raise UnservableModel(f"{shown} does not hold an object")
    return raw


def _dir_config(path: str) -> ModelConfig:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise UnservableModel("a model directory needs config.json (and *.safetensors)")
    raw = _json_object(config_path, "config.json")
    heads = raw.get("architectures") or []
    if heads and not any(h.endswith(_GENERATIVE_HEADS) for h in heads):
        raise UnservableModel(f"architectures {heads} holds no text-generation model (*ForCausalLM)")
    try:
        return ModelConfig.from_hf_dict(raw)
    except UnsupportedModelError as e:
        raise UnservableModel(str(e)) from None
    except (KeyError, TypeError, ValueError) as e:
        raise UnservableModel(f"config.json lacks or garbles a field the decoder needs: {e!r}") from None


def _check_gguf(path: str) -> None:
    try:
        header = read_gguf_header(path)
    except GGUFFormatError as e:
        raise UnservableModel(str(e)) from None
    if header.file_size < header.data_end:
        raise UnservableModel(
            f"the GGUF file is truncated: {header.file_size} bytes of the {header.data_end} its tensor table needs"
        )
    try:
        cfg = ModelConfig.from_hf_dict(hf_config_dict(header, os.path.basename(path)))
    except UnsupportedModelError as e:
        raise UnservableModel(str(e)) from None
    except (KeyError, TypeError, ValueError) as e:
        raise UnservableModel(f"the GGUF header lacks or garbles a field the decoder needs: {e!r}") from None
    arch = header.get("general.architecture")
    held: Shapes = {}
    for t in header.tensors:
        name = hf_name(arch, t.name)
        if name is None:
            raise UnservableModel(f"tensor {t.name} has no place in the {arch} decoder")
        held[name] = hf_shape(name, t.shape)
    _compare(per_expert_shapes(held), expected_shapes(cfg), "the GGUF file")


def expected_shapes(cfg: ModelConfig) -> Shapes:
    """Every tensor the config implies, under Hugging Face names (lm_head only when untied)."""
    family = cfg.quirks
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    out: Shapes = {"model.embed_tokens.weight": (cfg.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, hidden)
    for i in range(cfg.num_layers):
        attn, mlp, layer = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}."
        projections = {"o_proj": (hidden, q_rows)}
        if family.fused_checkpoint:
            projections["qkv_proj"] = (q_rows + 2 * kv_rows, hidden)
            out[mlp + "gate_up_proj.weight"] = (2 * cfg.intermediate_size, hidden)
            out[mlp + "down_proj.weight"] = (hidden, cfg.intermediate_size)
        else:
            projections.update(q_proj=(q_rows, hidden), k_proj=(kv_rows, hidden), v_proj=(kv_rows, hidden))
            out.update(_mlp_shapes(cfg, i, mlp))
        for proj, shape in projections.items():
            out[attn + proj + ".weight"] = shape
            if proj != "o_proj" and cfg.attention_bias or proj == "o_proj" and cfg.o_bias:
                out[attn + proj + ".bias"] = shape[:1]
        norms = ["input_layernorm", "post_attention_layernorm"]
        if family.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            out[layer + norm + ".weight"] = (hidden,)
        if family.qk_norm:
            out[attn + "q_norm.weight"] = out[attn + "k_norm.weight"] = (head_dim,)
    return out


def _mlp_shapes(cfg: ModelConfig, layer: int, mlp: str) -> Shapes:
    """A layer's dense MLP, or its router, experts and shared expert (moe_checkpoint.py's names)."""
    hidden = cfg.hidden_size

    def swiglu(prefix: str, inter: int) -> Shapes:
        shapes = {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden)}
        return shapes | {prefix + "down_proj.weight": (hidden, inter)}

    if cfg.moe is None or not cfg.is_sparse(layer):
        return swiglu(mlp, cfg.intermediate_size)
    moe = cfg.moe
    out = {mlp + "gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        out |= swiglu(f"{mlp}experts.{e}.", moe.intermediate_size)
    if moe.shared_intermediate_size:
        out |= swiglu(mlp + "shared_expert.", moe.shared_intermediate_size)
        out[mlp + "shared_expert_gate.weight"] = (1, hidden)
    return out


def _compare(held: Shapes, expected: Shapes, source: str) -> None:
    missing = [name for name in expected if name not in held]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UnservableModel(f"{source} does not match its config: {missing[0]}{more} missing")
    for name, shape in expected.items():
        if tuple(held[name]) != shape:
            raise UnservableModel(
                f"{source} does not match its config: {name} has shape {list(held[name])}, "
                f"the config implies {list(shape)}"
            )


def _safetensors_shapes(path: str) -> Shapes:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise UnservableModel("no *.safetensors weights in the directory")
    shapes: Shapes = {}
    for file in files:
        for name, shape in _safetensors_header(file).items():
            for prefix, text_prefix in _MULTIMODAL_PREFIXES.items():
                if name.startswith(prefix):
                    name = text_prefix + name[len(prefix) :]
            shapes[name] = shape
    return shapes


def _safetensors_header(file: str) -> Shapes:
    """Tensor shapes from a safetensors file's JSON header; also checks the file is whole."""
    name = os.path.basename(file)
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise UnservableModel(f"{name} is truncated or not safetensors")
            header = json.loads(f.read(length))
    except (struct.error, ValueError) as e:
        raise UnservableModel(f"{name} is not a readable safetensors file: {e}") from None
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in entries.values()), default=0)
    if 8 + length + end > size:
        raise UnservableModel(f"{name} is truncated: {size} bytes of the {8 + length + end} its header needs")
    return {k: tuple(v["shape"]) for k, v in entries.items()}
