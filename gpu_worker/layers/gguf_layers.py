"""The model's linear layers, LM head and embedding on a GGUF's own formats (`--weight-dtype gguf`).

How the weights get there: gguf_weights.py yields the U4/I8 weights of gguf_repack.py for
those tensors; `LlamaForCausalLM.load_weights` slices them for this rank as it slices dense
tensors (`narrow`) and files them here by target (`QuantizedParts`), releasing the dense
parameter at once, so no dense copy of a quantized weight is ever written. After the
model's cast to --dtype, `install` turns each target's parts into one QuantLinear
(quant_linear.py): q/k/v and gate/up parts of one layout are stacked by rows (both
packaged files need nothing else); parts of two layouts run as a `StackedQuantLinear`.

Tensor parallelism slices rows (column-parallel layers, vocabulary shards) freely and
columns (row-parallel layers) only on the quantization's block edges (gguf_repack.py
raises a clear error otherwise).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from gpu_worker.layers.gguf_repack import I8Weights, QuantWeights, U4Weights, concat_rows


def narrow(value: torch.Tensor | QuantWeights, dim: int, start: int, length: int) -> torch.Tensor | QuantWeights:
    """`Tensor.narrow` for a dense tensor or quantized weights (dim 0: rows, 1: columns)."""
    if isinstance(value, torch.Tensor):
        return value.narrow(dim, start, length)
    if dim == 0:
        return value.map_rows(lambda a: a[start : start + length])
    return value.columns(start, length)


def pad_rows(weights: QuantWeights, rows: int) -> QuantWeights:
    """Zero rows (code 0, scale 0, min 0: weight 0) up to `rows`: a vocabulary shard padded
    to the size every rank's shard has."""
    missing = rows - weights.shape[0]
    return weights.map_rows(lambda a: np.concatenate([a, np.zeros((missing, *a.shape[1:]), a.dtype)]))


@contextmanager
def weights_left_uninitialised(dtype: torch.dtype) -> Iterator[None]:
    """Builds nn.Linear and nn.Embedding without their random initialisation, their
    parameters allocated in `dtype`. The worker builds its model inside this: load_weights
    writes every weight from the checkpoint, or releases it (`--weight-dtype gguf`) and
    refuses a checkpoint that lacks one, so drawing random values first only costs time at
    every start, and the memory of a released weight is then never touched, so it costs no
    resident memory (the worker's heap keeps every page it touches: malloc_policy.py).
    Allocated in float32 and converted afterwards, a bf16 model would pass through twice its
    size in memory and write every weight twice (docs/benchmarks.md, "Recovery time": the model load)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    saved_dtype = torch.get_default_dtype()
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved_dtype)
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


class QuantizedParts:
    """The quantized weights met while loading, by target parameter name ("layers.0.mlp.
    gate_up_proj.weight"): (row offset in the target, weights) for each part."""

    def __init__(self) -> None:
        self.parts: dict[str, list[tuple[int, QuantWeights]]] = {}

    def add(self, name: str, offset: int, weights: QuantWeights) -> None:
        self.parts.setdefault(name, []).append((offset, weights))

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    def __bool__(self) -> bool:
        return bool(self.parts)

    def stacked(self, name: str, rows: int) -> list[QuantWeights]:
        """The target's parts in row order, checked to cover its `rows` rows exactly."""
        parts = sorted(self.parts[name], key=lambda p: p[0])
        expected = 0
        for offset, weights in parts:
            if offset != expected:
                raise ValueError(f"{name}: rows {expected}:{offset} are not in the file's quantized formats")
            expected += weights.shape[0]
        if expected != rows:
            raise ValueError(f"{name}: {expected} quantized rows, the layer has {rows}")
        return [weights for _, weights in parts]

    def pop_stacked(self, name: str, rows: int) -> list[QuantWeights]:
        """`stacked`, and the target's parts no longer kept here."""
        parts = self.stacked(name, rows)
        self.discard(name)
        return parts

    def discard(self, name: str) -> None:
        """The target's parts no longer kept here (another layer took them)."""
        del self.parts[name]


def quant_linear(weights: QuantWeights, bias: torch.Tensor | None) -> nn.Module:
    from gpu_worker.layers.quant_linear import QuantLinear

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    if isinstance(weights, U4Weights):
        return QuantLinear.from_u4(tensor(weights.codes), tensor(weights.scales), tensor(weights.mins), bias)
    assert isinstance(weights, I8Weights)
    if weights.bits <= 5 and weights.block == 32:  # Q5_0: I5, 5.5 bits a weight instead of 8.5
        return QuantLinear.from_i5(tensor(weights.codes), tensor(weights.scales), bias)
    if weights.bits <= 6 and weights.block == 16:  # Q6_K: I6, 8 bits a weight instead of 10
        return QuantLinear.from_i6(tensor(weights.codes), tensor(weights.scales), bias)
    return QuantLinear.from_i8(tensor(weights.codes), tensor(weights.scales), weights.block, bias)


def stacked_linear(parts: list[QuantWeights], bias: torch.Tensor | None) -> nn.Module:
    """One layer from its row parts: one QuantLinear where their layouts stack."""
    try:
        return quant_linear(concat_rows(parts), bias)
    except ValueError:
        return StackedQuantLinear(parts, bias)


class StackedQuantLinear(nn.Module):
    """A layer whose row parts have different layouts (a fused q/k/v of U4 and I8 tensors):
    each part its own QuantLinear, outputs side by side."""

    def __init__(self, parts: list[QuantWeights], bias: torch.Tensor | None) -> None:
        super().__init__()
        sizes = [p.shape[0] for p in parts]
        biases = [None] * len(parts) if bias is None else list(bias.split(sizes))
        self.parts = nn.ModuleList(quant_linear(p, b) for p, b in zip(parts, biases, strict=True))
        self.in_features = parts[0].shape[1]
        self.out_features = sum(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)
