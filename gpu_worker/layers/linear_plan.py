"""Which linear layer the model's layers and LM head run on, chosen once at load, and why.

The model is built with plain `nn.Linear` layers, and the checkpoint is loaded into them;
`choose_linear` then reads the flags and the machine and returns a `LinearPlan`: the kind
that every linear layer and the LM head gets, a sentence saying why (the worker logs it),
and the step that installs it (`LinearPlan.install`). The kinds, first match wins:

- `gguf-amx-int8` / `gguf-avx512-vnni` / `gguf-avx2` / `gguf-torch`: a GGUF's own quantized
  formats (`--weight-dtype gguf`), QuantLinear (quant_linear.py) built from the parts the
  load kept aside (gguf_layers.py), on the kernel path the CPU has (csrc/quant_linear.cpp;
  the same bits on each); a mixture-of-experts router, float32 in the file, on our bf16
  kernel where there is one;
- `int8`: weight-only int8 (`--weight-dtype int8`, int8_weights.py);
- `amx-bf16`: our AMX kernel at every batch size (`Bf16KernelLinear` on csrc/amx_linear.cpp),
  in bf16 on a CPU with AMX-BF16 whether or not batch invariance is on: it keeps one
  summation order at every batch size and is the fastest bf16 linear such a CPU has;
- `avx512-bf16` / `avx2-bf16`: our own bf16 kernel at every batch size (`Bf16KernelLinear`,
  packed_linear.py), where batch invariance asks for one summation order or oneDNN has no
  fast bf16 matmul;
- `packed`: weights packed once for oneDNN (`PackedLinear`), with our VNNI kernel for
  decode batches in bf16 where the CPU has it;
- `plain`: `nn.Linear` as loaded.

Adding a kind is one more branch in `choose_linear` returning `LinearPlan(kind, reason,
every_linear(make))`, with `make(weight, bias)` building the new layer.

A mixture-of-experts model's routed experts get their path first (`choose_experts` ->
`ExpertsPlan`, installed before the linear plan's):
- `fused-amx` / `fused-avx512-bf16` / `fused-portable`: the fused C++ op (fused_moe.py) on
  CPU with bf16 weights, in the op's best path for the CPU; batch invariant, with or
  without batch invariance asked for;
- `fused-gguf-avx512-vnni` / `fused-gguf-avx2`: a GGUF's experts in their quantized formats
  on the fused op for them (fused_moe_gguf.py), on CPU, in quant_linear's path for the CPU;
  batch invariant as well (a layer whose experts it cannot take stays on `torch`, logged);
- `torch`: each expert's own linear layers (moe_experts.py), which the linear plan then
  swaps like any other: a GGUF's quantized formats, int8, float32, or a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from gpu_worker.kernels.cpu_kernels import (
    Bf16LinearKernel,
    load_amx_linear,
    load_fused_moe,
    load_quant_linear,
    load_vnni_linear,
    load_widening_bf16_linear,
)
from gpu_worker.layers.fused_moe import FusedMoE, fused_moe_available
from gpu_worker.layers.fused_moe_gguf import FusedQuantMoE, fused_quant_moe_path
from gpu_worker.layers.int8_weights import Int8Linear
from gpu_worker.layers.int8_weights import check_supported as check_int8_supported
from gpu_worker.layers.packed_linear import Bf16KernelLinear, PackedLinear

if TYPE_CHECKING:
    from gpu_worker.model.decoder import LlamaForCausalLM

logger = logging.getLogger(__name__)

MakeLinear = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
"""(weight, bias) of a loaded nn.Linear, cast to the model's dtype -> the layer that replaces it."""


def replace_linear_layers(module: nn.Module, make: MakeLinear) -> int:
    """Replaces every nn.Linear under `module` (weights already loaded and cast) by
    `make(weight, bias)`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child.weight.data, None if child.bias is None else child.bias.data))
            count += 1
        else:
            count += replace_linear_layers(child, make)
    return count


@dataclass(frozen=True)
class LinearPlan:
    """The linear layer kind of every layer and the LM head, why, and how to install it."""

    kind: str
    """"gguf-<quantized path>", "int8", "amx-bf16", "avx512-bf16", "avx2-bf16", "packed" or "plain"; the
    worker's ready line names it."""
    reason: str
    """Why this kind, in a sentence for the load log."""
    install: Callable[[LlamaForCausalLM], None]
    """Swaps the layers into a model whose weights are loaded and cast (a no-op for plain)."""
    breaks_batch_invariance: str | None = None
    """Why these layers leave batch invariance off (batch_invariance.py); None: they do not."""

    def describe(self) -> str:
        return f"{self.kind} ({self.reason})"


def every_linear(make: MakeLinear) -> Callable[[LlamaForCausalLM], None]:
    """An install step: `make(weight, bias)` for every linear layer and for the LM head."""
    return lambda model: model.replace_linear_layers(make)


def every_bf16_kernel(kernel: Bf16LinearKernel) -> Callable[[LlamaForCausalLM], None]:
    """An install step: every linear layer and the LM head on `kernel` (`Bf16KernelLinear`)."""
    return every_linear(lambda weight, bias: Bf16KernelLinear(weight, bias, kernel))


def install_quantized(router_kernel: Bf16LinearKernel | None) -> Callable[[LlamaForCausalLM], None]:
    """The install step of a GGUF's own formats: the parts load_weights kept aside, as
    QuantLinear; the routers of mixture-of-experts layers on `router_kernel` (None: as
    loaded), so that which experts a token takes does not depend on its batch either."""

    def install(model: LlamaForCausalLM) -> None:
        model.install_quantized_weights()
        if router_kernel is not None:
            model.replace_router_layers(lambda weight, bias: Bf16KernelLinear(weight, bias, router_kernel))

    return install


def keep_plain(model: LlamaForCausalLM) -> None:
    """The install step of plain nn.Linear layers: nothing to swap."""


def choose_linear(
    setting: str, weight_dtype: str, device: torch.device, dtype: torch.dtype, batch_invariant: bool
) -> LinearPlan:
    """The plan for `--linear-weights setting` with weights in `weight_dtype` (resolved: not
    "auto"), activations in `dtype` on `device`; `batch_invariant`: whether batch invariance
    is still on (batch_invariance.py). Raises ValueError for a combination the flags refuse."""
    if weight_dtype == "gguf":
        router_kernel = None
        if device.type == "cpu" and dtype == torch.bfloat16:
            router_kernel = load_amx_linear() or load_vnni_linear() or load_widening_bf16_linear()
        reason = "--weight-dtype gguf: the file's own quantized formats"
        path = load_quant_linear().replace("_", "-") or "torch"
        return LinearPlan(f"gguf-{path}", reason, install_quantized(router_kernel))
    if weight_dtype == "int8":
        check_int8_supported(device, dtype)
        return LinearPlan(
            "int8", "--weight-dtype int8: weight-only int8 on torch's CPU kernel", every_linear(Int8Linear)
        )
    if setting == "auto" and device.type == "cpu" and dtype == torch.bfloat16 and (amx := load_amx_linear()):
        return LinearPlan(
            "amx-bf16",
            "our AMX-BF16 kernel at every batch size: one summation order, weights read once a step",
            every_bf16_kernel(amx),
        )
    if own_kernel_linear(setting, device, dtype, batch_invariant):
        why = "one summation order at every batch size" if batch_invariant else "oneDNN has no fast bf16 matmul here"
        if (vnni := load_vnni_linear()) is not None:
            return LinearPlan("avx512-bf16", f"our AVX512-BF16 kernel: {why}", every_bf16_kernel(vnni))
        if (widening := load_widening_bf16_linear()) is not None:
            return LinearPlan("avx2-bf16", f"our AVX2 widening kernel: {why}", every_bf16_kernel(widening))
        logger.warning("bf16 linear layers on oneDNN or torch: this CPU has none of our kernels")
        return LinearPlan(
            "plain",
            "none of our bf16 linear kernels runs on this CPU",
            keep_plain,
            breaks_batch_invariance="no bf16 linear kernel of ours for this CPU",
        )
    if wants_packed_linear(setting, device, dtype):
        vnni = load_vnni_linear() if dtype == torch.bfloat16 else None
        reason = f"--linear-weights {setting}: oneDNN without a reorder every call"
        if vnni is not None:
            reason += ", decode batches on our AVX512-BF16 kernel"
        return LinearPlan("packed", reason, every_linear(lambda weight, bias: PackedLinear(weight, bias, vnni)))
    if setting == "plain":
        return LinearPlan("plain", "--linear-weights plain", keep_plain)
    if device.type != "cpu":
        return LinearPlan("plain", f"torch's own matmul on {device.type}", keep_plain)
    return LinearPlan("plain", f"oneDNN has no fast {dtype} matmul on this CPU to pack for", keep_plain)


def own_kernel_linear(setting: str, device: torch.device, dtype: torch.dtype, batch_invariant: bool) -> bool:
    """`auto` in bf16 on CPU: our kernel at every batch size (`Bf16KernelLinear`) where batch
    invariance asks for one summation order (batch_invariance.py), or where oneDNN has no
    fast bf16 matmul (a CPU without bf16 instructions)."""
    return (
        setting == "auto"
        and device.type == "cpu"
        and dtype == torch.bfloat16
        and (
            batch_invariant
            or not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
    )


def wants_packed_linear(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """`packed` always (an error where oneDNN cannot), `plain` never; `auto` on CPU in bf16
    (when the CPU has bf16 instructions) and float32."""
    if setting == "plain" or device.type != "cpu":
        if setting == "packed" and device.type != "cpu":
            raise ValueError("--linear-weights packed is for --device cpu (oneDNN)")
        return False
    supported = torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )
    if setting == "packed" and not supported:
        raise ValueError(f"--linear-weights packed: oneDNN on this CPU has no fast {dtype} matmul")
    return supported


@dataclass(frozen=True)
class ExpertsPlan:
    """The path of a mixture-of-experts model's routed experts, why, and how to install it."""

    kind: str
    """"fused-amx", "fused-avx512-bf16", "fused-portable", "fused-gguf-avx512-vnni",
    "fused-gguf-avx2" or "torch"; the ready line names it."""
    reason: str
    """Why this path, in a sentence for the load log."""
    install: Callable[[LlamaForCausalLM], None]
    """Hands the experts to their path; call after the load and the cast, before the linear plan's."""

    def describe(self) -> str:
        return f"{self.kind} ({self.reason})"


def fused_experts(model: LlamaForCausalLM) -> None:
    """The install step of the fused op: every sparse layer's stacked bf16 weights packed for it."""
    model.use_fused_experts(FusedMoE.from_weights)


def fused_quantized_experts(model: LlamaForCausalLM) -> None:
    """The install step of the fused op on a GGUF's quantized experts: every sparse layer's
    experts, as the load kept them aside, packed for it (before install_quantized_weights)."""
    for left in model.use_fused_quantized_experts(FusedQuantMoE.from_weights):
        logger.warning("experts left on their own linear layers: %s", left)


def choose_experts(weight_dtype: str, device: torch.device, dtype: torch.dtype) -> ExpertsPlan:
    """The routed experts' path for weights in `weight_dtype` (resolved), activations in
    `dtype` on `device`: the fused op where its bf16 weights are, or a GGUF's quantized
    experts on the fused op for them, else each expert's own linear layers, which
    `choose_linear`'s plan then swaps. Under tensor parallelism each
    rank's experts are its slice of the intermediate dimension, which the op pads itself."""
    if device.type != "cpu":
        why = f"the fused op is for CPU, not {device.type}"
    elif weight_dtype == "gguf" and not fused_quant_moe_path():
        why = "the fused op for quantized experts needs our quantized kernels, which do not run here"
    elif weight_dtype == "gguf":
        reason = "the fused op on the GGUF's formats: each expert's weights read once a step, one summation order"
        return ExpertsPlan(f"fused-gguf-{fused_quant_moe_path().replace('_', '-')}", reason, fused_quantized_experts)
    elif weight_dtype != "bf16" or dtype != torch.bfloat16:
        what = "int8 weights" if weight_dtype == "int8" else f"{dtype} activations"
        why = f"{what}, and the fused op is bf16 only"
    elif not fused_moe_available():
        why = "the fused op's kernels did not build here"
    else:
        reason = "the fused op: each expert's weights read once a step, one summation order at every batch size"
        return ExpertsPlan(f"fused-{load_fused_moe().replace('_', '-')}", reason, fused_experts)
    return ExpertsPlan("torch", f"each expert's linear layers: {why}", keep_plain)
