"""The C++ RMSNorm (csrc/rms_norm.cpp) computes what the torch ops of model.RMSNorm do, in
the reference's order, for every dtype and any number of rows."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.cpu_kernels import load_rms_norm
from gpu_worker.model import RMSNorm


@pytest.fixture(scope="module")
def rms_norm_op():
    op = load_rms_norm()
    assert op is not None, "the C++ kernels did not build (see the log)"
    return op


def _torch_norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(dim, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim).to(dtype))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (3, 5, 64), (2, 100)])
def test_the_rms_norm_op_matches_the_torch_ops_of_the_reference_order(rms_norm_op, dtype, shape):
    norm = _torch_norm(shape[-1], dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    got, want = rms_norm_op(x, norm.weight, norm.eps), norm(x)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # The float32 sum of squares may differ in its last bit; after two roundings to the
        # dtype at most one step of it apart, and almost everywhere the same bits.
        step = torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * step, atol=1e-6)
        assert (got == want).float().mean() >= 0.99


def test_a_model_norm_uses_the_op_when_given_and_torch_ops_when_compiled(rms_norm_op):
    norm = _torch_norm(64, torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    torch_result = norm(x)
    norm.kernel = rms_norm_op
    assert torch.equal(norm(x), rms_norm_op(x, norm.weight, norm.eps))
    compiled = torch.compile(norm)
    torch.testing.assert_close(compiled(x).float(), torch_result.float(), rtol=1e-2, atol=1e-2)
