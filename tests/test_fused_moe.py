"""The fused mixture-of-experts op (csrc/fused_moe.cpp, layers/fused_moe.py), on each path this
CPU has: within the arithmetic's rounding of a float64 reference, a token's bits independent of
the other tokens of its call (their number, its position) and of the number of threads, and the
avx512_bf16 and portable paths bit for bit the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels.cpu_kernels import load_amx_linear, load_elementwise_kernels, load_vnni_linear
from gpu_worker.layers.fused_moe import FusedMoE, fused_moe_available

pytestmark = pytest.mark.skipif(not fused_moe_available(), reason="the C++ CPU kernels did not build here")

HAS_AMX = load_amx_linear() is not None
HAS_AVX512_BF16 = load_vnni_linear() is not None
PATHS = [
    pytest.param(
        "amx",
        marks=pytest.mark.skipif(
            not HAS_AMX, reason="this CPU lacks AMX-TILE and AMX-BF16 (or the OS does not grant AMX's tile state)"
        ),
    ),
    pytest.param(
        "avx512_bf16",
        marks=pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU (or the kernels' build) lacks AVX512-BF16"),
    ),
    "portable",
]

EXPERTS, HIDDEN, INTER = 16, 80, 48
"""Ragged on purpose: hidden and the intermediate size are not multiples of the op's 32-wide
blocks and chunks, so the zero padding is exercised."""
BOUND = {"u": 2.0**-24, "bf16": 2.0**-8}
"""float32's unit roundoff (a rounded sum or product is within u of its exact value, relative)
and bfloat16's (half an ulp: 2^-8 relative, round to nearest)."""
SILU_SLOPE = 1.1
"""|silu'(x)| <= 1.0999 for every x: how far an error in the gate can move silu(gate)."""


def _experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).bfloat16()
    return gate_up, down


def _routing(tokens: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, topk_ids, topk_weights; the ids drawn from the first 3/4 of the experts only, so some
    experts get no tokens, and distinct within a token (as top-k gives them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    used = EXPERTS * 3 // 4
    ids = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(tokens)]).int()
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return x, ids, weights


def _reference_and_bound(gate_up, down, x, ids, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact (float64) result of the formula, and how far the op may be from it given where it
    rounds (fused_moe.py's docstring), propagated with the triangle inequality:
    - gate and up: float32 sums of `HIDDEN` exact bf16 products (error <= HIDDEN u sum|w x|), then
      rounded to bf16;
    - silu moves a gate error at most SILU_SLOPE times; its result is rounded to bf16 (its exp is
      a polynomial within 2^-20, counted as one more u-sized term);
    - the activation silu * up rounded to bf16;
    - down: float32 sums of INTER exact products of the rounded activation;
    - the weighted sum over k slots in float32 (a rounded product and a rounded sum per slot),
      then rounded to bf16 once."""
    u, b = BOUND["u"], BOUND["bf16"]
    tokens, k = ids.shape
    reference = torch.zeros(tokens, HIDDEN, dtype=torch.float64)
    bound = torch.zeros(tokens, HIDDEN, dtype=torch.float64)
    for t in range(tokens):
        xt = x[t].double()
        for j in range(k):
            e = int(ids[t, j])
            w_gate, w_up = gate_up[e, :INTER].double(), gate_up[e, INTER:].double()
            w_down = down[e].double()
            gate, up = w_gate @ xt, w_up @ xt
            sum_error_gate = HIDDEN * u * (w_gate.abs() @ xt.abs())
            sum_error_up = HIDDEN * u * (w_up.abs() @ xt.abs())
            error_gate = sum_error_gate + b * (gate.abs() + sum_error_gate)
            error_up = sum_error_up + b * (up.abs() + sum_error_up)
            silu = F.silu(gate)
            error_silu = SILU_SLOPE * error_gate + (b + 2.0**-20) * (silu.abs() + SILU_SLOPE * error_gate)
            product_error = error_silu * (up.abs() + error_up) + silu.abs() * error_up
            activation = silu * up
            error_activation = product_error + b * (activation.abs() + product_error)
            y = w_down @ activation
            y_bound = w_down.abs() @ error_activation
            y_bound = y_bound + INTER * u * (w_down.abs() @ (activation.abs() + error_activation))
            weight = float(weights[t, j])
            reference[t] += weight * y
            bound[t] += abs(weight) * (y_bound + 2 * u * (y.abs() + y_bound))
        bound[t] += k * u * (bound[t] + reference[t].abs())
        bound[t] += b * (reference[t].abs() + bound[t])
    return reference, bound


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [1, 2, 8])
def test_fused_moe_is_within_the_arithmetics_rounding_of_a_float64_reference(path, k):
    gate_up, down = _experts()
    x, ids, weights = _routing(40, k)
    y = FusedMoE.from_weights(gate_up, down, path)(x, ids, weights)
    reference, bound = _reference_and_bound(gate_up, down, x, ids, weights)
    assert y.dtype == torch.bfloat16 and y.shape == (40, HIDDEN)
    error = (y.double() - reference).abs()
    assert (error <= bound).all(), (error - bound).max()


@pytest.mark.parametrize("path", PATHS[:2])
def test_fused_moe_rounds_as_the_dense_bf16_mlp_does(path):
    """Each expert's activation is the dense MLP's bits: the same path's bf16 linear (amx_linear or
    vnni_linear, which sum each output in the op's k order) for gate_up, then silu_and_mul. From
    there only float32 sums remain: down's INTER products, then the k weighted slots (a rounded
    product and sum each), and the final rounding to bf16, so the bound is tight."""
    linear = load_amx_linear() if path == "amx" else load_vnni_linear()
    silu_and_mul = load_elementwise_kernels().silu_and_mul
    gate_up, down = _experts()
    x, ids, weights = _routing(40, 8)
    y = FusedMoE.from_weights(gate_up, down, path)(x, ids, weights)
    u, b = BOUND["u"], BOUND["bf16"]
    reference = torch.zeros(40, HIDDEN, dtype=torch.float64)
    bound = torch.zeros(40, HIDDEN, dtype=torch.float64)
    for e in range(EXPERTS):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        activation = silu_and_mul(linear.linear(x[tokens], linear.pack(gate_up[e]), None, 2 * INTER)).double()
        y_e = activation @ down[e].double().T
        y_bound = INTER * u * (activation.abs() @ down[e].double().abs().T)
        slot_weights = weights[tokens, slots].double()[:, None]
        reference.index_add_(0, tokens, slot_weights * y_e)
        bound.index_add_(0, tokens, slot_weights.abs() * (y_bound + 2 * u * (y_e.abs() + y_bound)))
    bound += 8 * u * (bound + reference.abs())
    bound += b * (reference.abs() + bound)
    assert ((y.double() - reference).abs() <= bound).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [1, 2, 8])
def test_fused_moe_gives_a_token_the_same_bits_in_batches_of_1_to_80_at_any_position(path, k, worker_threads):
    """With 80 tokens and k = 8 an expert gets up to ~50 rows: more than one 32-row call of the
    block sums, and a ragged last tile."""
    layer = FusedMoE.from_weights(*_experts(), path)
    x, ids, weights = _routing(80, k)
    whole = layer(x, ids, weights)
    for tokens in range(1, 81):
        assert torch.equal(layer(x[:tokens], ids[:tokens], weights[:tokens]), whole[:tokens]), tokens
    for start in (1, 15, 16, 17, 31, 33, 79):
        assert torch.equal(layer(x[start:], ids[start:], weights[start:]), whole[start:]), start
    order = torch.randperm(80, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x[order], ids[order], weights[order]), whole[order])


@pytest.mark.parametrize("path", PATHS)
def test_fused_moe_gives_the_same_bits_on_one_thread_and_on_two_and_past_one_pass(path):
    """300 tokens: more than one of the op's 256-token passes."""
    layer = FusedMoE.from_weights(*_experts(), path)
    x, ids, weights = _routing(300, 8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x, ids, weights)
        torch.set_num_threads(2)
        together = layer(x, ids, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)
    assert torch.equal(layer(x[299:], ids[299:], weights[299:]), alone[299:])
    assert torch.equal(layer(x[250:270], ids[250:270], weights[250:270]), alone[250:270])


@pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU (or the kernels' build) lacks AVX512-BF16")
def test_the_portable_path_gives_the_avx512_bf16_paths_bits():
    gate_up, down = _experts()
    x, ids, weights = _routing(50, 8)
    portable = FusedMoE.from_weights(gate_up, down, "portable")(x, ids, weights)
    assert torch.equal(FusedMoE.from_weights(gate_up, down, "avx512_bf16")(x, ids, weights), portable)


def test_fused_moe_of_no_tokens_is_empty_and_bad_inputs_are_clear_errors():
    layer = FusedMoE.from_weights(*_experts())
    x, ids, weights = _routing(3, 2)
    assert layer(x[:0], ids[:0], weights[:0]).shape == (0, HIDDEN)
    with pytest.raises(RuntimeError, match="expert id 16 outside"):
        layer(x, torch.full_like(ids, EXPERTS), weights)
    with pytest.raises(RuntimeError, match="features"):
        layer(torch.randn(3, HIDDEN + 32).bfloat16(), ids, weights)
    with pytest.raises(RuntimeError, match="int32"):
        layer(x, ids.long(), weights)
    with pytest.raises(ValueError, match=r"\[E, 2 I, H\]"):
        FusedMoE.from_weights(torch.zeros(2, 8, 4, dtype=torch.bfloat16), torch.zeros(2, 4, 3, dtype=torch.bfloat16))
