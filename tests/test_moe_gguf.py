"""A mixture-of-experts GGUF as llama.cpp ships one, against transformers' reading of the same file.

A random-weight Qwen3-MoE checkpoint (transformers' own classes, tests/family_models.py) is
written as a `qwen3moe` GGUF with the gguf package: the experts stacked as llama.cpp stores
them (`ffn_gate_exps`, `ffn_up_exps` [experts, moe_intermediate, hidden], `ffn_down_exps`),
gate and up in Q4_0 and down in Q8_0, the attention projections in Q8_0, the router
(`ffn_gate_inp`) and norms in float32 as llama.cpp's quantizer leaves them. The
intermediate size is 768, the one transformers' GGUF reader assumes (it does not read
`expert_feed_forward_length`).

- Dequantized at load (`--weight-dtype bf16`, here in float32), the logits equal
  transformers' float32 model of the file to float32 rounding, and so do the greedy tokens.
- Served in the file's own formats (`--weight-dtype gguf`: each expert a QuantLinear, int8
  activations), the logits stay within bounds set just over what was measured, as
  tests/test_fast_path_vs_transformers.py does for the packaged GGUFs.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gpu_worker.layers.quant_linear import QuantLinear
from gpu_worker.model.model_check import check_model
from tests.family_models import make_family_checkpoint
from tests.helpers import prompt_logits

# The quantized path's bounds, set just over what was measured (48 positions). A random
# model's top two logits are close (median gap 0.16), so the top-1 moves with any rounding;
# as tests/test_fast_path_vs_transformers.py does, it may move only where transformers' own
# top two are close. At most positions the int8 activations cost a few tenths of a logit;
# at one here they flip a router's near-tie, that token takes another expert, and its
# logits move by a few units (llama.cpp's int8 activations do the same).
TYPICAL_LOGIT_ERROR = 0.4
"""The 90th percentile of each position's largest logit error (measured 0.28; logits reach about 8)."""
LARGEST_LOGIT_ERROR = 4.0
"""Measured 3.10, at the position whose routing flips."""
LARGEST_MARGIN = 0.6
"""The largest reference top-2 gap where the top-1 differs (measured 0.48)."""


def _gguf_tensors(state: dict[str, torch.Tensor], layers: int, experts: int) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (float32 array, ggml type name) of a Qwen3-MoE checkpoint."""
    out = {
        "token_embd.weight": (state["model.embed_tokens.weight"], "Q8_0"),
        "output_norm.weight": (state["model.norm.weight"], "F32"),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        stacked = {
            "gate": ("gate_proj", "Q4_0"),
            "up": ("up_proj", "Q4_0"),
            "down": ("down_proj", "Q8_0"),
        }
        for gguf_part, (hf_part, kind) in stacked.items():
            weights = torch.stack([state[f"{p}mlp.experts.{e}.{hf_part}.weight"] for e in range(experts)])
            out[f"blk.{i}.ffn_{gguf_part}_exps.weight"] = (weights, kind)
        out |= {
            f"blk.{i}.ffn_gate_inp.weight": (state[p + "mlp.gate.weight"], "F32"),
            f"blk.{i}.attn_norm.weight": (state[p + "input_layernorm.weight"], "F32"),
            f"blk.{i}.ffn_norm.weight": (state[p + "post_attention_layernorm.weight"], "F32"),
            f"blk.{i}.attn_q_norm.weight": (state[p + "self_attn.q_norm.weight"], "F32"),
            f"blk.{i}.attn_k_norm.weight": (state[p + "self_attn.k_norm.weight"], "F32"),
        }
        for gguf_part, hf_part in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            out[f"blk.{i}.attn_{gguf_part}.weight"] = (state[f"{p}self_attn.{hf_part}.weight"], "Q8_0")
    return {name: (tensor.numpy(), kind) for name, (tensor, kind) in out.items()}


def write_qwen3_moe_gguf(checkpoint: str, path: str) -> str:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(checkpoint)
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for name, (array, kind) in _gguf_tensors(state, cfg.num_hidden_layers, cfg.num_experts).items():
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(the GGUF, a prompt's ids, transformers' float32 logits of the file at every position)."""
    from transformers import AutoModelForCausalLM

    checkpoint = make_family_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "qwen3_moe_gguf")
    path = write_qwen3_moe_gguf(checkpoint, str(tmp_path_factory.mktemp("gguf") / "qwen3moe.gguf"))
    ids = torch.randint(100, 40000, (48,), generator=torch.Generator().manual_seed(3))
    directory, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        return path, ids, reference(ids[None]).logits[0]


def test_the_launcher_accepts_the_stacked_experts_of_a_moe_gguf(moe_gguf):
    check_model(moe_gguf[0])


def test_a_moe_gguf_dequantized_at_load_equals_transformers(moe_gguf):
    path, ids, ref = moe_gguf
    ours = prompt_logits(path, ids, torch.float32)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (ours - ref).abs().max().item() < 1e-3


def test_a_moe_gguf_in_its_own_formats_is_within_int8_activations_of_transformers(moe_gguf):
    path, ids, ref = moe_gguf
    layers = []
    ours = prompt_logits(path, ids, torch.float32, quantized=True, prepare=lambda model: layers.append(model.layers))
    expert = layers[0][0].mlp.experts[0]
    assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(expert.down_proj, QuantLinear)
    errors = (ours - ref).abs().amax(dim=-1)
    differ = ours.argmax(-1) != ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1])[differ].max().item() if differ.any() else 0.0
    typical = errors.quantile(0.9).item()
    print(f"quantized MoE GGUF: 90th percentile error {typical:.3f}, largest {errors.max():.3f}, margin {margin:.3f}")
    assert typical <= TYPICAL_LOGIT_ERROR
    assert errors.max().item() <= LARGEST_LOGIT_ERROR
    assert margin <= LARGEST_MARGIN
