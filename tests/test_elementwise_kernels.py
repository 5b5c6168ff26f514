"""The C++ elementwise ops of a decoder layer (csrc/rms_norm.cpp, csrc/layer_elementwise.cpp)
compute what decoder_layer.py's torch ops do, rounding where they round, for every dtype and any
number of rows; the model uses them in eager steps and the torch ops when compiled."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels.cpu_kernels import ElementwiseKernels, load_elementwise_kernels
from gpu_worker.model.decoder_layer import RMSNorm, apply_rotary
from gpu_worker.model.rope import RotaryEmbedding
from gpu_worker.runtime.kv_pool import write_kv

pytestmark = pytest.mark.usefixtures("worker_threads")  # the kernels' split across threads is checked too

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels() -> ElementwiseKernels:
    ops = load_elementwise_kernels()
    assert ops is not None, "the C++ kernels did not build (see the log)"
    return ops


def assert_same_up_to_last_bit(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within rounding. Lower precisions: float32 sums and exponentials may differ
    in their last bit, so after rounding at most one step of the dtype apart, and almost
    everywhere the same bits."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    step = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * step, atol=1e-6)
    assert (got == want).float().mean() >= 0.99


def _torch_norm(dim: int, dtype: torch.dtype, unit_offset: bool = False) -> RMSNorm:
    norm = RMSNorm(dim, eps=1e-5, unit_offset=unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim).to(dtype))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (3, 5, 64), (2, 100)])
def test_the_rms_norm_op_matches_the_torch_ops_of_the_reference_order(kernels, dtype, shape):
    norm = _torch_norm(shape[-1], dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    assert_same_up_to_last_bit(kernels.rms_norm(x, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_add_rms_norm_returns_the_residual_sum_and_its_norm(kernels, dtype, rows):
    norm = _torch_norm(576, dtype)
    x, delta = (torch.randn(rows, 576) * 3).to(dtype), torch.randn(rows, 576).to(dtype)
    total, normed = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta)  # one rounding of an exact float32 sum: the same bits
    assert_same_up_to_last_bit(normed, norm(x + delta))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 640), (37, 640), (3, 4, 256)])
def test_the_unit_offset_rms_norm_op_matches_gemmas_float32_product(kernels, dtype, shape):
    """Gemma: normalised and scaled by (1 + w) in float32, then one rounding."""
    norm = _torch_norm(shape[-1], dtype, unit_offset=True)
    x = (torch.randn(shape) * 3).to(dtype)
    assert_same_up_to_last_bit(kernels.rms_norm(x, norm.weight, norm.eps, True), norm(x))
    total, normed = kernels.add_rms_norm(x, x, norm.weight, norm.eps, True)
    assert torch.equal(total, x + x)
    assert_same_up_to_last_bit(normed, norm(x + x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 40])
def test_gelu_tanh_and_mul_matches_split_gelu_mul(kernels, dtype, rows):
    """GeGLU (Gemma): gelu with the tanh approximation of the gate, times up. Below a gate of
    about -3, 1 + tanh cancels in float32 (in torch as in the op): there the two may differ
    by a few float32 steps of 1, times 0.5 |gate| |up|; elsewhere by a step of the dtype."""
    gate_up = (torch.randn(rows, 2 * 2048) * 4).to(dtype)
    gate, up = gate_up.split(2048, dim=-1)
    got, want = kernels.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up
    cancellation = 0.5 * (gate.float() * up.float()).abs() * 4 * torch.finfo(torch.float32).eps
    step = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert ((got.float() - want.float()).abs() <= cancellation + step * want.float().abs()).all()
    if dtype != torch.float32:
        assert (got == want).float().mean() >= 0.99


def test_gelu_tanh_and_mul_is_finite_at_the_extremes(kernels):
    gate = torch.tensor([[-1e4, -100.0, -1e-3, 0.0, 1e-3, 100.0, 1e4, 3e12]])
    got = kernels.gelu_tanh_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 40])
def test_silu_and_mul_matches_split_silu_mul(kernels, dtype, rows):
    gate_up = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    assert_same_up_to_last_bit(kernels.silu_and_mul(gate_up), F.silu(gate) * up)


def test_silu_and_mul_is_finite_at_the_extremes(kernels):
    gate = torch.tensor([[-1e4, -100.0, -1e-3, 0.0, 1e-3, 100.0, 1e4, 3e38]])
    got = kernels.silu_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    torch.testing.assert_close(got, F.silu(gate), rtol=1e-5, atol=1e-6)


def _digest_over_every_bf16_gate(op) -> str:
    """op's output bits for each of the 65,536 bfloat16 gate values (NaNs, infinities and
    subnormals among them), each against an up of scattered bits, in rows of 256 columns and
    in rows of 13,107 (not a multiple of a vector's width)."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = (torch.arange(65536) * 40503 % 65536).to(torch.int32).to(torch.int16).view(torch.bfloat16)
    digest = hashlib.sha256()
    for rows, inter in ((256, 256), (5, 13107)):
        n = rows * inter
        gate_up = torch.cat([every[:n].view(rows, inter), up[:n].view(rows, inter)], dim=1)
        digest.update(op(gate_up).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def test_the_bf16_gated_activations_keep_the_bits_of_their_per_element_polynomial(kernels):
    """bfloat16 gates are looked up in a table of the activation's rounded values; the
    digests are of the outputs from before the table, when each element evaluated the
    exponential's polynomial: the served bits (and the batch invariance and parity tests'
    references) stay what they were."""
    assert _digest_over_every_bf16_gate(kernels.silu_and_mul) == "1225020835151bf5"
    assert _digest_over_every_bf16_gate(kernels.gelu_tanh_and_mul) == "37d090ac6848fb64"


HEAD_DIMS = [64, 128, 256]
"""SmolLM2; Llama 3, Qwen, Mistral; Gemma 3."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_rotary_matches_the_torch_rotary_on_a_strided_view_of_qkv(kernels, dtype, tokens, dim):
    heads, kv_heads = 9, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(-1, heads + kv_heads, dim)  # rows strided by qkv's width
    rope = RotaryEmbedding(dim, 10000.0, 4096)
    tables = rope.tables(torch.randint(0, 4096, (tokens,)), dtype)
    got = kernels.rotary(qk, *tables)
    want = apply_rotary(qk, tables)
    assert got.is_contiguous()
    if dtype == torch.float32:
        assert torch.equal(got, want)  # products and sums rounded as torch rounds them: the same bits
    else:
        assert_same_up_to_last_bit(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_rotary_write_kv_gives_the_rotary_q_and_writes_what_write_kv_writes(kernels, dtype, tokens, dim):
    heads, kv_heads, pool = 9, 3, 50
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    tables = RotaryEmbedding(dim, 10000.0, 4096).tables(torch.randint(0, 4096, (tokens,)), dtype)
    loc = torch.randperm(pool)[:tokens]
    want_cache, got_cache = (
        torch.randn(pool, 2, kv_heads, dim).to(dtype),
        torch.zeros(pool, 2, kv_heads, dim, dtype=dtype),
    )
    got_cache.copy_(want_cache)
    # The decode step's torch path (decoder_layer.py): one rotary over q and k, then write_kv.
    qk = kernels.rotary(qkv[:, : (heads + kv_heads) * dim].view(-1, heads + kv_heads, dim), *tables)
    write_kv(want_cache, loc, qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim))
    q = kernels.rotary_write_kv(qkv, *tables, got_cache, loc, heads, kv_heads)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(got_cache, want_cache)  # the new tokens' K/V, and nothing else touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["qwen3_norm", "gemma_norm"])
def test_rotary_write_kv_with_qk_norms_equals_the_norm_ops_then_the_rotary(kernels, dtype, tokens, dim, unit_offset):
    """Qwen3's and Gemma 3's per-head q/k norms inside the op: the bits of rms_norm on each
    head, then the rotary and the write, as the modules did it in three ops and a cat."""
    heads, kv_heads, pool = 8, 2, 50
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * dim)).to(dtype)
    tables = RotaryEmbedding(dim, 10000.0, 4096).tables(torch.randint(0, 4096, (tokens,)), dtype)
    loc = torch.randperm(pool)[:tokens]
    q_norm, k_norm = _torch_norm(dim, dtype, unit_offset), _torch_norm(dim, dtype, unit_offset)
    want_cache = torch.randn(pool, 2, kv_heads, dim).to(dtype)
    got_cache = want_cache.clone()
    q_size, kv_size = heads * dim, kv_heads * dim
    q = kernels.rms_norm(qkv[:, :q_size].reshape(-1, dim), q_norm.weight, q_norm.eps, unit_offset)
    k = kernels.rms_norm(qkv[:, q_size : q_size + kv_size].reshape(-1, dim), k_norm.weight, k_norm.eps, unit_offset)
    normed = torch.cat((q.view(tokens, q_size), k.view(tokens, kv_size), qkv[:, q_size + kv_size :]), dim=-1)
    want_q = kernels.rotary_write_kv(normed, *tables, want_cache, loc, heads, kv_heads)
    got_q = kernels.rotary_write_kv(
        qkv, *tables, got_cache, loc, heads, kv_heads, q_norm.weight, k_norm.weight, q_norm.eps, unit_offset
    )
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_cache, want_cache)
    if unit_offset:  # and Gemma's norm is the torch module's, up to the last bit
        assert_same_up_to_last_bit(q, q_norm(qkv[:, :q_size].reshape(-1, dim)))


def test_rotary_write_kv_refuses_a_pool_index_out_of_range(kernels):
    qkv, cache = torch.randn(2, 5 * 8), torch.zeros(4, 2, 1, 8)
    tables = RotaryEmbedding(8, 10000.0, 64).tables(torch.tensor([0, 1]), torch.float32)
    with pytest.raises(RuntimeError, match="pool index 4 out of"):
        kernels.rotary_write_kv(qkv, *tables, cache, torch.tensor([0, 4]), 3, 1)
    assert not cache.any()


def test_a_model_norm_uses_the_ops_when_given_and_torch_ops_when_compiled(kernels):
    norm = _torch_norm(64, torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    torch_result = norm(x)
    norm.kernels = kernels
    assert torch.equal(norm(x), kernels.rms_norm(x, norm.weight, norm.eps))
    compiled = torch.compile(norm)
    torch.testing.assert_close(compiled(x).float(), torch_result.float(), rtol=1e-2, atol=1e-2)
