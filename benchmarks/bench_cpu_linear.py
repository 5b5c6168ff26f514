"""CPU linear layers in bf16: torch's F.linear, oneDNN-packed weights, the AMX kernel where
the CPU has AMX-BF16, the k-pair packed (VNNI) kernel where it has AVX512-BF16 and the
widening kernel where it has AVX2; and,
for scale, oneDNN-packed float32 weights (what `--dtype float32` runs).

    python benchmarks/bench_cpu_linear.py [--rows 1,2,4,8,16,32,64,2048] [--calls 100]

Two measurements, on the model's own shapes (default: the bundled SmolLM2-135M):

1. `cached`: one weight of each shape (qkv, o, gate+up, down, LM head) called over and
   over, so that it sits in cache: the kernels' arithmetic and call overhead;
2. `stream`: every layer's weights as distinct tensors, one pass through all of them per
   step, as a decode step reads them: what a decode step's linear layers cost when the
   weights come from memory (batches of up to 64 rows). Also reports `sum()` over as many
   bytes, the cores' streaming rate.

Results print as JSON lines (microseconds per call, or milliseconds per pass and GB/s).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_worker.kernels.cpu_kernels import (  # noqa: E402
    Bf16LinearKernel,
    load_amx_linear,
    load_vnni_linear,
    load_widening_bf16_linear,
)
from gpu_worker.model.weights import load_config  # noqa: E402
from trident.model_source import default_model_path  # noqa: E402


def seconds_per_call(fn: Callable[..., object], calls: int, *args: object) -> float:
    for _ in range(max(2, calls // 10)):
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t0) / calls


def run_pass(layers: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]) -> None:
    for fn, x in layers:
        fn(x)


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear layer of one decoder layer, and of the LM head."""
    cfg = load_config(model)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv": (q + 2 * kv, cfg.hidden_size),
        "o": (cfg.hidden_size, q),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, cfg.hidden_size),
    }


class OurKernels(NamedTuple):
    amx: Bf16LinearKernel | None
    vnni: Bf16LinearKernel | None
    widening: Bf16LinearKernel | None


def variants(w: torch.Tensor, ours: OurKernels) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n = w.shape[0]
    out = {"F.linear": lambda x: F.linear(x, w)}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # else oneDNN's bf16 is as slow as F.linear
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        out["packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    packed_fp32 = torch.ops.mkldnn._reorder_linear_weight(w.float(), 32)
    out["packed_fp32"] = lambda x: torch.ops.mkldnn._linear_pointwise(x.float(), packed_fp32, None, "none", [], "")
    for label, kernel in ours._asdict().items():
        if kernel is not None:
            out[label] = functools.partial(kernel.linear, packed_weight=kernel.pack(w), bias=None, out_features=n)
    return out


def cached(shapes: dict[str, tuple[int, int]], rows_list: list[int], calls: int, ours: OurKernels) -> None:
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16)
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            n_calls = max(3, calls if rows * n * k < 1e9 else calls // 20)
            result = {"test": "cached", "layer": name, "out_in": [n, k], "rows": rows}
            for label, fn in variants(w, ours).items():
                result[f"{label}_us"] = round(seconds_per_call(fn, n_calls, x) * 1e6, 1)
            print(json.dumps(result), flush=True)


def stream(shapes: dict[str, tuple[int, int]], num_layers: int, rows_list: list[int], ours: OurKernels) -> None:
    per_layer = [shape for name, shape in shapes.items() if name != "lm_head"]
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(num_layers) for n, k in per_layer]
    total_bytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.randn(total_bytes // 2, dtype=torch.bfloat16)
    sum_s = seconds_per_call(torch.sum, 10, flat)
    print(
        json.dumps(
            {"test": "stream", "what": "sum()", "MB": total_bytes >> 20, "GB_s": round(total_bytes / sum_s / 1e9, 1)}
        )
    )
    del flat
    for rows in rows_list:
        if rows > 64:
            continue
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for _, k in per_layer}
        fns = [variants(w, ours) for w in weights]
        for label in fns[0]:
            layers = [(fn[label], inputs[w.shape[1]]) for fn, w in zip(fns, weights)]
            pass_s = seconds_per_call(run_pass, 10, layers)
            gb_s = round(total_bytes / pass_s / 1e9, 1)
            print(
                json.dumps({"test": "stream", "what": label, "rows": rows, "ms": round(pass_s * 1e3, 2), "GB_s": gb_s})
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,2048")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    model = ns.model or default_model_path()
    rows_list = [int(r) for r in ns.rows.split(",")]
    shapes = layer_shapes(model)
    ours = OurKernels(load_amx_linear(), load_vnni_linear(), load_widening_bf16_linear())
    kernels = {label: kernel is not None for label, kernel in ours._asdict().items()}
    print(json.dumps({"threads": torch.get_num_threads(), "our_kernels": kernels}), flush=True)
    cached(shapes, rows_list, ns.calls, ours)
    stream(shapes, load_config(model).num_layers, rows_list, ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
