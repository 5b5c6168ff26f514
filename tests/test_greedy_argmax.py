"""The C++ greedy argmax (csrc/greedy_argmax.cpp): the same token as torch's max(dim).indices
for bf16 logits, ties, infinities and NaNs included, and the sampling table using it for
bf16 logits only."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_greedy_argmax
from gpu_worker.runtime.sampler import SamplingTable

pytestmark = pytest.mark.usefixtures("worker_threads")  # the kernels' split across threads is checked too

ARGMAX = load_greedy_argmax()
needs_kernel = pytest.mark.skipif(ARGMAX is None, reason="the C++ kernels cannot be built here")


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 5, 16, 37, 49152])
def test_greedy_argmax_picks_torch_max_index_on_ties_infinities_and_nans(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen).to(torch.bfloat16)
    logits[1, vocab - 1] = logits[1].max()  # a tie: the first index wins
    logits[1, 0] = logits[1].max()
    logits[2, :] = float("-inf")
    logits[3, vocab // 2] = float("inf")
    logits[4, vocab - 1] = float("nan")  # a NaN is the max, the first one wins
    logits[4, vocab // 3] = float("nan")
    logits[5, :] = 0.0
    logits[6, :] = -1.0
    logits[6, vocab // 2] = -0.0  # -0 == +0: the first of them wins
    logits[6, vocab - 1] = 0.0
    logits[7, :] = float("-inf")
    logits[7, vocab - 1] = -3.0e38  # the most negative finite values
    logits[7, vocab // 4] = -3.0e38
    assert torch.equal(ARGMAX(logits), logits.max(dim=-1).indices)


@needs_kernel
def test_greedy_argmax_refuses_other_dtypes_with_a_clear_error():
    with pytest.raises(RuntimeError, match="bfloat16 logits"):
        ARGMAX(torch.randn(2, 8))


@needs_kernel
def test_sampling_table_takes_the_kernel_for_bf16_logits_and_torch_for_float32():
    table = SamplingTable(4, 100, [0], torch.device("cpu"))
    calls = []
    table.bf16_argmax = lambda logits: calls.append(logits.dtype) or ARGMAX(logits)
    logits = torch.randn(3, 100)
    assert torch.equal(table.argmax(logits), logits.max(dim=-1).indices)
    assert torch.equal(table.argmax(logits.bfloat16()), logits.bfloat16().max(dim=-1).indices)
    assert calls == [torch.bfloat16]
