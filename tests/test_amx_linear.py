"""The bf16 linear on AMX tiles (csrc/amx_linear.cpp): within the arithmetic's rounding of a
float64 reference, and a row's bits independent of how many rows share its call, of its
position among them and of the number of threads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_amx_linear

AMX = load_amx_linear()
needs_amx = pytest.mark.skipif(
    AMX is None, reason="this CPU lacks AMX-TILE and AMX-BF16 (or the OS does not grant AMX's tile state)"
)
pytestmark = needs_amx

# (out, in): a multiple of the kernel's blocks, a ragged one on both axes, and a width under one k-chunk.
SHAPES = [(96, 128), (100, 70), (3, 40)]


def _error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, reference: torch.Tensor) -> torch.Tensor:
    """What the kernel's arithmetic allows: a product of two bf16 values is exact in float32,
    so the only errors are float32 additions (at most k of them for the products, one for the
    bias, each within 2^-24 of the running sum, which is at most sum |x w| + |b|) and the final
    rounding to bf16 (half a bf16 ulp: 2^-8 of the result)."""
    magnitude = x.double().abs() @ w.double().abs().T
    if b is not None:
        magnitude = magnitude + b.double().abs()
    additions = x.shape[1] + 1
    return additions * 2.0**-24 * magnitude * (1 + 2.0**-8) + 2.0**-8 * reference.abs()


def _on_threads(threads: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """fn() computed on `threads` threads."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return fn()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_amx_linear_is_within_the_arithmetics_rounding_of_a_float64_reference(shape, with_bias):
    n, k = shape
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(37, k, dtype=torch.bfloat16)
    y = AMX.linear(x, AMX.pack(w), b, n)
    reference = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.dtype == torch.bfloat16 and y.shape == (37, n)
    assert ((y.double() - reference).abs() <= _error_bound(x, w, b, reference)).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_amx_linear_gives_a_row_the_same_bits_in_batches_of_1_to_80_rows(shape, worker_threads):
    n, k = shape
    w, b = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    packed = AMX.pack(w)
    x = torch.randn(80, k, dtype=torch.bfloat16)
    whole = AMX.linear(x, packed, b, n)
    for rows in range(1, 81):
        assert torch.equal(AMX.linear(x[:rows], packed, b, n), whole[:rows]), rows
    for start in (1, 15, 16, 17, 31, 33, 79):  # every position in and across tiles
        assert torch.equal(AMX.linear(x[start:], packed, b, n), whole[start:]), start


def test_amx_linear_gives_the_same_bits_on_one_thread_and_on_several_and_past_one_pass():
    """Also 600 rows: more than one pass over the weights (the kernel's 256-row passes)."""
    w = torch.randn(200, 64, dtype=torch.bfloat16)
    packed = AMX.pack(w)
    x = torch.randn(600, 64, dtype=torch.bfloat16)
    alone = _on_threads(1, lambda: AMX.linear(x, packed, None, 200))
    together = _on_threads(max(2, torch.get_num_threads()), lambda: AMX.linear(x, packed, None, 200))
    assert torch.equal(alone, together)
    assert torch.equal(AMX.linear(x[599:], packed, None, 200), alone[599:])
    assert torch.equal(AMX.linear(x[250:300], packed, None, 200), alone[250:300])


def test_amx_linear_gives_the_same_bits_when_a_wide_input_is_summed_in_several_k_spans():
    """300 rows of 2,080 features: the first pass's 256 rows take the k-chunks in two spans (the
    float32 sums wait in memory in between); a few rows take them in one."""
    w, b = torch.randn(40, 2080, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    packed = AMX.pack(w)
    x = torch.randn(300, 2080, dtype=torch.bfloat16)
    whole = AMX.linear(x, packed, b, 40)
    for start in (0, 17, 255, 299):
        assert torch.equal(AMX.linear(x[start : start + 1], packed, b, 40), whole[start : start + 1]), start
    reference = x.double() @ w.double().T + b.double()
    assert ((whole.double() - reference).abs() <= _error_bound(x, w, b, reference)).all()


@pytest.mark.parametrize("k", [8010, 8200])
def test_amx_linear_gives_a_row_its_own_bits_when_33_to_64_rows_take_a_wide_input_in_sub_spans(k):
    """A down projection's width, ragged: at 33-64 rows the kernel sums k in short sub-spans for
    both row passes, the float32 sums waiting in memory in between. 8,010 features: one span,
    whose last sub-span is shorter than the others; 8,200: two spans (the sums also wait between
    them), the first in sub-spans. Each row's bits are those it gets alone (one pass, one span,
    no sub-spans), wherever it sits in the batch, on one thread or two."""
    n = 40
    w, b = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    packed = AMX.pack(w)
    x = torch.randn(80, k, dtype=torch.bfloat16)
    alone = torch.cat([AMX.linear(x[r : r + 1], packed, b, n) for r in range(80)])
    for rows in range(33, 65):
        assert torch.equal(AMX.linear(x[:rows], packed, b, n), alone[:rows]), rows
    for start in (1, 16, 31):
        assert torch.equal(AMX.linear(x[start : start + 49], packed, b, n), alone[start : start + 49]), start
    assert torch.equal(_on_threads(1, lambda: AMX.linear(x[:64], packed, b, n)), alone[:64])
    assert torch.equal(_on_threads(2, lambda: AMX.linear(x[:64], packed, b, n)), alone[:64])
    reference = x.double() @ w.double().T + b.double()
    assert ((alone.double() - reference).abs() <= _error_bound(x, w, b, reference)).all()


def test_amx_linear_gives_a_row_the_same_bits_in_a_prompt_chunk_of_2048_rows_on_1_and_2_threads():
    """2,048 rows of 2,080 features: eight 256-row passes, each taking k in two spans; a row's
    bits are those it gets alone, in slices that start and end inside a pass or across pass
    boundaries, and on one thread or two."""
    n, k = 72, 2080
    w, b = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    packed = AMX.pack(w)
    x = torch.randn(2048, k, dtype=torch.bfloat16)
    whole = _on_threads(1, lambda: AMX.linear(x, packed, b, n))
    assert torch.equal(_on_threads(2, lambda: AMX.linear(x, packed, b, n)), whole)
    for start, stop in ((0, 1), (255, 256), (256, 257), (2047, 2048), (200, 300), (250, 770), (17, 2048), (0, 1100)):
        assert torch.equal(AMX.linear(x[start:stop], packed, b, n), whole[start:stop]), (start, stop)
    reference = x.double() @ w.double().T + b.double()
    assert ((whole.double() - reference).abs() <= _error_bound(x, w, b, reference)).all()


def test_amx_linear_gives_the_same_bits_when_threads_claim_many_column_blocks_each():
    """4,096 outputs: 128 column blocks, several to a claim; each claim's last block prefetches
    the thread's next claim. Prefetching changes no sums."""
    n, k = 4096, 96
    w = torch.randn(n, k, dtype=torch.bfloat16)
    packed = AMX.pack(w)
    x = torch.randn(40, k, dtype=torch.bfloat16)
    alone = _on_threads(1, lambda: AMX.linear(x, packed, None, n))
    assert torch.equal(_on_threads(2, lambda: AMX.linear(x, packed, None, n)), alone)
    assert torch.equal(_on_threads(2, lambda: AMX.linear(x[39:], packed, None, n)), alone[39:])


def test_amx_linear_of_no_rows_is_empty_and_a_mismatched_width_is_a_clear_error():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    packed = AMX.pack(w)
    assert AMX.linear(torch.empty(0, 64, dtype=torch.bfloat16), packed, None, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="features"):
        AMX.linear(torch.randn(2, 96, dtype=torch.bfloat16), packed, None, 32)
