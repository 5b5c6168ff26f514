"""How fast a decode step could be on this host, and how close each engine comes.

The host's limits are measured with torch on `threads` threads, before any server starts:
- memory read: the best of a few sums over a tensor far larger than any cache;
- bf16 matmul through oneDNN on weights packed once (as a server holds them), at each row
  count and at `PEAK_ROWS`: rows x hidden @ hidden x intermediate, the model's own MLP shape,
  best of a few timed batches on the same weights (the matmul's own rate; reading the
  weights from memory is the other floor's business).

A decode step of `rows` sequences, in bf16, reads every linear weight and the LM head once,
one embedding row per sequence, and each sequence's keys and values so far. It does
2 x (linear + LM head parameters) FLOPs per row. So, in tokens per second:
- memory floor = rows x read bandwidth / bytes read per step;
- compute floor = the best matmul rate measured (the host's bf16 peak, at PEAK_ROWS rows or
  wherever it was highest) / (2 x (linear + LM head parameters)), at every row count.
Each engine's fraction is its decode tok/s over the lower of the two floors.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

BF16_BYTES = 2

READ_BYTES = 1 << 30
PEAK_ROWS = 512
"""Rows at which a bf16 matmul of a 1B model's MLP shape is bound by arithmetic, not memory."""


@dataclass
class HostLimits:
    threads: int
    memory_read_gb_s: float
    matmul_gflop_s: dict[int, float]
    """rows -> bf16 GFLOP/s of rows x hidden @ hidden x intermediate."""

    @property
    def peak_matmul_gflop_s(self) -> float:
        return max(self.matmul_gflop_s.values())


def best_seconds(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """The shortest of `repeats` timings of `inner` calls of fn, per call."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def memory_read_gb_s() -> float:
    # The bf16 tensor is summed through a float32 view: the same bytes, but a bf16 sum
    # converts every element and is bounded by that work rather than by memory.
    data = torch.ones(READ_BYTES // BF16_BYTES, dtype=torch.bfloat16).view(torch.float32)
    data.sum()
    return READ_BYTES / best_seconds(data.sum, repeats=5) / 1e9


def matmul_gflop_s(rows: int, hidden: int, intermediate: int) -> float:
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    weight = torch.randn(intermediate, hidden, dtype=torch.bfloat16)
    # F.linear would reorder the plain weight into oneDNN's layout on every call.
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)

    def matmul() -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    matmul()
    once = best_seconds(matmul, repeats=1)
    inner = max(1, int(0.1 / max(once, 1e-6)))
    return 2 * rows * hidden * intermediate / best_seconds(matmul, 3, inner) / 1e9


def measure_host_limits(rows: Sequence[int], hidden: int, intermediate: int, threads: int) -> HostLimits:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = memory_read_gb_s()
        rates = {r: matmul_gflop_s(r, hidden, intermediate) for r in sorted({*rows, PEAK_ROWS})}
    finally:
        torch.set_num_threads(previous)
    return HostLimits(threads, bandwidth, rates)


@dataclass
class ModelCost:
    """What one decode step of a checkpoint reads and computes, counted from its tensors."""

    name: str
    linear_params: int
    """Every 2-D weight but the embedding, plus the LM head (the embedding itself when tied)."""
    hidden_size: int
    intermediate_size: int
    kv_bytes_per_token: int
    """Keys and values of one position over all layers, in bf16."""

    def bytes_per_step(self, rows: int, context: int) -> int:
        weights = self.linear_params * BF16_BYTES
        embedding_rows = rows * self.hidden_size * BF16_BYTES
        return weights + embedding_rows + rows * context * self.kv_bytes_per_token


def model_cost(name: str, checkpoint_dir: str) -> ModelCost:
    from safetensors import safe_open

    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    shapes = {}
    for path in sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            shapes |= {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118 (no __iter__)
    matrices = {k: s for k, s in shapes.items() if len(s) == 2}
    embedding = next(s for k, s in matrices.items() if k.endswith("embed_tokens.weight"))
    linear = sum(s[0] * s[1] for k, s in matrices.items() if not k.endswith("embed_tokens.weight"))
    if not any(k.endswith("lm_head.weight") for k in matrices):  # tied: the embedding is the head
        linear += embedding[0] * embedding[1]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    kv_per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim * BF16_BYTES
    return ModelCost(name, linear, config["hidden_size"], config["intermediate_size"], kv_per_token)


@dataclass
class RooflineRow:
    model: str
    rows: int
    trident_tok_s: float | None
    vllm_tok_s: float | None
    memory_floor_tok_s: float
    compute_floor_tok_s: float

    def fraction(self, tok_s: float | None) -> float | None:
        floor = min(self.memory_floor_tok_s, self.compute_floor_tok_s)
        return None if tok_s is None else tok_s / floor


def roofline_rows(
    cost: ModelCost,
    limits: HostLimits,
    context: int,
    decode_tok_s: dict[str, dict[int, float]],
    row_counts: Sequence[int],
) -> list[RooflineRow]:
    """One row per row count; `decode_tok_s` is engine -> rows -> the median decode tok/s."""
    out = []
    compute = limits.peak_matmul_gflop_s * 1e9 / (2 * cost.linear_params)
    for rows in sorted(row_counts):
        memory = rows * limits.memory_read_gb_s * 1e9 / cost.bytes_per_step(rows, context)
        trident, vllm = (decode_tok_s.get(e, {}).get(rows) for e in ("trident", "vllm"))
        out.append(RooflineRow(cost.name, rows, trident, vllm, memory, compute))
    return out


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown_table(rows: Sequence[RooflineRow]) -> str:
    lines = [
        "| model | rows | trident tok/s | vLLM tok/s | memory floor | compute floor "
        "| trident fraction | vLLM fraction |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r.model,
            str(r.rows),
            _cell(r.trident_tok_s, ".1f"),
            _cell(r.vllm_tok_s, ".1f"),
            _cell(r.memory_floor_tok_s, ".1f"),
            _cell(r.compute_floor_tok_s, ".1f"),
            _cell(r.fraction(r.trident_tok_s), ".2f"),
            _cell(r.fraction(r.vllm_tok_s), ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def roofline_json(rows: Sequence[RooflineRow]) -> list[dict[str, object]]:
    return [
        asdict(r) | {"trident_fraction": r.fraction(r.trident_tok_s), "vllm_fraction": r.fraction(r.vllm_tok_s)}
        for r in rows
    ]


def write_roofline_png(rows: Sequence[RooflineRow], path: str, title: str) -> None:
    """Decode tok/s against rows for both engines, with the two floors as dashed lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the `bench` extra): no PNG written", file=sys.stderr)
        return
    xs = [r.rows for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ys, style in (
        ("trident", [r.trident_tok_s for r in rows], "o-"),
        ("vLLM CPU", [r.vllm_tok_s for r in rows], "s-"),
        ("memory floor", [r.memory_floor_tok_s for r in rows], "--"),
        ("compute floor", [r.compute_floor_tok_s for r in rows], ":"),
    ):
        points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("rows (sequences decoded together)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
