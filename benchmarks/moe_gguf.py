"""A mixture-of-experts checkpoint (Qwen3-MoE, Qwen2-MoE, Mixtral) written as the GGUF llama.cpp would.

The experts are stacked per projection (`ffn_gate_exps`, `ffn_up_exps` [experts,
moe_intermediate, hidden], `ffn_down_exps`), with Qwen2-MoE's shared expert (`ffn_*_shexp`)
and its gate (`ffn_gate_inp_shexp`, [hidden]); the routers and norms stay float32 as
llama.cpp's quantizer leaves them. Mixtral is written as llama.cpp writes it: a `llama` with
experts, all float32, its q/k rows permuted for interleaved rotary.

One tensor at a time is read, quantized and written, so a checkpoint of several GB is
converted in about one stacked expert tensor's memory. Used by the MoE benchmark
(compare_moe.py) and by the tests (tests/family_models.py).
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_worker.model.moe_checkpoint import canonical_name

QUANTIZED_ARCHS = ("qwen3moe", "qwen2moe")
"""The archs written in a quantized format (transformers' GGUF loader reads them); Mixtral
(which that loader does not read) is written in float32."""

QUANTS: dict[str, dict[str, str]] = {
    # Gate and up in Q4_0, down in Q8_0: the mix of llama.cpp's Q4_0 files.
    "mixed": {"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0", "attention": "Q8_0", "embedding": "Q8_0"},
    "Q8_0": dict.fromkeys(("gate", "up", "down", "attention", "embedding"), "Q8_0"),
}
"""Quant name -> the ggml type of each weight group of a quantized arch."""

FLOAT32 = dict.fromkeys(("gate", "up", "down", "attention", "embedding"), "F32")


class CheckpointTensors:
    """The tensors of a safetensors checkpoint by canonical name (moe_checkpoint.py), read
    one at a time in float32."""

    def __init__(self, checkpoint: str) -> None:
        from safetensors import safe_open

        self._files: dict[str, Any] = {}
        self._where: dict[str, tuple[str, str]] = {}
        for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
            handle = self._files[path] = safe_open(path, framework="pt")
            for key in handle.keys():  # noqa: SIM118 (no __iter__)
                self._where[canonical_name(key)] = (path, key)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        path, key = self._where[name]
        return tuple(self._files[path].get_slice(key).get_shape())

    def get(self, name: str) -> torch.Tensor:
        path, key = self._where[name]
        return self._files[path].get_tensor(key).float()


@dataclass
class GgufTensor:
    name: str
    kind: str
    """The ggml type name (F32, Q8_0, Q4_0)."""
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    """The float32 values, read when the tensor is written."""


def _llama_cpp_permuted(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as llama.cpp's converter writes them for the `llama` arch (interleaved rotary)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _plain(state: CheckpointTensors, name: str, gguf_name: str, kind: str) -> GgufTensor:
    return GgufTensor(gguf_name, kind, state.shape(name), lambda: state.get(name))


def _stacked(state: CheckpointTensors, names: list[str], gguf_name: str, kind: str) -> GgufTensor:
    return GgufTensor(
        gguf_name, kind, (len(names), *state.shape(names[0])), lambda: torch.stack([state.get(n) for n in names])
    )


def gguf_tensors(state: CheckpointTensors, cfg: Any, arch: str, kinds: dict[str, str]) -> Iterator[GgufTensor]:
    """The GGUF tensors of a checkpoint in file order, `kinds` giving each weight group's type."""
    yield _plain(state, "model.embed_tokens.weight", "token_embd.weight", kinds["embedding"])
    yield _plain(state, "model.norm.weight", "output_norm.weight", "F32")
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for part in ("gate", "up", "down"):
            experts = [f"{p}mlp.experts.{e}.{part}_proj.weight" for e in range(num_experts)]
            yield _stacked(state, experts, f"blk.{i}.ffn_{part}_exps.weight", kinds[part])
            if f"{p}mlp.shared_expert.{part}_proj.weight" in state:
                yield _plain(
                    state, f"{p}mlp.shared_expert.{part}_proj.weight", f"blk.{i}.ffn_{part}_shexp.weight", kinds[part]
                )
        if p + "mlp.shared_expert_gate.weight" in state:  # [1, hidden] in a checkpoint, [hidden] in a GGUF
            name = p + "mlp.shared_expert_gate.weight"
            yield GgufTensor(
                f"blk.{i}.ffn_gate_inp_shexp.weight", "F32", state.shape(name)[1:], lambda n=name: state.get(n)[0]
            )
        yield _plain(state, p + "mlp.gate.weight", f"blk.{i}.ffn_gate_inp.weight", "F32")
        yield _plain(state, p + "input_layernorm.weight", f"blk.{i}.attn_norm.weight", "F32")
        yield _plain(state, p + "post_attention_layernorm.weight", f"blk.{i}.ffn_norm.weight", "F32")
        for gguf_part, hf_part in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            weight = f"{p}self_attn.{hf_part}_proj.weight"
            tensor = _plain(state, weight, f"blk.{i}.attn_{gguf_part}.weight", kinds["attention"])
            if arch == "llama" and hf_part in ("q", "k"):
                heads = cfg.num_attention_heads if hf_part == "q" else cfg.num_key_value_heads
                tensor.load = lambda w=weight, h=heads: _llama_cpp_permuted(state.get(w), h)
            yield tensor
            bias, norm = f"{p}self_attn.{hf_part}_proj.bias", f"{p}self_attn.{hf_part}_norm.weight"
            if bias in state:
                yield _plain(state, bias, f"blk.{i}.attn_{gguf_part}.bias", "F32")
            if norm in state:
                yield _plain(state, norm, f"blk.{i}.attn_{gguf_part}_norm.weight", "F32")


def _add_hparams(writer: Any, cfg: Any) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _copy_tokenizer(writer: Any, source_gguf: str) -> None:
    """The `tokenizer.*` metadata of another GGUF: llama.cpp and trident read a GGUF's
    tokenizer from the file itself."""
    import gguf

    for field in gguf.GGUFReader(source_gguf).fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)


def write_moe_gguf(
    checkpoint: str, path: str, arch: str, quant: str = "mixed", tokenizer_from: str | None = None
) -> str:
    """`path`: the checkpoint as a GGUF of `arch`, in `quant` (QUANTS) where the arch is
    quantized, else float32; with the tokenizer of the GGUF `tokenizer_from` where given."""
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(checkpoint)
    kinds = QUANTS[quant] if arch in QUANTIZED_ARCHS else FLOAT32
    tensors = list(gguf_tensors(CheckpointTensors(checkpoint), cfg, arch, kinds))
    writer = gguf.GGUFWriter(path, arch)
    _add_hparams(writer, cfg)
    if tokenizer_from is not None:
        _copy_tokenizer(writer, tokenizer_from)
    for t in tensors:
        qtype = gguf.GGMLQuantizationType[t.kind]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor_info(t.name, t.shape, np.float32, 4 * math.prod(t.shape), qtype)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(t.shape, qtype)
            writer.add_tensor_info(t.name, byte_shape, np.uint8, math.prod(byte_shape), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(gguf.quants.quantize(t.load().numpy(), gguf.GGMLQuantizationType[t.kind]))
    writer.close()
    return path
