"""The mixture-of-experts numbers of one checkpoint (families.py says which families route).

A sparse layer replaces the dense MLP by `num_experts` SwiGLU experts of `intermediate_size`
each; a router picks `top_k` of them per token (softmax over its logits, then top-k, the
k weights renormalised to sum to 1 where `norm_topk_prob`), and Qwen2-MoE adds a shared
expert that every token runs, scaled by sigmoid(shared_expert_gate(x)). Qwen-MoE configs
may keep some layers dense (`mlp_only_layers`, `decoder_sparse_step`): those run the dense
MLP of the config's own `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    """Each routed expert's intermediate size (Qwen: moe_intermediate_size; Mixtral: intermediate_size)."""
    norm_topk_prob: bool
    """Renormalise the top-k softmax weights to sum to 1 (Mixtral always; Qwen per config)."""
    shared_intermediate_size: int = 0
    """The shared expert's intermediate size (Qwen2-MoE); 0: no shared expert."""
    sparse_layers: tuple[int, ...] = ()
    """The layers whose MLP is the experts; the others run the dense MLP."""

    @classmethod
    def from_hf(cls, cfg: dict, layers: int, norm_topk_prob: bool | None, shared_expert: bool) -> MoeSpec:
        """From config.json; `norm_topk_prob` (the family's) overrides the config's where set."""
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or ())
        return cls(
            num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if norm_topk_prob is None else norm_topk_prob,
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if shared_expert else 0,
            sparse_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        )
