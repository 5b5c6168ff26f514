"""Mixture-of-experts GGUFs as llama.cpp ships them, against transformers' reading of the same files.

Random-weight Qwen3-MoE and Qwen2-MoE checkpoints (transformers' own classes,
tests/family_models.py) are written as `qwen3moe` and `qwen2moe` GGUFs with the gguf
package (and a Mixtral one as llama.cpp writes Mixtral, a `llama` with experts, in
float32): the experts stacked as llama.cpp stores them (`ffn_gate_exps`, `ffn_up_exps`
[experts, moe_intermediate, hidden], `ffn_down_exps`), Qwen2-MoE's shared expert
(`ffn_*_shexp`) and its gate (`ffn_gate_inp_shexp`, [hidden]), gate and up in Q4_0 and down
in Q8_0, the attention projections in Q8_0, the routers and norms in float32 as llama.cpp's
quantizer leaves them. The expert sizes are those transformers' GGUF reader assumes.

- Dequantized at load (`--weight-dtype bf16`, here in float32), the logits equal
  transformers' float32 model of the file to float32 rounding, and so do the greedy tokens.
- Served in the file's own formats (`--weight-dtype gguf`: int8 activations), the logits stay
  within bounds set just over what was measured, as tests/test_fast_path_vs_transformers.py
  does for the packaged GGUFs: with each expert a QuantLinear, and on the fused op for
  quantized experts (fused_moe_gguf.py), whose float32 logits are those bits.
"""

from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_elementwise_kernels, load_quant_linear
from gpu_worker.layers.fused_moe_gguf import FusedQuantMoE
from gpu_worker.layers.linear_plan import fused_quantized_experts
from gpu_worker.layers.quant_linear import QuantLinear
from gpu_worker.model.model_check import check_model
from tests.family_models import QUANTIZED_ARCHS, make_family_checkpoint, write_moe_gguf
from tests.helpers import prompt_logits

# The quantized path's bounds, set just over what was measured (48 positions each). A random
# model's top two logits are close (median gap 0.16), so the top-1 moves with any rounding;
# as tests/test_fast_path_vs_transformers.py does, it may move only where transformers' own
# top two are close. At most positions the int8 activations cost a few tenths of a logit;
# at one here they flip a router's near-tie, that token takes another expert, and its
# logits move by a few units (llama.cpp's int8 activations do the same).
TYPICAL_LOGIT_ERROR = 0.4
"""The 90th percentile of each position's largest logit error (measured 0.27 qwen3moe, 0.32
qwen2moe; the logits reach about 8)."""
LARGEST_LOGIT_ERROR = 4.0
"""Measured 3.10 (qwen3moe) and 2.37 (qwen2moe), at a position whose routing flips."""
LARGEST_MARGIN = 0.6
"""The largest reference top-2 gap where the top-1 differs (measured 0.48, 0.23)."""


GGUF_CHECKPOINTS = {"qwen3moe": "qwen3_moe_gguf", "qwen2moe": "qwen2_moe_gguf", "llama": "mixtral"}
"""GGUF arch -> the test checkpoint written as it (tests/family_models.py): llama.cpp writes
Mixtral as a `llama` with experts."""


@pytest.fixture(scope="module", params=list(GGUF_CHECKPOINTS))
def moe_gguf(request, tmp_path_factory) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(the GGUF, a prompt's ids, transformers' float32 logits of the file at every position)."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    checkpoint = make_family_checkpoint(str(tmp_path_factory.mktemp("ckpt")), GGUF_CHECKPOINTS[arch])
    path = write_moe_gguf(checkpoint, str(tmp_path_factory.mktemp("gguf") / f"{arch}.gguf"), arch)
    ids = torch.randint(100, 40000, (48,), generator=torch.Generator().manual_seed(3))
    if arch in QUANTIZED_ARCHS:
        directory, name = os.path.split(path)
        reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    else:
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return path, ids, reference(ids[None]).logits[0]


def test_the_launcher_accepts_the_stacked_experts_of_a_moe_gguf(moe_gguf):
    check_model(moe_gguf[0])


def test_a_moe_gguf_dequantized_at_load_equals_transformers(moe_gguf):
    path, ids, ref = moe_gguf
    ours = prompt_logits(path, ids, torch.float32)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (ours - ref).abs().max().item() < 1e-3


def test_a_moe_gguf_in_its_own_formats_is_within_int8_activations_of_transformers(moe_gguf):
    path, ids, ref = moe_gguf
    if not path.endswith(tuple(f"{arch}.gguf" for arch in QUANTIZED_ARCHS)):
        pytest.skip("a float32 file: nothing to serve quantized")
    models = []

    def on_our_kernels(model) -> None:  # SwiGLU and the norms on the C++ ops, as the worker runs them on CPU
        model.use_elementwise_kernels(load_elementwise_kernels())
        models.append(model)

    ours = prompt_logits(path, ids, torch.float32, quantized=True, prepare=on_our_kernels)
    expert = models[0].layers[0].mlp.experts[0]
    assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(expert.down_proj, QuantLinear)
    if load_quant_linear():
        fused = prompt_logits(
            path, ids, torch.float32, quantized=True, experts=fused_quantized_experts, prepare=on_our_kernels
        )
        assert isinstance(models[1].layers[0].mlp.experts.fused, FusedQuantMoE)
        assert torch.equal(fused, ours)
    errors = (ours - ref).abs().amax(dim=-1)
    differ = ours.argmax(-1) != ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1])[differ].max().item() if differ.any() else 0.0
    typical = errors.quantile(0.9).item()
    print(f"quantized MoE GGUF: 90th percentile error {typical:.3f}, largest {errors.max():.3f}, margin {margin:.3f}")
    assert typical <= TYPICAL_LOGIT_ERROR
    assert errors.max().item() <= LARGEST_LOGIT_ERROR
    assert margin <= LARGEST_MARGIN
