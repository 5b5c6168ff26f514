"""Linear layers with their weights pre-packed for oneDNN (`--linear-weights`, CPU).

On CPU, `F.linear` in bf16 is a oneDNN matmul, and oneDNN wants the weight in its own
blocked layout: torch keeps the weight plain, so every call reorders it first. For a
decode step that copy is as large as the work itself: measured on 2 Zen 4 cores
(docs/benchmarks.md), SmolLM2's MLP up-projection (576 -> 3,072) takes 304 us at one row
and 564 us at 32 rows through `F.linear`, 129 and 329 us with the weight packed once at
load; the LM head (576 -> 49,152) 5.0 -> 2.9 ms at one row. In bf16 the results are the
same bits as `F.linear` (the same oneDNN kernel, without the reorder); in float32 torch
calls MKL instead, so packed results differ from it by float32 rounding.

The packed weight is an opaque MKLDNN tensor. The matmul goes through a custom op so
that the `--compile` graphs call it as one opaque node: inductor's own lowering of the
oneDNN linear only accepts weights it packed itself while freezing a graph.

In bf16 on a CPU with AVX512-BF16, decode batches (up to `VNNI_MAX_ROWS` rows) go to our own
kernel instead (csrc/vnni_linear.cpp), on a second copy of the weight packed in k-pairs:
measured on 2 Zen 4 cores (docs/benchmarks.md), SmolLM2's 120 layer weights in one pass took
9.6 / 10.1 / 24.2 / 43.0 ms at 1 / 4 / 32 / 64 rows against oneDNN's 16.4 / 17.9 / 32.9 /
79.7. From ~128 rows the two are level, and at prefill sizes oneDNN is ~10 % faster.

On a CPU without bf16 arithmetic (AVX2: Zen 2/3, older Intel), oneDNN has no fast bf16
matmul, and every bf16 batch goes to `Bf16KernelLinear` (csrc/widening_bf16_linear.cpp)
instead: bf16 weights widened to float32 in registers.

With batch invariance on (the default; batch_invariance.py), every bf16 batch goes to
`Bf16KernelLinear` on any CPU: oneDNN picks its blocking, and so its summation order, by
the number of rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpu_worker.kernels.cpu_kernels import Bf16LinearKernel


@torch.library.custom_op("trident::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_fake(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` with the weight held in oneDNN's layout.

    With `vnni` (bf16, csrc/vnni_linear.cpp), batches of up to `VNNI_MAX_ROWS` rows, and
    every batch of a compiled graph, go to that kernel instead: the layer then keeps both
    packed copies of its weight."""

    # The batch size oneDNN is told to pack for; any batch size works with the result.
    PACK_FOR_ROWS = 32
    VNNI_MAX_ROWS = 64
    """Up to here the VNNI kernel was 1.1-1.9x faster than oneDNN (docs/benchmarks.md)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, vnni: Bf16LinearKernel | None = None) -> None:
        super().__init__()
        # Plain attributes, not buffers: module.to() and state_dict() cannot handle MKLDNN tensors.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.PACK_FOR_ROWS)
        self.vnni = vnni if vnni is not None and weight.shape[1] % 2 == 0 else None
        self.vnni_weight = self.vnni.pack(weight) if self.vnni is not None else None
        self.register_buffer("bias", bias)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni is not None:
            # A compiled step is a decode step, over a symbolic batch size that a size test
            # would turn into a guard: it always takes the VNNI kernel.
            if torch.compiler.is_compiling() or x.numel() <= self.VNNI_MAX_ROWS * self.in_features:
                rows = x.reshape(-1, self.in_features)
                y = self.vnni.linear(rows, self.vnni_weight, self.bias, self.out_features)
                return y.view(*x.shape[:-1], self.out_features)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed_weight, self.bias, self.out_features)
        # Eager, the custom op's Python dispatch would add ~10 us to each of ~120 calls a step.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def rows_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward on 2-D rows, eager, as a plain function (flat_decode.py)."""
        packed, bias, n = self.packed_weight, self.bias, self.out_features
        onednn = torch.ops.mkldnn._linear_pointwise
        if self.vnni is None:
            return lambda rows: onednn(rows, packed, bias, "none", [], "")
        vnni, vnni_weight, max_rows = self.vnni.linear, self.vnni_weight, self.VNNI_MAX_ROWS

        def vnni_or_onednn(rows: torch.Tensor) -> torch.Tensor:
            if rows.shape[0] <= max_rows:
                return vnni(rows, vnni_weight, bias, n)
            return onednn(rows, packed, bias, "none", [], "")

        return vnni_or_onednn


class Bf16KernelLinear(nn.Module):
    """bf16 `y = x @ weight.T + bias` through one of our kernels (`Bf16LinearKernel`) at every
    batch size, prompt chunks included, so that each output is summed in one order whatever
    the batch (batch_invariance.py): the AVX512-BF16 one (csrc/vnni_linear.cpp) where the
    CPU has it, else the AVX2 one (csrc/widening_bf16_linear.cpp).

    The AVX2 kernel is also what a CPU with no bf16 arithmetic needs, where torch's bf16
    matmul is a slow path: measured on 2 Zen 3 cores (docs/benchmarks.md), SmolLM2's MLP
    up-projection (576 -> 6,144 fused) at 1 / 32 / 200 rows: 0.17 / 1.29 / 7.6 ms, against
    0.37 / 2.69 / 9.5 ms for float32 `F.linear` on float32 weights twice the size."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Bf16LinearKernel) -> None:
        super().__init__()
        self.kernel = kernel
        self.register_buffer("weight_panels", kernel.pack(weight))
        self.register_buffer("bias", bias)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = self.kernel.linear(rows, self.weight_panels, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def rows_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward on 2-D rows as a plain function (flat_decode.py)."""
        linear, panels, bias, n = self.kernel.linear, self.weight_panels, self.bias, self.out_features
        return lambda rows: linear(rows, panels, bias, n)
