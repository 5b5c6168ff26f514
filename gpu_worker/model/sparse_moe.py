"""The MLP of a mixture-of-experts layer: a router, the routed experts and, in Qwen2-MoE, a
shared expert behind a sigmoid gate (families.py, moe_spec.py).

Routing, in float32 whatever the model's dtype: softmax over the router's logits, the top k
by torch.topk (ties as torch breaks them, like the reference), renormalised to sum to 1
where the family or config says so. Mixtral's reference takes the top k of the logits and
softmaxes those: the same weights as the renormalised top k of the softmax.

Tensor parallelism follows the dense MLP: the router and the shared expert's gate are
replicated (every rank computes the same weights from the same input), each rank holds a
slice of every expert's intermediate dimension (and of the shared expert's), and one
all-reduce sums the ranks' partial outputs of the routed and shared experts together.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.layers.moe_experts import Expert, MoeExperts
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.runtime.parallel import ShardPlan, TPGroup


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids int32 [T, k], weights float32 [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


class SparseMoeBlock(nn.Module):
    """Names as the checkpoints': gate (the router), experts.N, shared_expert, shared_expert_gate."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        assert cfg.moe is not None
        moe = cfg.moe
        self.tp = tp
        self.top_k = moe.top_k
        self.renormalise = moe.norm_topk_prob
        # An nn.Linear, so the linear plan gives the router its batch-invariant kernel too.
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        inter = plan.expert_intermediate[1] - plan.expert_intermediate[0]
        self.experts = MoeExperts(moe.num_experts, cfg.hidden_size, inter)
        self.shared_expert: Expert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            shared = plan.shared_intermediate[1] - plan.shared_intermediate[0]
            self.shared_expert = Expert(cfg.hidden_size, shared)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(self.gate(x), self.top_k, self.renormalise)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)
