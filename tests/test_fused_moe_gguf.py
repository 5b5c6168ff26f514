"""The fused MoE op on a GGUF's quantized experts (layers/fused_moe_gguf.py) against each expert's
own QuantLinear layers, in every layout the dense GGUF path has (Q8_0, Q4_0, Q4_K, Q5_0 as I5,
Q6_K as I6, and gate/up in one format beside down in another, as the MoE GGUFs ship them).

The op's dot products are quant_linear's own tiles on the same int8 activations, and it rounds
where the per-expert path rounds except for each slot's down output, which it keeps in float32:
- in float32 activations it equals the per-expert path (moe_experts.py's torch loop over
  QuantLinear experts) bit for bit;
- in bf16 it equals, bit for bit, those experts' layers with down's sums kept in float32 and
  weighted in slot order; and it is within one bf16 rounding of each slot's down output of
  the per-expert path (derived below);
- a token's bits are the same in batches of 1 to 80, at any position, on one thread or two,
  and on the AVX2 and AVX512-VNNI paths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_elementwise_kernels, load_quant_linear
from gpu_worker.layers.fused_moe_gguf import FusedQuantMoE
from gpu_worker.layers.gguf_layers import quant_linear
from gpu_worker.layers.gguf_repack import I8Weights, QuantWeights, U4Weights
from gpu_worker.layers.moe_experts import MoeExperts

BEST_PATH = load_quant_linear()
pytestmark = [
    pytest.mark.skipif(not BEST_PATH, reason="the quantized kernels need an x86 CPU with AVX2"),
    pytest.mark.usefixtures("worker_threads"),
]

EXPERTS, HIDDEN, INTER = 12, 96, 64
"""Tiny, with widths that are multiples of 32 (the quantization blocks) but not of 64."""
BF16_U = 2.0**-8
F32_U = 2.0**-24


def random_quant_weights(fmt: str, n: int, k: int, rng: np.random.Generator) -> QuantWeights:
    """n x k random codes and scales as `fmt` stores them (gguf_repack.py's table); the
    benchmark (benchmarks/bench_fused_moe.py --gguf) draws its experts with it too."""
    fp16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    if fmt in ("Q4_0", "Q4_K"):
        scales = rng.uniform(0.01, 0.03, (n, k // 32)).astype(np.float32)
        mins = -8 * fp16(scales) if fmt == "Q4_0" else -rng.uniform(0, 0.2, (n, k // 32)).astype(np.float32)
        return U4Weights(rng.integers(0, 16, (n, k), dtype=np.uint8), fp16(scales) if fmt == "Q4_0" else scales, mins)
    block, bits = {"Q8_0": (32, 8), "Q5_0": (32, 5), "Q6_K": (16, 6)}[fmt]
    scales = rng.uniform(0.1, 0.3, (n, k // block)).astype(np.float32) / 2 ** (bits - 1)
    codes = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), (n, k), dtype=np.int8)
    return I8Weights(codes, fp16(scales) if fmt != "Q6_K" else scales, block, bits)


def _experts(gate_up_fmt: str, down_fmt: str, seed: int = 0) -> tuple[list[QuantWeights], list[QuantWeights]]:
    rng = np.random.default_rng(seed)
    gate_up = [random_quant_weights(gate_up_fmt, 2 * INTER, HIDDEN, rng) for _ in range(EXPERTS)]
    return gate_up, [random_quant_weights(down_fmt, HIDDEN, INTER, rng) for _ in range(EXPERTS)]


def _routing(tokens: int, k: int, dtype: torch.dtype, seed: int = 1):
    """x, topk_ids, topk_weights; ids from the first 3/4 of the experts (some get no tokens),
    distinct within a token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS * 3 // 4, generator=g)[:k] for _ in range(tokens)]).int()
    return x, ids, torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)


def _per_expert_path(gate_up: list[QuantWeights], down: list[QuantWeights]) -> MoeExperts:
    """moe_experts.py's torch loop with each expert's layers as install_quantized_weights makes them."""
    experts = MoeExperts(EXPERTS, HIDDEN, INTER)
    for expert, gate_up_w, down_w in zip(experts, gate_up, down, strict=True):
        expert.gate_up_proj, expert.down_proj = quant_linear(gate_up_w, None), quant_linear(down_w, None)
        expert.kernels = load_elementwise_kernels()
    return experts


def _slot_downs(experts: MoeExperts, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, k, H] float32: each slot's down sums, not rounded (down's input in float32 holds
    the activation's bits, so quant_linear quantizes it as in x's dtype)."""
    tokens, k = ids.shape
    out = torch.empty(tokens, k, HIDDEN)
    for t in range(tokens):
        for j in range(k):
            expert = experts[int(ids[t, j])]
            act = torch.ops.trident.silu_and_mul(expert.gate_up_proj(x[t : t + 1]))
            out[t, j] = expert.down_proj(act.float())[0]
    return out


def _slot_sum(downs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum in slot order, in float32, as moe_experts.py and the op add."""
    weighted = downs * weights.unsqueeze(-1)
    out = weighted[:, 0]
    for j in range(1, weighted.shape[1]):
        out = out + weighted[:, j]
    return out


FORMATS = [("Q8_0", "Q8_0"), ("Q4_0", "Q8_0"), ("Q4_K", "Q6_K"), ("Q5_0", "Q5_0"), ("Q6_K", "Q4_K")]


@pytest.mark.parametrize(("gate_up_fmt", "down_fmt"), FORMATS)
def test_in_float32_the_fused_op_is_the_per_expert_paths_bits(gate_up_fmt, down_fmt):
    gate_up, down = _experts(gate_up_fmt, down_fmt)
    fused = FusedQuantMoE.from_weights(gate_up, down)
    x, ids, weights = _routing(20, 4, torch.float32)
    assert torch.equal(fused(x, ids, weights), _per_expert_path(gate_up, down)(x, ids, weights))


@pytest.mark.parametrize(("gate_up_fmt", "down_fmt"), FORMATS)
def test_in_bf16_the_fused_op_keeps_down_in_float32_and_is_within_its_rounding_of_the_per_expert_path(
    gate_up_fmt, down_fmt
):
    gate_up, down = _experts(gate_up_fmt, down_fmt)
    fused = FusedQuantMoE.from_weights(gate_up, down)
    per_expert = _per_expert_path(gate_up, down)
    x, ids, weights = _routing(20, 4, torch.bfloat16)
    y = fused(x, ids, weights)
    downs = _slot_downs(per_expert, x, ids)
    assert torch.equal(y, _slot_sum(downs, weights).bfloat16())
    # The per-expert path rounds each slot's down output r_j to bf16 (|error| <= u |r_j|, u =
    # 2^-8) before the same float32 slot sum; each float32 product and sum adds at most 2^-24
    # of its size (k of each over S = sum_j |w_j r_j|, taking each partial sum at most S (1 +
    # u)); each result then rounds once to bf16 (u of its size).
    theirs = per_expert(x, ids, weights).float()
    size = (downs * weights.unsqueeze(-1)).abs().sum(dim=1)
    bound = BF16_U * size * (1 + BF16_U) + 2 * 2 * ids.shape[1] * F32_U * size * (1 + BF16_U)
    bound = bound + BF16_U * (y.float().abs() + theirs.abs())
    assert ((y.float() - theirs).abs() <= bound).all()


@pytest.mark.parametrize(("gate_up_fmt", "down_fmt"), [("Q4_0", "Q8_0"), ("Q6_K", "Q4_K")])
@pytest.mark.parametrize("k", [1, 8])
def test_a_token_gets_the_same_bits_in_batches_of_1_to_80_at_any_position(gate_up_fmt, down_fmt, k):
    """80 tokens of k = 8 over 9 experts: up to ~70 rows an expert, many tiles of rows, and ragged."""
    fused = FusedQuantMoE.from_weights(*_experts(gate_up_fmt, down_fmt))
    x, ids, weights = _routing(80, k, torch.bfloat16)
    whole = fused(x, ids, weights)
    for tokens in range(1, 81):
        assert torch.equal(fused(x[:tokens], ids[:tokens], weights[:tokens]), whole[:tokens]), tokens
    for start in (1, 7, 8, 9, 79):
        assert torch.equal(fused(x[start:], ids[start:], weights[start:]), whole[start:]), start
    order = torch.randperm(80, generator=torch.Generator().manual_seed(2))
    assert torch.equal(fused(x[order], ids[order], weights[order]), whole[order])


def test_the_same_bits_on_one_thread_and_two_past_one_pass_and_on_both_paths():
    """300 tokens: more than one of the op's 256-token passes."""
    gate_up, down = _experts("Q4_K", "Q8_0")
    fused = FusedQuantMoE.from_weights(gate_up, down)
    x, ids, weights = _routing(300, 8, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = fused(x, ids, weights)
        torch.set_num_threads(2)
        together = fused(x, ids, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)
    assert torch.equal(fused(x[299:], ids[299:], weights[299:]), alone[299:])
    avx2 = FusedQuantMoE.from_weights(gate_up, down, "avx2")
    assert torch.equal(avx2(x[:40], ids[:40], weights[:40]), alone[:40])


def test_no_tokens_is_empty_and_bad_inputs_are_clear_errors():
    fused = FusedQuantMoE.from_weights(*_experts("Q8_0", "Q8_0"))
    x, ids, weights = _routing(3, 2, torch.bfloat16)
    assert fused(x[:0], ids[:0], weights[:0]).shape == (0, HIDDEN)
    with pytest.raises(RuntimeError, match=f"expert id {EXPERTS} outside"):
        fused(x, torch.full_like(ids, EXPERTS), weights)
    with pytest.raises(RuntimeError, match="features|another shape"):
        fused(torch.randn(3, HIDDEN + 32).bfloat16(), ids, weights)
    with pytest.raises(RuntimeError, match="int32"):
        fused(x, ids.long(), weights)
    gate_up, down = _experts("Q4_0", "Q8_0")
    with pytest.raises(ValueError, match="different layouts"):
        FusedQuantMoE.from_weights(
            gate_up[:-1] + [random_quant_weights("Q8_0", 2 * INTER, HIDDEN, np.random.default_rng())], down
        )
