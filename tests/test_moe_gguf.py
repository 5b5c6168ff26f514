"""Mixture-of-experts GGUFs as llama.cpp ships them, against transformers' reading of the same files.

Random-weight Qwen3-MoE and Qwen2-MoE checkpoints (transformers' own classes,
tests/family_models.py) are written as `qwen3moe` and `qwen2moe` GGUFs with the gguf
package (and a Mixtral one as llama.cpp writes Mixtral, a `llama` with experts, in
float32): the experts stacked as llama.cpp stores them (`ffn_gate_exps`, `ffn_up_exps`
[experts, moe_intermediate, hidden], `ffn_down_exps`), Qwen2-MoE's shared expert
(`ffn_*_shexp`) and its gate (`ffn_gate_inp_shexp`, [hidden]), gate and up in Q4_0 and down
in Q8_0, the attention projections in Q8_0, the routers and norms in float32 as llama.cpp's
quantizer leaves them. The expert sizes are those transformers' GGUF reader assumes.

- Dequantized at load (`--weight-dtype bf16`, here in float32), the logits equal
  transformers' float32 model of the file to float32 rounding, and so do the greedy tokens.
- Served in the file's own formats (`--weight-dtype gguf`: each expert a QuantLinear, int8
  activations), the logits stay within bounds set just over what was measured, as
  tests/test_fast_path_vs_transformers.py does for the packaged GGUFs.
"""

from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.layers.quant_linear import QuantLinear
from gpu_worker.model.model_check import check_model
from gpu_worker.model.moe_checkpoint import canonical_name
from tests.family_models import make_family_checkpoint
from tests.helpers import prompt_logits

# The quantized path's bounds, set just over what was measured (48 positions each). A random
# model's top two logits are close (median gap 0.16), so the top-1 moves with any rounding;
# as tests/test_fast_path_vs_transformers.py does, it may move only where transformers' own
# top two are close. At most positions the int8 activations cost a few tenths of a logit;
# at one here they flip a router's near-tie, that token takes another expert, and its
# logits move by a few units (llama.cpp's int8 activations do the same).
TYPICAL_LOGIT_ERROR = 0.4
"""The 90th percentile of each position's largest logit error (measured 0.27 qwen3moe, 0.32
qwen2moe; the logits reach about 8)."""
LARGEST_LOGIT_ERROR = 4.0
"""Measured 3.10 (qwen3moe) and 2.37 (qwen2moe), at a position whose routing flips."""
LARGEST_MARGIN = 0.6
"""The largest reference top-2 gap where the top-1 differs (measured 0.48, 0.23)."""


def _llama_cpp_permuted(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as llama.cpp's converter writes them for the `llama` arch (interleaved rotary)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(state: dict[str, torch.Tensor], cfg, arch: str) -> dict[str, tuple[torch.Tensor, str]]:
    """GGUF name -> (float32 tensor, ggml type name) of a Qwen3-MoE, Qwen2-MoE or Mixtral
    checkpoint; Mixtral's (arch `llama`) all float32, its q/k permuted as llama.cpp does."""
    quantize = arch in QUANTIZED_ARCHS
    state = {canonical_name(name): tensor for name, tensor in state.items()}
    if arch == "llama":
        for name in list(state):
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                state[name] = _llama_cpp_permuted(state[name], heads)
    out = {
        "token_embd.weight": (state["model.embed_tokens.weight"], "Q8_0" if quantize else "F32"),
        "output_norm.weight": (state["model.norm.weight"], "F32"),
    }
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    kinds = {"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"} if quantize else dict.fromkeys(("gate", "up", "down"), "F32")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for part, kind in kinds.items():
            experts = [state[f"{p}mlp.experts.{e}.{part}_proj.weight"] for e in range(num_experts)]
            out[f"blk.{i}.ffn_{part}_exps.weight"] = (torch.stack(experts), kind)
            if f"{p}mlp.shared_expert.{part}_proj.weight" in state:
                out[f"blk.{i}.ffn_{part}_shexp.weight"] = (state[f"{p}mlp.shared_expert.{part}_proj.weight"], kind)
        if p + "mlp.shared_expert_gate.weight" in state:  # [1, hidden] in a checkpoint, [hidden] in a GGUF
            out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = (state[p + "mlp.shared_expert_gate.weight"][0], "F32")
        out |= {
            f"blk.{i}.ffn_gate_inp.weight": (state[p + "mlp.gate.weight"], "F32"),
            f"blk.{i}.attn_norm.weight": (state[p + "input_layernorm.weight"], "F32"),
            f"blk.{i}.ffn_norm.weight": (state[p + "post_attention_layernorm.weight"], "F32"),
        }
        for gguf_part, hf_part in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            kind = "Q8_0" if quantize else "F32"
            out[f"blk.{i}.attn_{gguf_part}.weight"] = (state[f"{p}self_attn.{hf_part}_proj.weight"], kind)
            if f"{p}self_attn.{hf_part}_proj.bias" in state:
                out[f"blk.{i}.attn_{gguf_part}.bias"] = (state[f"{p}self_attn.{hf_part}_proj.bias"], "F32")
            if f"{p}self_attn.{hf_part}_norm.weight" in state:
                out[f"blk.{i}.attn_{gguf_part}_norm.weight"] = (state[f"{p}self_attn.{hf_part}_norm.weight"], "F32")
    return out


def write_moe_gguf(checkpoint: str, path: str, arch: str) -> str:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(checkpoint)
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
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
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for name, (tensor, kind) in _gguf_tensors(state, cfg, arch).items():
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(tensor.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_CHECKPOINTS = {"qwen3moe": "qwen3_moe_gguf", "qwen2moe": "qwen2_moe_gguf", "llama": "mixtral"}
"""GGUF arch -> the test checkpoint written as it (tests/family_models.py): llama.cpp writes
Mixtral as a `llama` with experts."""
QUANTIZED_ARCHS = ("qwen3moe", "qwen2moe")
"""Written in Q4_0 and Q8_0 and read by transformers' GGUF loader; Mixtral (which that
loader does not read) in float32, against transformers on the checkpoint it came from."""


@pytest.fixture(scope="module", params=list(GGUF_CHECKPOINTS))
def moe_gguf(request, tmp_path_factory) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(the GGUF, a prompt's ids, transformers' float32 logits of the file at every position)."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    checkpoint = make_family_checkpoint(str(tmp_path_factory.mktemp("ckpt")), GGUF_CHECKPOINTS[arch])
    path = write_moe_gguf(checkpoint, str(tmp_path_factory.mktemp("gguf") / f"{arch}.gguf"), arch)
    ids = torch.randint(100, 40000, (48,), generator=torch.Generator().manual_seed(3))
    if arch in QUANTIZED_ARCHS:
        directory, name = os.path.split(path)
        reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    else:
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
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
    if not path.endswith(tuple(f"{arch}.gguf" for arch in QUANTIZED_ARCHS)):
        pytest.skip("a float32 file: nothing to serve quantized")
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
