"""Linear layers with their weights pre-packed for oneDNN (`--linear-weights`, CPU).

On CPU, `F.linear` in bf16 is a oneDNN matmul, and oneDNN wants the weight in its own
blocked layout: torch keeps the weight plain, so every call reorders it first. For a
decode step that copy is as large as the work itself, so the weight is packed once at load
(docs/benchmarks.md, "Kernels", has the per-call cost of both). In bf16 the results are the
same bits as `F.linear` (the same oneDNN kernel, without the reorder); in float32 torch
calls MKL instead, so packed results differ from it by float32 rounding.

The packed weight is an opaque MKLDNN tensor. The matmul goes through a custom op so
that the `--compile` graphs call it as one opaque node: inductor's own lowering of the
oneDNN linear only accepts weights it packed itself while freezing a graph.

In bf16 on a CPU with AVX512-BF16, decode batches (up to `VNNI_MAX_ROWS` rows) go to our own
kernel instead (csrc/vnni_linear.cpp), on a second copy of the weight packed in k-pairs.
It reads each weight line once for a whole tile of rows, where oneDNN is built for many rows,
so it is the faster one at decode batch sizes; from about 128 rows the two are level, and at
prefill sizes oneDNN is ahead (docs/benchmarks.md, "Kernels").

On a CPU without bf16 arithmetic (AVX2 only), oneDNN has no fast bf16
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
from gpu_worker.runtime.huge_pages import in_huge_pages


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
    """Up to here the VNNI kernel is faster than oneDNN (docs/benchmarks.md, "Kernels")."""

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
        # Eager, skip the custom op: its Python dispatch would be paid on each of ~120 calls a step.
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
    matmul is a slow path. Keeping the weights bf16 in memory reads half of float32's bytes,
    and widening in registers costs less than that saves, so it also beats float32
    `F.linear` (docs/benchmarks.md, "Kernels")."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Bf16LinearKernel) -> None:
        super().__init__()
        self.kernel = kernel
        # A step streams the panels from end to end: 2 MB pages spare it a page walk every 4 KB.
        self.register_buffer("weight_panels", in_huge_pages(kernel.pack(weight)))
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
