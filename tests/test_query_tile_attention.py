"""The query-tile attention kernel (gpu_worker/kernels/csrc/query_tile_attention.cpp): the path
paged_decode_attention takes for a prompt chunk's queries (given kv_rows). Each query's output
must be the same bits as the decode kernel's for it (a resumed request re-prefills the tokens
it had decoded, then decodes on from them), and within bf16's rounding of float64 attention."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_decode_attention as load
from tests.test_paged_decode_kernel import _reference

pytestmark = pytest.mark.usefixtures("worker_threads")  # the kernels' split across threads is checked too


@pytest.fixture(scope="module")
def kernel():
    op = load()
    assert op is not None, "the paged decode attention kernel did not build (see the log)"
    return op


def _chunks(gen: torch.Generator, pieces: list[tuple[int, int, int]], pool_tokens: int, max_kv: int):
    """(index table, kv_rows, kv_lens) for chunks (sequence, first position, tokens); each
    sequence's keys are scattered over the pool."""
    sequences = 1 + max(s for s, _, _ in pieces)
    table = torch.randperm(pool_tokens, generator=gen)[: sequences * max_kv].view(sequences, max_kv)
    kv_rows = torch.cat([torch.full((n,), s, dtype=torch.int64) for s, _, n in pieces])
    kv_lens = torch.cat([torch.arange(first + 1, first + n + 1) for _, first, n in pieces])
    return table, kv_rows, kv_lens


@pytest.mark.parametrize(
    "dim, heads, kv_heads",
    [(64, 32, 8), (64, 9, 3), (64, 8, 8), (64, 4, 2), (128, 16, 2), (128, 8, 8), (128, 32, 8), (64, 10, 2)],
)
@pytest.mark.parametrize("window", [0, 5, 40])
def test_each_query_of_a_prompt_chunk_is_the_same_bits_as_decoded_alone(kernel, dim, heads, kv_heads, window):
    """Chunks of several lengths and offsets (tiles cut ragged), two sequences interleaved with
    single decode rows, and a chunk starting at position 0: against the decode kernel's rows."""
    gen = torch.Generator().manual_seed(dim * heads + kv_heads + window)
    pieces = [(0, 0, 37), (1, 130, 1), (2, 5, 70), (1, 131, 1), (0, 37, 19), (3, 200, 3)]
    table, kv_rows, kv_lens = _chunks(gen, pieces, 2000, 260)
    pool = torch.randn(2000, 2, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = (3 * torch.randn(kv_rows.numel(), heads, dim, generator=gen)).to(torch.bfloat16)
    tiled = kernel(q, pool, table, kv_lens, dim**-0.5, window, kv_rows)
    decoded = kernel(q, pool, table[kv_rows], kv_lens, dim**-0.5, window)  # one query per row
    assert torch.equal(tiled, decoded)
    for t in (0, 36, 37, 110, kv_rows.numel() - 1):
        alone = kernel(q[t : t + 1], pool, table[kv_rows[t]][None], kv_lens[t : t + 1], dim**-0.5, window)
        assert torch.equal(tiled[t], alone[0]), t


@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 32, 8), (128, 8, 2)])
def test_a_long_prompt_chunk_equals_float64_attention(kernel, dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(dim)
    table, kv_rows, kv_lens = _chunks(gen, [(0, 600, 150)], 3000, 750)
    pool = torch.randn(3000, 2, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = (3 * torch.randn(kv_rows.numel(), heads, dim, generator=gen)).to(torch.bfloat16)
    got = kernel(q, pool, table, kv_lens, dim**-0.5, 0, kv_rows)
    torch.testing.assert_close(got.double(), _reference(q, pool, table[kv_rows], kv_lens), atol=1e-2, rtol=1e-2)
