"""Loading a checkpoint into this rank's modules: each tensor under its Hugging Face name
(weights.py reads them from safetensors or a GGUF) goes to its fused parameter (q/k/v into
qkv_proj, gate/up into gate_up_proj), sliced to this rank's share under tensor parallelism
(`ShardPlan`); a tensor in a GGUF's own format is kept aside in the model's QuantizedParts
for `install_quantized_weights` (gguf_layers.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu_worker.layers.gguf_layers import narrow, pad_rows
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.model.moe_checkpoint import per_expert_weights
from gpu_worker.runtime.parallel import ShardPlan

if TYPE_CHECKING:
    from gpu_worker.model.decoder import LlamaForCausalLM


def load_checkpoint_weights(model: LlamaForCausalLM, weights) -> None:
    """Takes (name, tensor) pairs in Hugging Face names (full, unsharded tensors); fuses
    q/k/v and gate/up and keeps only this rank's slice of each sharded weight."""
    if model.cfg.quirks.fused_checkpoint:
        weights = split_fused_weights(weights, model.cfg)
    if model.cfg.moe is not None:
        weights = per_expert_weights(weights)
    params = dict(model.named_parameters())
    plan, hd = model.plan, model.cfg.head_dim
    q, kv = plan.num_heads * hd, plan.num_kv_heads * hd
    heads = (plan.heads[0] * hd, q)
    kv_heads = (plan.kv_heads[0] * hd, kv)
    # checkpoint name -> (fused target, row offset in the target, (start, length) in the source)
    attention = {
        "q_proj": ("qkv_proj", 0, heads),
        "k_proj": ("qkv_proj", q, kv_heads),
        "v_proj": ("qkv_proj", q + kv, kv_heads),
    }
    vocab = (plan.vocab[0], plan.vocab[1] - plan.vocab[0])
    loaded: set[str] = set()
    dense: set[str] = set()
    for name, tensor in weights:
        # Gemma 3's multimodal checkpoints hold the decoder under language_model.
        name = name.removeprefix("model.").removeprefix("language_model.").removeprefix("model.")
        if (
            "rotary_emb" in name
            or (name == "lm_head.weight" and model.lm_head is None)
            or name.startswith(("vision_tower.", "multi_modal_projector."))
        ):
            continue
        parts = name.split(".")
        offset = 0
        inter_slice = intermediate_slice(model.plan, name)
        fused = attention | {
            "gate_proj": ("gate_up_proj", 0, inter_slice),
            "up_proj": ("gate_up_proj", inter_slice[1], inter_slice),
        }
        row_parallel = {"o_proj": heads, "down_proj": inter_slice}  # sliced along the input dim
        if len(parts) >= 2 and parts[-2] in fused:
            target, offset, (start, length) = fused[parts[-2]]
            name = ".".join(parts[:-2] + [target, parts[-1]])
            tensor = narrow(tensor, 0, start, length)
            dst = None if name in model.quantized_parts else params[name].data.narrow(0, offset, length)
        elif len(parts) >= 2 and parts[-2] in row_parallel and parts[-1] == "bias" and name in params:
            # The all-reduce sums the ranks' outputs: one rank adds the bias.
            tensor = tensor if plan.rank == 0 else torch.zeros_like(tensor)
            dst = params[name].data
        elif len(parts) >= 2 and parts[-2] in row_parallel and name in params:
            tensor = narrow(tensor, 1, *row_parallel[parts[-2]])
            dst = params[name].data
        elif name in ("embed_tokens.weight", "lm_head.weight") and not isinstance(tensor, torch.Tensor):
            tensor, dst = pad_rows(narrow(tensor, 0, *vocab), plan.vocab_rows), None
        elif name in ("embed_tokens.weight", "lm_head.weight") and name in params:
            tensor = tensor.narrow(0, *vocab)
            dst = params[name].data.narrow(0, 0, vocab[1])  # rows past the vocabulary stay zero
            params[name].data.zero_()
        elif name in params:
            dst = params[name].data
        else:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        if isinstance(tensor, torch.Tensor):
            if name in model.quantized_parts:
                raise ValueError(f"{name}: its parts mix quantized and dense formats; use --weight-dtype bf16")
            dst.copy_(tensor.to(dst.dtype))
            dense.add(name)
        else:
            if name in dense:
                raise ValueError(f"{name}: its parts mix quantized and dense formats; use --weight-dtype bf16")
            model.quantized_parts.add(name, offset, tensor)
            params[name].data = torch.empty(0)  # never written: no dense copy (gguf_layers.py)
        loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")


def intermediate_slice(plan: ShardPlan, name: str) -> tuple[int, int]:
    """(start, length) of this rank's share of the intermediate dimension of the MLP or
    expert that weight `name` belongs to."""
    if ".experts." in name:
        start, end = plan.expert_intermediate
    elif ".shared_expert." in name:
        start, end = plan.shared_intermediate
    else:
        start, end = plan.intermediate
    return start, end - start


def split_fused_weights(weights, cfg: ModelConfig):
    """Phi-3's fused qkv_proj and gate_up_proj tensors as the q/k/v and gate/up tensors
    load_weights slices and fuses for this rank."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    splits = {
        "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
        "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
    }
    for name, tensor in weights:
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in splits:
            yield name, tensor
            continue
        sizes = splits[parts[-2]]
        if tensor.shape[0] != sum(size for _, size in sizes):
            raise ValueError(f"{name}: {tensor.shape[0]} rows, the config gives {sum(s for _, s in sizes)}")
        for (part, _), piece in zip(sizes, tensor.split([size for _, size in sizes]), strict=True):
            yield ".".join([*parts[:-2], part, parts[-1]]), piece
