"""Tiny random-weight checkpoints of every family we serve, written by transformers itself.

Each family's quirks are switched on: rope scaling (llama3, linear, yarn), q/k/v biases,
q/k norms, a sliding window shorter than the test prompts, Gemma 3's local and global
layers with their own rope bases, head dims 64 to 256. The transformers model class builds
and saves the checkpoint (safetensors + config.json), with the SmolLM2 tokenizer beside it,
so the names, layouts and config keys are exactly those the library writes.
`write_moe_gguf` writes a mixture-of-experts checkpoint as the GGUF llama.cpp would.
"""

from __future__ import annotations

import os

import torch

from gpu_worker.model.moe_checkpoint import canonical_name
from tests.helpers import smollm2_tokenizer

WINDOW = 12
"""Sliding window of the windowed families, in keys: shorter than the long test prompt."""


def _common(vocab: int, **overrides) -> dict:
    base = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }
    return base | overrides


def family_config(name: str, vocab: int):
    """The transformers config of the test checkpoint `name` (a family, or llama with a rope type)."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    if name == "llama3_rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**_common(vocab, rope_parameters=rope))
    if name == "linear_rope":
        return LlamaConfig(
            **_common(vocab, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
        )
    if name == "yarn_rope":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
        return LlamaConfig(**_common(vocab, rope_parameters=rope))
    if name == "qwen2":
        return Qwen2Config(**_common(vocab))
    if name == "qwen3":
        return Qwen3Config(**_common(vocab, num_attention_heads=2, num_key_value_heads=1, head_dim=128))
    if name == "mistral":
        return MistralConfig(**_common(vocab, head_dim=16, sliding_window=WINDOW))
    if name == "gemma3":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        }
        layers = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        return Gemma3TextConfig(
            **_common(vocab, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1),
            head_dim=256,
            sliding_window=WINDOW,
            layer_types=layers,
            rope_parameters=rope,
            query_pre_attn_scalar=64,
        )
    if name == "phi3":
        return Phi3Config(**_common(vocab, sliding_window=WINDOW, tie_word_embeddings=False))
    return moe_family_config(name, vocab)


def moe_family_config(name: str, vocab: int):
    """The mixture-of-experts checkpoints: 8 experts, top 2. Qwen3-MoE renormalises its top-k
    weights and keeps its second layer dense (mlp_only_layers); Qwen2-MoE does not
    renormalise and has a shared expert; Mixtral always renormalises."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    if name == "qwen3_moe":
        return Qwen3MoeConfig(**_common(vocab, head_dim=32), **experts, norm_topk_prob=True, mlp_only_layers=[1])
    # The expert sizes transformers' GGUF reader assumes: it reads neither
    # expert_feed_forward_length nor expert_shared_feed_forward_length (test_moe_gguf.py).
    if name == "qwen3_moe_gguf":
        return Qwen3MoeConfig(**_common(vocab, head_dim=32), **experts | {"moe_intermediate_size": 768})
    if name == "qwen2_moe_gguf":
        sizes = {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632}
        return Qwen2MoeConfig(**_common(vocab), **experts | sizes)
    if name == "qwen2_moe":
        return Qwen2MoeConfig(**_common(vocab), **experts, shared_expert_intermediate_size=48, norm_topk_prob=False)
    if name == "mixtral":
        return MixtralConfig(**_common(vocab, intermediate_size=32), num_local_experts=8, num_experts_per_tok=2)
    raise ValueError(name)


WEIGHT_SCALE = {"gemma3": 0.05}
"""Weight standard deviation where 0.2 does not suit: Gemma's post-norms give every sublayer
a unit output, and at 0.2 its greedy text is one token repeated (0.05 varies it)."""

FAMILY_CHECKPOINTS = ("llama3_rope", "linear_rope", "yarn_rope", "qwen2", "qwen3", "mistral", "gemma3", "phi3")
MOE_CHECKPOINTS = ("qwen3_moe", "qwen2_moe", "mixtral")


def make_family_checkpoint(path: str, name: str, seed: int = 0, scale: float | None = None) -> str:
    """Writes the checkpoint `name` into `path`: every weight matrix ~N(0, scale) (default
    0.2, or WEIGHT_SCALE's), every norm weight and bias random too (so a norm or bias
    applied wrongly changes the tokens)."""
    scale = scale if scale is not None else WEIGHT_SCALE.get(name, 0.2)
    from transformers import AutoModelForCausalLM

    tok = smollm2_tokenizer()
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(path)
    cfg = family_config(name, len(tok))
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            if "norm" in pname:
                # Gemma's (1 + w) norms store w around 0, the others around 1.
                centre = 0.0 if cfg.model_type.startswith("gemma") else 1.0
                param.copy_(centre + 0.1 * noise)
            else:
                param.copy_(scale * noise)
    model.save_pretrained(path, safe_serialization=True)
    return path


def transformers_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the server is asked to ignore EOS too
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt_ids) :].tolist()


QUANTIZED_ARCHS = ("qwen3moe", "qwen2moe")
"""Written in Q4_0 and Q8_0 and read by transformers' GGUF loader; Mixtral (which that
loader does not read) in float32, against transformers on the checkpoint it came from."""


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
