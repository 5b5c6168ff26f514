"""A decoder layer's elementwise steps on CPU: decoder_layer.py's torch ops against the C++ ops
(cpu_kernels.ElementwiseKernels), per call, at decode and prefill row counts.

    python benchmarks/bench_cpu_elementwise.py [--rows 1,32,2048] [--calls 300] [--dtype bfloat16]

On SmolLM2-135M's shapes (hidden 576, intermediate 1,536, 9 query and 3 KV heads of 64):
SwiGLU (split + silu + mul, against silu_and_mul), the rotary embedding of q and k read from
the fused qkv output (against rotary), and the residual add before a norm (add + RMSNorm,
against add_rms_norm). Same OpenMP wait policy as the worker. Results print as JSON lines,
microseconds per call; the two paths alternate, so a busy moment hits both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_worker.runtime.omp_policy import use_passive_omp_wait  # noqa: E402

use_passive_omp_wait()  # before torch loads, as the worker process does
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_cpu_linear import seconds_per_call  # noqa: E402

from gpu_worker.kernels.cpu_kernels import load_elementwise_kernels  # noqa: E402
from gpu_worker.model.decoder_layer import RMSNorm, apply_rotary  # noqa: E402
from gpu_worker.model.rope import RotaryEmbedding  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(INTER, dim=-1)
    return F.silu(gate) * up


def torch_add_norm(x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, norm(total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32,2048")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two paths; the median is kept")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ns = p.parse_args(argv)
    ops = load_elementwise_kernels()
    if ops is None:
        print("error: the C++ kernels did not build", file=sys.stderr)
        return 2
    dtype = getattr(torch, ns.dtype)
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, 8192)
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    for rows in [int(r) for r in ns.rows.split(",")]:
        gate_up = (torch.randn(rows, 2 * INTER) * 4).to(dtype)
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
        qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
        tables = rope.tables(torch.randint(0, 8192, (rows,)), dtype)
        x, delta = torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, HIDDEN).to(dtype)

        # op -> ((torch path, its args), (C++ op, its args))
        pairs = {
            "swiglu": ((torch_swiglu, (gate_up,)), (ops.silu_and_mul, (gate_up,))),
            "rotary": ((apply_rotary, (qk, tables)), (ops.rotary, (qk, *tables))),
            "add_rms_norm": ((torch_add_norm, (x, delta, norm)), (ops.add_rms_norm, (x, delta, norm.weight, norm.eps))),
        }
        for name, ((torch_fn, torch_args), (kernel_fn, kernel_args)) in pairs.items():
            torch_us, kernel_us = [], []
            for _ in range(ns.rounds):
                torch_us.append(seconds_per_call(torch_fn, ns.calls, *torch_args) * 1e6)
                kernel_us.append(seconds_per_call(kernel_fn, ns.calls, *kernel_args) * 1e6)
            torch_us.sort()
            kernel_us.sort()
            print(
                json.dumps(
                    {
                        "op": name,
                        "rows": rows,
                        "dtype": ns.dtype,
                        "threads": torch.get_num_threads(),
                        "torch_us": round(torch_us[len(torch_us) // 2], 2),
                        "kernel_us": round(kernel_us[len(kernel_us) // 2], 2),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
