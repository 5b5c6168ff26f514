"""The C++ decode attention kernel (gpu_worker/kernels/csrc/paged_decode_attention.cpp) computes
what a float64 softmax over each row's own keys does, reading them where the pool has them.

It must build here: `--decode-attention auto` would fall back to torch ops silently, so a
kernel that stopped compiling must fail a test instead.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_decode_attention as load

pytestmark = pytest.mark.usefixtures("worker_threads")  # the kernels' split across threads is checked too


@pytest.fixture(scope="module")
def kernel():
    op = load()
    assert op is not None, "the paged decode attention kernel did not build (see the log)"
    return op


def _reference(q, pool, kv_indices, kv_lens, window=0):
    """float64 attention of each row's one query over its first kv_lens[row] keys, or the
    last `window` of them."""
    rows, heads, dim = q.shape
    kv_heads = pool.shape[2]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        first = max(0, int(kv_lens[r]) - window) if window else 0
        kv = pool[kv_indices[r, first : kv_lens[r]]].double()  # [len, 2, kv_heads, dim]
        keys = kv[:, 0].repeat_interleave(heads // kv_heads, dim=1)  # [len, heads, dim]
        values = kv[:, 1].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,khd->hk", q[r].double(), keys) / dim**0.5
        out[r] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize(
    "dtype, dim, heads, kv_heads",
    [
        (torch.bfloat16, 64, 9, 3),  # SmolLM2's shape: the fast path (AVX-512 or AVX2)
        (torch.bfloat16, 64, 8, 8),  # one query head per KV head
        (torch.bfloat16, 64, 16, 4),
        (torch.bfloat16, 64, 16, 2),  # 8 per KV head: AVX2 sums one output vector a pass
        (torch.bfloat16, 64, 10, 2),  # 5 heads per KV head: no fast path, the generic loop
        (torch.bfloat16, 32, 4, 2),  # another head dim: the generic loop
        (torch.float32, 64, 9, 3),
        (torch.float32, 128, 8, 2),
        (torch.float16, 64, 4, 1),
        (torch.bfloat16, 128, 8, 2),  # Llama 3 / Qwen / Mistral head dim: the fast path
        (torch.bfloat16, 128, 2, 1),  # AVX-512: queries in registers
        (torch.bfloat16, 128, 24, 3),  # 8 per KV head: queries in L1, 2 output vectors a pass
        (torch.bfloat16, 256, 4, 1),  # Gemma 3 270M's shape: the fast path, outputs in column passes
        (torch.bfloat16, 256, 1, 1),  # AVX-512: the one query and all 16 outputs in registers
        (torch.bfloat16, 256, 6, 2),  # 3 per KV head
        (torch.bfloat16, 256, 16, 2),
        (torch.float32, 256, 4, 1),
    ],
)
def test_kernel_equals_float64_attention_over_scattered_ragged_rows(kernel, dtype, dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(dim * heads + kv_heads)
    pool_tokens, rows, max_kv = 5000, 7, 300
    pool = torch.randn(pool_tokens, 2, kv_heads, dim, generator=gen).to(dtype)
    q = (3 * torch.randn(rows, heads, dim, generator=gen)).to(dtype)  # peaked softmaxes too
    kv_lens = torch.tensor([1, 2, 17, 300, 64, 150, 299])
    kv_indices = torch.randperm(pool_tokens, generator=gen)[: rows * max_kv].view(rows, max_kv)
    got = kernel(q, pool, kv_indices, kv_lens, dim**-0.5)
    want = _reference(q, pool, kv_indices, kv_lens)
    assert got.dtype == dtype and got.shape == q.shape
    # float32 accumulates in float32; the others round their output to 8 or 11 mantissa bits.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_kernel_takes_non_contiguous_queries(kernel):
    """The model hands it q sliced out of the fused q/k rotary output."""
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(100, 2, 3, 64, generator=gen).to(torch.bfloat16)
    qk = torch.randn(4, 12, 64, generator=gen).to(torch.bfloat16)
    q = qk[:, :9]
    kv_indices = torch.arange(4 * 20).view(4, 20)
    kv_lens = torch.tensor([20, 5, 1, 11])
    got = kernel(q, pool, kv_indices, kv_lens, 64**-0.5)
    torch.testing.assert_close(got.double(), _reference(q, pool, kv_indices, kv_lens), atol=1e-2, rtol=1e-2)


def test_kernel_rejects_mismatched_shapes(kernel):
    pool = torch.zeros(10, 2, 3, 64)
    with pytest.raises(RuntimeError, match="one index row per query row"):
        kernel(torch.zeros(2, 9, 64), pool, torch.zeros(3, 4, dtype=torch.int64), torch.ones(2, dtype=torch.int64), 1.0)
    with pytest.raises(RuntimeError, match="kv_rows: one int64 index row per query row"):
        rows = torch.zeros(3, dtype=torch.int64)
        kernel(
            torch.zeros(2, 9, 64),
            pool,
            torch.zeros(1, 4, dtype=torch.int64),
            torch.ones(2, dtype=torch.int64),
            1.0,
            0,
            rows,
        )


@pytest.mark.parametrize("dim, heads, kv_heads, window", [(64, 9, 3, 0), (256, 4, 1, 5), (128, 8, 8, 0)])
def test_a_querys_output_is_the_same_bits_whatever_the_other_rows_of_the_call(kernel, dim, heads, kv_heads, window):
    """Batch invariance rests on it: every token of a prompt chunk is its own query row over
    its sequence's one row of indices (kv_rows), and its output must equal what the same
    query gives decoded alone, or in a call with any other rows."""
    gen = torch.Generator().manual_seed(dim + heads)
    pool = torch.randn(400, 2, kv_heads, dim, generator=gen).to(torch.bfloat16)
    table = torch.randperm(400, generator=gen)[:300].view(2, 150)
    q = torch.randn(150, heads, dim, generator=gen).to(torch.bfloat16)
    # A 100-token chunk of sequence 0 (positions 20..119) and 50 queries of sequence 1.
    kv_rows = torch.cat([torch.zeros(100, dtype=torch.int64), torch.ones(50, dtype=torch.int64)])
    kv_lens = torch.cat([torch.arange(21, 121), torch.arange(100, 150)])
    together = kernel(q, pool, table, kv_lens, dim**-0.5, window, kv_rows)
    for t in (0, 37, 99, 100, 149):
        alone = kernel(q[t : t + 1], pool, table[kv_rows[t]][None], kv_lens[t : t + 1], dim**-0.5, window)
        assert torch.equal(together[t], alone[0]), t
    repeated = kernel(q, pool, table[kv_rows], kv_lens, dim**-0.5, window)
    assert torch.equal(together, repeated)


@pytest.mark.parametrize(
    "dtype, dim, heads, kv_heads",
    [
        (torch.bfloat16, 64, 9, 3),  # the fast path at each head dim
        (torch.bfloat16, 128, 8, 2),
        (torch.bfloat16, 256, 4, 1),  # Gemma 3's shape
        (torch.float32, 128, 8, 2),  # the generic loop
    ],
)
@pytest.mark.parametrize("window", [1, 16, 512])
def test_kernel_with_a_window_attends_to_each_rows_last_window_keys(kernel, dtype, dim, heads, kv_heads, window):
    """A sliding window (Mistral, Gemma 3's local layers): rows shorter and longer than it."""
    gen = torch.Generator().manual_seed(dim + window)
    pool_tokens, rows, max_kv = 3000, 5, 300
    pool = torch.randn(pool_tokens, 2, kv_heads, dim, generator=gen).to(dtype)
    q = (3 * torch.randn(rows, heads, dim, generator=gen)).to(dtype)
    kv_lens = torch.tensor([1, 16, 17, 300, 150])
    kv_indices = torch.randperm(pool_tokens, generator=gen)[: rows * max_kv].view(rows, max_kv)
    got = kernel(q, pool, kv_indices, kv_lens, dim**-0.5, window)
    want = _reference(q, pool, kv_indices, kv_lens, window)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    if window < 300:  # the window changes the answer of the longest row
        assert not torch.allclose(got.double()[3], _reference(q, pool, kv_indices, kv_lens)[3], atol=tol, rtol=tol)
