"""The Triton kernels (gpu_worker/kernels/triton/) on CPU tensors under the Triton interpreter,
against the torch path they replace: float32 results equal where the ops and their order are
the same, else within a stated bound; bf16 within one bf16 ulp (the interpreter truncates where
a GPU rounds). Tiny shapes: the interpreter runs each program in turn on the host."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this process

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from gpu_worker.kernels.triton.decode_attention import TritonDecodeAttention  # noqa: E402
from gpu_worker.kernels.triton.extend_attention import TritonExtendAttention  # noqa: E402
from gpu_worker.kernels.triton.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from gpu_worker.kernels.triton.rotary_write_kv import rotary_write_kv  # noqa: E402
from gpu_worker.model.attention import shifted_causal_mask, windowed_causal_mask  # noqa: E402
from gpu_worker.model.decoder_layer import RMSNorm, apply_rotary  # noqa: E402
from gpu_worker.model.rope import RotaryEmbedding  # noqa: E402
from gpu_worker.runtime.kv_pool import write_kv  # noqa: E402

ATTENTION_BOUND = 1e-5
"""float32 attention against a float64 reference: the kernels sum in blocks and merge split
parts, so not the torch path's bits; a wrong key or mask is off by far more."""


def _decode_reference(q, pool, kv_indices, kv_lens, window=0):
    rows, heads, dim = q.shape
    kv_heads = pool.shape[2]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        n = int(kv_lens[r])
        if n == 0:
            continue
        first = max(0, n - window) if window else 0
        kv = pool[kv_indices[r, first:n]].double()
        keys = kv[:, 0].repeat_interleave(heads // kv_heads, dim=1)
        values = kv[:, 1].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,khd->hk", q[r].double(), keys) / dim**0.5
        out[r] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize(
    "dim, heads, kv_heads, window",
    [(64, 8, 2, 0), (128, 4, 4, 5), (256, 2, 1, 0), (64, 6, 2, 40)],
)
def test_decode_attention_matches_a_float64_softmax_over_each_rows_keys(dim, heads, kv_heads, window):
    torch.manual_seed(dim + heads)
    pool = torch.randn(160, 2, kv_heads, dim)
    kv_lens = torch.tensor([1, 37, 0, 70])  # a padding row (0 keys) yields zeros
    kv_indices = torch.randint(1, 160, (4, 70))
    q = torch.randn(4, heads, dim)
    out = TritonDecodeAttention(num_splits=4, block_n=16)(q, pool, kv_indices, kv_lens, dim**-0.5, window)
    want = _decode_reference(q, pool, kv_indices, kv_lens, window)
    assert (out.double() - want).abs().max() < ATTENTION_BOUND
    assert (out[2] == 0).all()


def test_decode_attention_reads_each_rows_keys_through_kv_rows():
    """The CUDA-graph runner's form: a persistent table, each row naming its row of it."""
    torch.manual_seed(1)
    pool = torch.randn(100, 2, 2, 64)
    table = torch.randint(1, 100, (6, 40))
    rows, kv_lens = torch.tensor([4, 1, 4]), torch.tensor([40, 9, 3])
    q = torch.randn(3, 4, 64)
    out = TritonDecodeAttention(num_splits=2)(q, pool, table, kv_lens, 0.125, 0, rows)
    want = _decode_reference(q, pool, table[rows], kv_lens)
    assert (out.double() - want).abs().max() < ATTENTION_BOUND


def test_decode_attention_in_bf16_is_within_a_bf16_rounding():
    torch.manual_seed(2)
    pool = torch.randn(60, 2, 1, 128).bfloat16()
    kv_indices, kv_lens = torch.randint(1, 60, (2, 50)), torch.tensor([50, 17])
    q = torch.randn(2, 4, 128).bfloat16()
    out = TritonDecodeAttention(num_splits=2)(q, pool, kv_indices, kv_lens, 128**-0.5)
    want = _decode_reference(q, pool, kv_indices, kv_lens)
    assert (out.double() - want).abs().max() < 2**-6  # values are below 1: one bf16 ulp and a half


@pytest.mark.parametrize(
    "dim, heads, kv_heads, window, prefix, q_len",
    [(64, 8, 2, 0, 0, 20), (128, 4, 4, 7, 13, 40), (256, 2, 1, 0, 33, 5)],
)
def test_extend_attention_matches_sdpa_with_the_shifted_causal_mask(dim, heads, kv_heads, window, prefix, q_len):
    torch.manual_seed(dim)
    pool = torch.randn(120, 2, kv_heads, dim)
    kv_indices = torch.randperm(119)[: prefix + q_len] + 1
    q = torch.randn(q_len, heads, dim)
    out = TritonExtendAttention(block_m=16, block_n=16)(q, pool, kv_indices, prefix, dim**-0.5, window)
    kv = pool[kv_indices].double()
    if window:
        mask = windowed_causal_mask(q_len, prefix, window, q.device)
    else:
        mask = shifted_causal_mask(q_len, prefix, q.device)
    keys, values = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
    want = F.scaled_dot_product_attention(q.double().transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True)
    assert (out.double() - want.transpose(0, 1)).abs().max() < ATTENTION_BOUND


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_modules_norm(dtype, unit_offset):
    torch.manual_seed(3)
    norm = RMSNorm(96, 1e-6, unit_offset)
    norm.weight.data = torch.randn(96) * 0.1 + (0.0 if unit_offset else 1.0)
    norm = norm.to(dtype)
    x, delta = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    total, normed = add_rms_norm(x, delta, norm.weight, 1e-6, unit_offset)
    want_total, want_normed = norm.add_and_norm(x, delta)
    alone = rms_norm(x, norm.weight, 1e-6, unit_offset)
    if dtype == torch.float32:
        assert torch.equal(total, want_total)
        # The sum of squares is reduced in another order: a few float32 ulps.
        assert (normed - want_normed).abs().max() < 1e-6 and (alone - norm(x)).abs().max() < 1e-6
    else:
        # Two roundings (the norm, the weight), each truncated by the interpreter: two bf16 ulps.
        ulps = want_normed.float().abs().clamp(min=1) * 2**-6
        assert ((normed.float() - want_normed.float()).abs() <= ulps).all()
        assert ((total.float() - want_total.float()).abs() <= want_total.float().abs() * 2**-7).all()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_write_kv_rotates_writes_and_skips_padding_rows(qk_norm):
    torch.manual_seed(4)
    heads, kv_heads, dim, tokens = 4, 2, 64, 3
    cos, signed_sin = RotaryEmbedding(dim, 10000.0, 64).tables(torch.tensor([3, 7, 9]), torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    norms = (torch.randn(dim) * 0.1 + 1, torch.randn(dim) * 0.1 + 1, 1e-6, False) if qk_norm else ()
    pool = torch.randn(20, 2, kv_heads, dim)
    want_pool = pool.clone()
    loc = torch.tensor([5, -1, 11])  # the middle token is a padding row: it writes nothing
    q = rotary_write_kv(qkv, cos, signed_sin, pool, loc, heads, kv_heads, *norms)

    x = qkv
    if qk_norm:
        q_norm, k_norm = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
        q_norm.weight.data, k_norm.weight.data = norms[0], norms[1]
        qs, ks = x[:, : heads * dim].reshape(-1, dim), x[:, heads * dim : (heads + kv_heads) * dim].reshape(-1, dim)
        x = torch.cat((q_norm(qs).view(tokens, -1), k_norm(ks).view(tokens, -1), x[:, (heads + kv_heads) * dim :]), -1)
    qk = apply_rotary(x[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim), (cos, signed_sin))
    real = torch.tensor([0, 2])
    values = x[real][:, (heads + kv_heads) * dim :].reshape(2, kv_heads, dim)
    write_kv(want_pool, loc[real], qk[real, heads:], values)
    bound = 1e-6 if qk_norm else 0.0  # the norm's sum of squares in another order
    assert (q - qk[:, :heads]).abs().max() <= bound
    assert (pool - want_pool).abs().max() <= bound
    assert torch.equal(pool[:5], want_pool[:5]) and torch.equal(pool[12:], want_pool[12:])
