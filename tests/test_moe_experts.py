"""The routed experts' pieces against transformers' own: routing of each family, the torch
experts path, and the hook that hands the experts to a fused kernel (layers/moe_experts.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.moe_experts import MoeExperts
from gpu_worker.model.sparse_moe import route

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 32
UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2
"""u = 2^-24: float32 rounds a result to within a factor 1 +- u."""


def _transformers_router(family: str, norm_topk_prob: bool):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    sizes = {"hidden_size": HIDDEN, "num_experts_per_tok": TOP_K}
    if family == "mixtral":
        return MixtralTopKRouter(MixtralConfig(**sizes, num_local_experts=EXPERTS))
    config = {"num_experts": EXPERTS, "norm_topk_prob": norm_topk_prob}
    if family == "qwen2_moe":
        return Qwen2MoeTopKRouter(Qwen2MoeConfig(**sizes, **config))
    return Qwen3MoeTopKRouter(Qwen3MoeConfig(**sizes, **config))


@pytest.mark.parametrize(
    ("family", "norm_topk_prob"), [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False), ("mixtral", True)]
)
def test_routing_picks_and_weighs_the_experts_as_transformers_does(family, norm_topk_prob):
    router = _transformers_router(family, norm_topk_prob)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g))
        x = torch.randn(40, HIDDEN, generator=g)
        x[1] = 0  # every logit equal: ties, broken as torch.topk breaks them
        _, want_weights, want_ids = router(x)
        ids, weights = route(torch.nn.functional.linear(x, router.weight), TOP_K, norm_topk_prob)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights.float(), rtol=0, atol=1e-7)


def _experts(dtype: torch.dtype) -> MoeExperts:
    experts = MoeExperts(EXPERTS, HIDDEN, INTER)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return experts.to(dtype)


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    return ids, torch.rand(tokens, TOP_K, generator=g).softmax(-1)


def _float32_rounding_bound(expert, x: torch.Tensor) -> torch.Tensor:
    """How far a float32 evaluation of expert(x) [H] may lie from the exact one, in any summation
    order: each dot product of n terms errs by at most n * u * (the sum of its terms'
    magnitudes) (u = UNIT_ROUNDOFF), and gate_up's error reaches the output through silu(gate) * up
    (|silu'| < 1.1) and the down projection's magnitudes."""
    u = UNIT_ROUNDOFF
    w_gate_up = expert.gate_up_proj.weight.double()
    w_down = expert.down_proj.weight.double()
    gate_up = x.double() @ w_gate_up.T
    gate, up = gate_up.chunk(2)
    h = torch.nn.functional.silu(gate) * up
    gate_up_error = HIDDEN * u * (x.double().abs() @ w_gate_up.abs().T)
    gate_error, up_error = gate_up_error.chunk(2)
    # each product and silu rounds once more: 4 u of |h| covers them
    h_error = 1.1 * gate_error * up.abs() + torch.nn.functional.silu(gate).abs() * up_error + 4 * u * h.abs()
    return INTER * u * (h.abs() @ w_down.abs().T) + h_error @ w_down.abs().T


def test_the_torch_experts_are_the_weighted_sum_of_each_tokens_experts_in_slot_order():
    experts = _experts(torch.float32)
    x = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(2))
    ids, weights = _routing(30, 3)
    got = experts(x, ids, weights)
    for t in range(30):
        # The reference runs each expert on its token alone, and the torch path on the expert's
        # gathered tokens: oneDNN may block the sums differently, so the two float32 results
        # agree to twice the rounding bound of one, not bit for bit.
        want = torch.zeros(HIDDEN)
        bound = torch.zeros(HIDDEN, dtype=torch.float64)
        for j in range(TOP_K):
            expert = experts[int(ids[t, j])]
            term = weights[t, j] * expert(x[t : t + 1])[0]
            want = want + term
            bound += weights[t, j].double() * _float32_rounding_bound(expert, x[t])
            bound += 2 * UNIT_ROUNDOFF * term.double().abs()
        assert ((got[t].double() - want.double()).abs() <= 2 * bound).all(), t


class ReferenceFusedMoE(torch.nn.Module):
    """A fused kernel's contract in plain torch, as FusedMoE.from_weights(gate_up, down)
    takes it: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]. An nn.Module,
    as FusedMoE is: the hook must not list it among the experts."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32)
        for j in range(topk_ids.shape[1]):
            gate, up = (x.unsqueeze(1) @ self.gate_up[topk_ids[:, j].long()].transpose(1, 2)).squeeze(1).chunk(2, -1)
            y = (torch.nn.functional.silu(gate) * up).unsqueeze(1) @ self.down[topk_ids[:, j].long()].transpose(1, 2)
            out += topk_weights[:, j : j + 1] * y.squeeze(1).float()
        return out.to(x.dtype)


def test_the_fused_kernel_hook_hands_over_the_stacked_weights_and_drops_the_per_expert_layers():
    experts = _experts(torch.float32)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(4))
    ids, weights = _routing(12, 5)
    want = experts(x, ids, weights)
    experts.use_fused(ReferenceFusedMoE)
    assert len(experts) == 0 and list(experts.children()) == [] and isinstance(experts.fused, ReferenceFusedMoE)
    assert experts.fused.gate_up.shape == (EXPERTS, 2 * INTER, HIDDEN)
    assert experts.fused.down.shape == (EXPERTS, HIDDEN, INTER)
    torch.testing.assert_close(experts(x, ids, weights), want, rtol=1e-5, atol=1e-5)
