"""Linear layers with oneDNN-packed weights (`--linear-weights`): in bf16 the same bits as
`F.linear`, in float32 within float32 rounding, the same inside a compiled graph, and a
whole model with packed weights predicts what it does with plain ones. Our own bf16
kernels (AVX512-BF16 VNNI, AVX2 widening) give the float32 sum rounded once, a row's
result does not depend on its batch, and a model using them predicts the plain logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels.cpu_kernels import load_vnni_linear, load_widening_bf16_linear
from gpu_worker.layers.linear_plan import (
    every_bf16_kernel,
    every_linear,
    own_kernel_linear,
    replace_linear_layers,
    wants_packed_linear,
)
from gpu_worker.layers.packed_linear import Bf16KernelLinear, PackedLinear
from gpu_worker.model.decoder import LlamaForCausalLM
from tests.helpers import make_random_llama, prompt_logits

pytestmark = pytest.mark.usefixtures("worker_threads")  # the kernels' split across threads is checked too

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


VNNI = load_vnni_linear()
needs_vnni_linear = pytest.mark.skipif(
    VNNI is None, reason="vnni_linear needs an AVX-512 build on a CPU with AVX512-BF16"
)


def _bf16_linear_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _vnni(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return VNNI.linear(x, VNNI.pack(w), b, w.shape[0])


@needs_vnni_linear
def test_vnni_linear_gives_a_row_the_same_bits_whatever_batch_it_is_in():
    w, x = torch.randn(200, 96, dtype=torch.bfloat16), torch.randn(40, 96, dtype=torch.bfloat16)
    packed = VNNI.pack(w)
    whole = VNNI.linear(x, packed, None, 200)
    for row in (0, 11, 12, 39):
        assert torch.equal(VNNI.linear(x[row : row + 1], packed, None, 200)[0], whole[row])
    assert torch.equal(VNNI.linear(x[5:30], packed, None, 200), whole[5:30])


@needs_vnni_linear
def test_vnni_pack_refuses_an_odd_input_width_and_packed_linear_then_keeps_onednn():
    w = torch.randn(16, 7, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="k must be even"):
        VNNI.pack(w)
    layer = PackedLinear(w, None, VNNI)
    x = torch.randn(3, 7, dtype=torch.bfloat16)
    assert layer.vnni is None and torch.equal(layer(x), F.linear(x, w))


@needs_vnni_linear
def test_packed_linear_sends_decode_batches_to_the_vnni_kernel_and_larger_ones_to_onednn():
    w, b = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    layer = PackedLinear(w, b, VNNI)
    for rows in (1, 2, 33, PackedLinear.VNNI_MAX_ROWS):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(layer(x), _vnni(x, w, b))
        assert torch.equal(layer(x.view(1, rows, 64)), _vnni(x, w, b).view(1, rows, 96))
    for rows in (PackedLinear.VNNI_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, w, b))


@needs_vnni_linear
def test_compiled_graphs_use_the_vnni_kernel_for_every_batch_size():
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    layer = PackedLinear(w, None, VNNI)
    compiled = torch.compile(lambda layer, x: torch.relu(layer(x)), dynamic=True)
    with torch.inference_mode():
        for rows in (1, 3, 40, 100):
            x = torch.randn(rows, 32, dtype=torch.bfloat16)
            assert torch.equal(compiled(layer, x), torch.relu(_vnni(x, w)))


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
    assert torch.equal(prompt_logits(path, ids, torch.bfloat16, every_linear(PackedLinear)), plain)


BF16_UNIT_ROUNDOFF = 2.0**-8
"""u: bf16 keeps 8 significant bits, so rounding to nearest moves a value by at most u of it."""

ROUNDINGS_PER_LAYER = 18
"""bf16 roundings on a LLaMA layer's longest path, an upper count: input norm (normalised,
then scaled: 2), qkv (1), rotary (x*cos, rotated*sin, their sum: 3), attention (scores,
probabilities, their weighted sum: 3), o_proj (1), residual add (1), post-attention norm
(2), gate/up (1), activation and product (2), down (1), residual add (1)."""


def _round_weights_to_bf16(model: LlamaForCausalLM) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))


def _exact_logits_and_head_sums(path: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 model's logits on the bf16-rounded weights, and S_j = sum_k |h_k| |W_jk|
    for each (h: the LM head's input, the final norm's output; W: the head)."""
    seen: dict[str, torch.Tensor] = {}

    def round_and_watch(model: LlamaForCausalLM) -> None:
        _round_weights_to_bf16(model)
        seen["head"] = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.norm.register_forward_hook(lambda module, args, out: seen.__setitem__("h", out))

    logits = prompt_logits(path, ids, torch.float64, round_and_watch)
    return logits, seen["h"].abs() @ seen["head"].abs().T


@needs_vnni_linear
def test_a_model_whose_decode_batches_take_the_vnni_kernel_predicts_the_logits_of_plain_weights(tmp_path):
    """Both bf16 paths, oneDNN's (AMX or AVX512-BF16, as the CPU has) and ours for decode
    batches (the 37-row prompt runs through the VNNI kernel), are held to the same bound
    around the float64 model on the same bf16-rounded weights, a bound from the arithmetic:

    - each linear sums in float32 and rounds once to bf16 (the kernel tests above prove ours
      does); K * 2^-24 of float32 summation is negligible next to u = 2^-8 at these widths;
    - the longest path from the embedding to a logit has c = layers * ROUNDINGS_PER_LAYER +
      3 roundings (the final norm's two, the head's one), each moving its value by at most u
      of it;
    - to first order, normalisation and the residual stream carry a relative error through
      in scale, and the head carries its input's to logit j in proportion to
      S_j = sum_k |h_k| |W_jk| (h: the final norm's float64 output, W: the head);
    - so, all errors aligned, |logit_j - exact_j| <= c * u * S_j; and with rounding errors
      independent and uniform in [-u, u] of their values (variance u^2 / 3 each), the root
      mean square of (logit_j - exact_j) / (u * S_j) over all logits is at most sqrt(c / 3).

    Where the top two float64 logits are closer than their bounds, the arithmetic does not
    fix the argmax, so it is not compared (at this seed, every position is such a case)."""
    layers = 2
    path = make_random_llama(str(tmp_path / "model"), layers=layers, seed=5)
    ids = torch.arange(3, 40)
    exact, head_sums = _exact_logits_and_head_sums(path, ids)
    roundings = layers * ROUNDINGS_PER_LAYER + 3
    plain = prompt_logits(path, ids, torch.bfloat16)
    with_vnni = prompt_logits(
        path, ids, torch.bfloat16, every_linear(lambda weight, bias: PackedLinear(weight, bias, VNNI))
    )
    for logits in (plain, with_vnni):
        error = (logits.double() - exact).abs() / (BF16_UNIT_ROUNDOFF * head_sums)
        assert error.max() <= roundings
        assert error.pow(2).mean().sqrt() <= (roundings / 3) ** 0.5


WIDENING = load_widening_bf16_linear()
needs_widening_linear = pytest.mark.skipif(WIDENING is None, reason="widening_bf16_linear needs an x86 CPU with AVX2")


@pytest.mark.parametrize("kernel", ["vnni", "widening"])
@pytest.mark.parametrize("rows", [1, 3, 5, 32, 200])
@pytest.mark.parametrize("n, k, with_bias", [(576, 576, False), (37, 100, True), (3, 1536, False), (100, 2, True)])
def test_our_bf16_kernels_give_the_float32_sum_rounded_once(kernel, rows, n, k, with_bias):
    ours = {"vnni": VNNI, "widening": WIDENING}[kernel]
    if ours is None:
        pytest.skip(f"this CPU cannot run the {kernel} kernel")
    w, x = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(rows, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    out = ours.linear(x, ours.pack(w), b, n)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # One rounding to bf16 (relative 2^-9) on top of a float32 sum.
    torch.testing.assert_close(out.double(), _bf16_linear_reference(x, w, b), rtol=2**-8, atol=1e-4 * k**0.5)


@needs_widening_linear
def test_widening_linear_gives_a_row_the_same_bits_whatever_batch_it_is_in():
    layer = Bf16KernelLinear(torch.randn(200, 96, dtype=torch.bfloat16), None, WIDENING)
    x = torch.randn(250, 96, dtype=torch.bfloat16)  # past one 96-row block of prefill rows
    whole = layer(x)
    for row in (0, 5, 6, 95, 96, 249):
        assert torch.equal(layer(x[row : row + 1])[0], whole[row])
    assert torch.equal(layer(x[7:130].view(1, 123, 96)), whole[7:130].view(1, 123, 200))


@needs_widening_linear
def test_compiled_graphs_call_the_widening_kernel_for_every_batch_size():
    layer = Bf16KernelLinear(torch.randn(48, 32, dtype=torch.bfloat16), None, WIDENING)
    compiled = torch.compile(lambda layer, x: torch.relu(layer(x)), dynamic=True)
    with torch.inference_mode():
        for rows in (1, 3, 40, 100):
            x = torch.randn(rows, 32, dtype=torch.bfloat16)
            assert torch.equal(compiled(layer, x), torch.relu(layer(x)))


def test_auto_takes_our_bf16_kernel_for_batch_invariance_or_where_onednn_has_no_bf16_matmul():
    cpu = torch.device("cpu")
    no_bf16_instructions = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert own_kernel_linear("auto", cpu, torch.bfloat16, batch_invariant=True)
    assert own_kernel_linear("auto", cpu, torch.bfloat16, batch_invariant=False) == no_bf16_instructions
    assert not own_kernel_linear("auto", cpu, torch.float32, batch_invariant=True)
    assert not own_kernel_linear("plain", cpu, torch.bfloat16, batch_invariant=True)
    assert not own_kernel_linear("auto", torch.device("cuda"), torch.bfloat16, batch_invariant=True)


@needs_widening_linear
def test_a_model_with_widened_bf16_weights_is_as_close_to_float32_as_with_plain_ones(tmp_path):
    path = make_random_llama(str(tmp_path / "model"), seed=5)
    ids = torch.arange(3, 40)
    want = prompt_logits(path, ids, torch.float32).double()
    plain = prompt_logits(path, ids, torch.bfloat16).double()
    widened = prompt_logits(path, ids, torch.bfloat16, every_bf16_kernel(WIDENING)).double()
    # Another float32 summation order than torch's bf16 matmul, so not the same bits; the
    # error that bf16 rounding through the layers leaves must be no larger.
    plain_error, widened_error = (plain - want).abs(), (widened - want).abs()
    assert widened_error.mean() <= 1.1 * plain_error.mean()
    assert widened_error.max() <= 1.25 * plain_error.max()
    assert torch.equal(widened.argmax(-1), plain.argmax(-1))
