"""Linear layers with oneDNN-packed weights (`--linear-weights`): in bf16 the same bits as
`F.linear`, in float32 within float32 rounding, the same inside a compiled graph, and a
whole model with packed weights predicts what it does with plain ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.cpu_kernels import load_small_batch_linear
from gpu_worker.model import LlamaForCausalLM
from gpu_worker.packed_linear import PackedLinear, replace_linear_layers, wants_packed_linear
from tests.helpers import make_random_llama, prompt_logits

needs_onednn_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no bf16 instructions for oneDNN"
)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_bf16_linear_gives_the_same_bits_as_f_linear(rows):
    w, b = torch.randn(160, 96, dtype=torch.bfloat16), torch.randn(160, dtype=torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    assert torch.equal(PackedLinear(w, b)(x), F.linear(x, w, b))
    assert torch.equal(PackedLinear(w, None)(x.view(1, rows, 96)), F.linear(x, w).view(1, rows, 160))


needs_small_batch_linear = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512", reason="small_batch_linear is built for AVX-512 only"
)


def _bf16_linear_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_small_batch_linear
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n, k, with_bias", [(576, 576, False), (37, 100, True), (3, 1536, False)])
def test_small_batch_linear_is_the_float32_sum_rounded_once(rows, n, k, with_bias):
    op = load_small_batch_linear()
    w, x = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(rows, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    out = op(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    want = _bf16_linear_reference(x, w, b)
    # One rounding to bf16 (relative 2^-9) on top of a float32 sum.
    torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=1e-4 * k**0.5)


@needs_small_batch_linear
def test_packed_linear_sends_up_to_two_rows_to_the_small_batch_op_and_more_to_onednn():
    op = load_small_batch_linear()
    w, b = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    layer = PackedLinear(w, b, op)
    for rows in (1, 2, 3, 33):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(layer(x).double(), _bf16_linear_reference(x, w, b), rtol=2**-8, atol=1e-3)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), op(x, w, b))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, w, b))


@needs_small_batch_linear
def test_compiled_graphs_use_the_small_batch_op_for_a_lone_row_and_onednn_for_a_symbolic_batch():
    op = load_small_batch_linear()
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    layer = PackedLinear(w, None, op)
    compiled = torch.compile(lambda layer, x: torch.relu(layer(x)), dynamic=True)
    with torch.inference_mode():
        lone = torch.randn(1, 32, dtype=torch.bfloat16)
        assert torch.equal(compiled(layer, lone), torch.relu(op(lone, w, None)))
        for rows in (3, 9, 40):
            x = torch.randn(rows, 32, dtype=torch.bfloat16)
            assert torch.equal(compiled(layer, x), torch.relu(F.linear(x, w)))


def test_packed_float32_linear_is_within_float32_rounding_of_f_linear():
    w, b, x = torch.randn(160, 96), torch.randn(160), torch.randn(2, 9, 96)
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_a_compiled_graph_calls_the_packed_linear_for_every_batch_size():
    layers = [PackedLinear(torch.randn(48, 32), torch.randn(48)) for _ in range(2)]
    compiled = torch.compile(lambda layer, x: torch.relu(layer(x)), dynamic=True)
    with torch.inference_mode():
        for rows in (3, 8, 21):
            for layer in layers:
                x = torch.randn(rows, 32)
                torch.testing.assert_close(compiled(layer, x), torch.relu(layer(x)))


def test_replace_linear_layers_swaps_every_nested_linear_and_keeps_the_rest():
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(16, 4)))
    x = torch.randn(5, 8)
    want = block(x)
    assert replace_linear_layers(block, PackedLinear) == 2
    assert isinstance(block[0], PackedLinear) and isinstance(block[2][0], PackedLinear)
    assert isinstance(block[1], torch.nn.ReLU)
    torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


def test_auto_packs_on_cpu_only_and_packed_on_cuda_is_a_clear_error():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert wants_packed_linear("auto", cpu, torch.float32)
    assert not wants_packed_linear("plain", cpu, torch.float32)
    assert not wants_packed_linear("auto", cpu, torch.float16)
    assert not wants_packed_linear("auto", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="--device cpu"):
        wants_packed_linear("packed", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        wants_packed_linear("packed", cpu, torch.float16)


@needs_onednn_bf16
def test_a_model_with_packed_weights_predicts_the_same_bf16_logits_as_with_plain_ones(tmp_path):
    path = make_random_llama(str(tmp_path / "model"), seed=5)
    ids = torch.arange(3, 40)
    plain = prompt_logits(path, ids, torch.bfloat16)
    assert torch.equal(prompt_logits(path, ids, torch.bfloat16, LlamaForCausalLM.pack_linear_weights), plain)
