"""One function chooses every linear layer's kind at load and says why (gpu_worker/layers/linear_plan.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import (
    load_amx_linear,
    load_fused_moe,
    load_quant_linear,
    load_vnni_linear,
    load_widening_bf16_linear,
)
from gpu_worker.layers.fused_moe import fused_moe_available
from gpu_worker.layers.linear_plan import LinearPlan, choose_experts, choose_linear
from gpu_worker.layers.packed_linear import Bf16KernelLinear, PackedLinear
from tests.helpers import make_random_llama, prompt_logits

CPU = torch.device("cpu")
LINEAR_KINDS = (torch.nn.Linear, PackedLinear, Bf16KernelLinear)


def linear_kinds_installed(plan: LinearPlan, dtype: torch.dtype, tmp_path) -> set[type]:
    """The classes of a small model's linear layers and LM head once `plan` is installed."""
    kinds: set[type] = set()

    def install(model) -> None:
        plan.install(model)
        kinds.update(type(m) for m in [*model.layers.modules(), model.lm_head] if isinstance(m, LINEAR_KINDS))

    prompt_logits(make_random_llama(str(tmp_path / "model"), seed=5), torch.arange(3, 9), dtype, install)
    return kinds


def test_the_weight_format_decides_before_the_linear_setting():
    gguf = choose_linear("packed", "gguf", CPU, torch.bfloat16, batch_invariant=True)
    assert gguf.kind == f"gguf-{load_quant_linear().replace('_', '-') or 'torch'}", "named by its kernel path"
    int8 = choose_linear("packed", "int8", CPU, torch.bfloat16, batch_invariant=True)
    assert int8.kind == "int8" and "--weight-dtype int8" in int8.reason


def test_plain_is_chosen_by_the_flag_or_off_the_cpu_and_says_so():
    flag = choose_linear("plain", "bf16", CPU, torch.float32, batch_invariant=False)
    assert flag.kind == "plain" and flag.reason == "--linear-weights plain" and flag.breaks_batch_invariance is None
    gpu = choose_linear("auto", "bf16", torch.device("cuda"), torch.bfloat16, batch_invariant=False)
    assert gpu.kind == "plain" and "cuda" in gpu.reason
    with pytest.raises(ValueError, match="--device cpu"):
        choose_linear("packed", "bf16", torch.device("cuda"), torch.bfloat16, batch_invariant=False)


def _best_bf16_kernel() -> tuple[str, str]:
    """(kind, the name the reason gives) of the bf16 kernel this CPU takes first."""
    if load_amx_linear() is not None:
        return "amx-bf16", "AMX-BF16"
    if load_vnni_linear() is not None:
        return "avx512-bf16", "AVX512-BF16"
    return "avx2-bf16", "AVX2"


@pytest.mark.skipif(load_widening_bf16_linear() is None, reason="our bf16 kernels need an x86 CPU with AVX2")
def test_batch_invariance_in_bf16_takes_our_kernel_for_every_layer_and_the_head(tmp_path):
    plan = choose_linear("auto", "bf16", CPU, torch.bfloat16, batch_invariant=True)
    kind, kernel = _best_bf16_kernel()
    assert plan.kind == kind and kernel in plan.reason and "summation order" in plan.reason
    assert plan.breaks_batch_invariance is None
    assert linear_kinds_installed(plan, torch.bfloat16, tmp_path) == {Bf16KernelLinear}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packing is oneDNN's")
def test_float32_on_cpu_packs_every_layer_and_the_head_for_onednn(tmp_path):
    plan = choose_linear("auto", "bf16", CPU, torch.float32, batch_invariant=False)
    assert plan.kind == "packed" and "oneDNN" in plan.reason
    assert linear_kinds_installed(plan, torch.float32, tmp_path) == {PackedLinear}


@pytest.mark.skipif(
    load_amx_linear() is None, reason="this CPU lacks AMX-TILE and AMX-BF16 (or the OS does not grant the tile state)"
)
def test_a_cpu_with_amx_takes_the_amx_kernel_with_batch_invariance_off_too(tmp_path):
    plan = choose_linear("auto", "bf16", CPU, torch.bfloat16, batch_invariant=False)
    assert plan.kind == "amx-bf16" and plan.breaks_batch_invariance is None
    assert linear_kinds_installed(plan, torch.bfloat16, tmp_path) == {Bf16KernelLinear}
    assert choose_linear("packed", "bf16", CPU, torch.bfloat16, batch_invariant=False).kind == "packed"


def test_experts_keep_their_own_linear_layers_wherever_the_fused_op_does_not_apply_and_say_why():
    assert "int8" in choose_experts("int8", CPU, torch.bfloat16).reason
    assert "cuda" in choose_experts("gguf", torch.device("cuda"), torch.bfloat16).reason
    assert choose_experts("bf16", CPU, torch.float32).kind == "torch"
    assert "cuda" in choose_experts("bf16", torch.device("cuda"), torch.bfloat16).reason


@pytest.mark.skipif(not load_quant_linear(), reason="the quantized kernels do not run on this CPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_ggufs_quantized_experts_on_cpu_take_the_fused_op_for_them_in_quant_linears_path(dtype):
    plan = choose_experts("gguf", CPU, dtype)
    assert plan.kind == f"fused-gguf-{load_quant_linear().replace('_', '-')}" and "GGUF" in plan.reason


@pytest.mark.skipif(not fused_moe_available(), reason="the fused MoE op's kernels do not build on this CPU")
def test_bf16_experts_on_cpu_take_the_fused_op_in_its_best_path():
    plan = choose_experts("bf16", CPU, torch.bfloat16)
    assert plan.kind == f"fused-{load_fused_moe().replace('_', '-')}" and "fused op" in plan.reason
