"""Expert weights under one naming: `mlp.experts.N.{gate,up,down}_proj`, as Qwen-MoE
checkpoints store them, whatever the checkpoint wrote.

- Mixtral writes `block_sparse_moe.experts.N.w1/w3/w2` (gate/up/down) and
  `block_sparse_moe.gate` (the router): renamed to `mlp.`....
- transformers 5 models hold the experts stacked, `mlp.experts.gate_up_proj` [E, 2I, H]
  (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I], and a GGUF stacks them
  per projection (`ffn_gate_exps` [E, I, H]...; gguf_weights.py names those
  `mlp.experts.gate_proj`...): split into one entry per expert.

No torch import: the launcher's model check (model_check.py) uses the shape side.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


def canonical_name(name: str) -> str:
    if ".block_sparse_moe." not in name:
        return name
    parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
    parts[-2] = _MIXTRAL_PROJECTIONS.get(parts[-2], parts[-2])
    return ".".join(parts)


def stacked_projection(name: str) -> str | None:
    """The projection of a stacked experts tensor's name (`...mlp.experts.gate_up_proj.weight`), else None."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-3] == "experts" and parts[-2] in _STACKED:
        return parts[-2]
    return None


def expert_name(stacked: str, expert: int, projection: str) -> str:
    """`...experts.<proj>.weight` -> `...experts.<expert>.<projection>.weight`."""
    parts = stacked.split(".")
    return ".".join([*parts[:-2], str(expert), projection, parts[-1]])


def per_expert_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs with Mixtral's names renamed and stacked experts split."""
    for name, tensor in weights:
        name = canonical_name(name)
        projection = stacked_projection(name)
        if projection is None:
            yield name, tensor
        elif projection == "gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield expert_name(name, e, "gate_proj"), tensor[e, :half]
                yield expert_name(name, e, "up_proj"), tensor[e, half:]
        else:
            for e in range(tensor.shape[0]):
                yield expert_name(name, e, projection), tensor[e]


def per_expert_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """per_expert_weights on shapes (the launcher's check)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        name = canonical_name(name)
        projection = stacked_projection(name)
        if projection is None or len(shape) != 3:
            out[name] = shape
        elif projection == "gate_up_proj":
            half = (shape[1] // 2, shape[2])
            for e in range(shape[0]):
                out[expert_name(name, e, "gate_proj")] = out[expert_name(name, e, "up_proj")] = half
        else:
            for e in range(shape[0]):
                out[expert_name(name, e, projection)] = shape[1:]
    return out
