"""Decode attention alone, per layer: the torch path against the C++ kernel.

    python benchmarks/bench_decode_attention.py [--shapes 32x256,32x512,64x300,1x512]
    python benchmarks/bench_decode_attention.py --heads 4x1x256 --window 512  # Gemma 3 270M

For each shape ROWSxKEYS (row lengths drawn from KEYS/2..KEYS, one row of exactly KEYS),
in bfloat16 and float32: a pool of 60,000 tokens with the given heads (default SmolLM2's:
9 query heads over 3 KV heads, dim 64), rows whose keys sit at random pool indices (page
size 1, as served), and the milliseconds of one layer's decode attention through
`paged_attention` with the torch path and with the kernel (median of --repeats timings),
and each path's largest error against float64 attention (over each row's last --window keys
when a window is given).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gpu_worker.kernels.cpu_kernels import load_decode_attention as load  # noqa: E402
from gpu_worker.model.attention import AttentionMetadata, DecodeGroup, paged_attention  # noqa: E402

POOL_TOKENS = 60_000


@dataclass(frozen=True)
class Heads:
    """Query heads, KV heads and head dim of the attention measured."""

    heads: int
    kv_heads: int
    dim: int

    @classmethod
    def parse(cls, text: str) -> Heads:
        heads, kv_heads, dim = (int(x) for x in text.split("x"))
        return cls(heads, kv_heads, dim)


def decode_step(rows: int, keys: int, shape: Heads, dtype: torch.dtype, gen: torch.Generator):
    """A plain decode step's q, pool and metadata (bias and gather index as the worker builds them)."""
    pool = torch.randn(POOL_TOKENS, 2, shape.kv_heads, shape.dim, generator=gen).to(dtype)
    lens = torch.randint(keys // 2, keys + 1, (rows,), generator=gen)
    lens[0] = keys
    kv_indices = torch.randperm(POOL_TOKENS, generator=gen)[: rows * keys].view(rows, keys)
    bias = torch.where(torch.arange(keys)[None] < lens[:, None], 0.0, float("-inf")).view(rows, 1, 1, 1, keys)
    group = DecodeGroup(
        token_idx=torch.arange(rows)[:, None],
        q_valid=torch.ones(rows, 1, dtype=torch.bool),
        kv_indices=kv_indices,
        kv_lens=lens,
        bias=bias.contiguous(),
        covers_batch=True,
    )
    meta = AttentionMetadata(torch.zeros(rows, dtype=torch.int64), [group], [])
    q = torch.randn(rows, shape.heads, shape.dim, generator=gen).to(dtype)
    return q, pool, meta


def reference(q: torch.Tensor, pool: torch.Tensor, group: DecodeGroup, shape: Heads, window: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        length = int(group.kv_lens[r])
        first = max(0, length - window) if window else 0
        kv = pool[group.kv_indices[r, first:length]].double().repeat_interleave(shape.heads // shape.kv_heads, dim=2)
        scores = torch.einsum("hd,khd->hk", q[r].double(), kv[:, 0]) / shape.dim**0.5
        out[r] = torch.einsum("hk,khd->hd", scores.softmax(-1), kv[:, 1])
    return out


def time_ms(fn, repeats: int, clock=time.perf_counter) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32x256,32x512,64x300,1x512", help="ROWSxKEYS, comma-separated")
    p.add_argument("--heads", type=Heads.parse, default=Heads(9, 3, 64), help="HEADSxKV_HEADSxDIM (default 9x3x64)")
    p.add_argument("--window", type=int, default=0, help="sliding window in keys (0: none)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's choice); at 1, *_cpu_ms is the process CPU time, steady on a loaded host",
    )
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    kernel = load()
    if kernel is None:
        print("error: the kernel did not build", file=sys.stderr)
        return 2
    shape, window = ns.heads, ns.window
    kv_head_map = torch.arange(shape.kv_heads)
    for step_shape in ns.shapes.split(","):
        rows, keys = (int(x) for x in step_shape.split("x"))
        for dtype in (getattr(torch, name) for name in ns.dtypes.split(",")):
            q, pool, meta = decode_step(rows, keys, shape, dtype, torch.Generator().manual_seed(rows * keys))
            meta.prepare_gather(shape.kv_heads, kv_head_map)
            if window:
                meta.prepare_windows({window})  # the torch path's masks too
            want = reference(q, pool, meta.decode_groups[0], shape, window)
            result = {
                "rows": rows,
                "keys": keys,
                "heads": f"{shape.heads}x{shape.kv_heads}x{shape.dim}",
                "window": window,
            }
            result["dtype"] = str(dtype).removeprefix("torch.")
            for name, op in (("torch", None), ("kernel", kernel)):
                # no prompt rows: k, v unread
                run = functools.partial(paged_attention, q, q, q, pool, meta, None, op, window, shape.dim**-0.5)
                result[f"{name}_ms"] = round(time_ms(run, ns.repeats), 4)
                if ns.threads == 1:
                    result[f"{name}_cpu_ms"] = round(time_ms(run, ns.repeats, time.process_time), 4)
                result[f"{name}_max_error"] = float((run().double() - want).abs().max())
            result["speedup"] = round(result["torch_ms"] / result["kernel_ms"], 2)
            if ns.threads == 1:
                result["cpu_speedup"] = round(result["torch_cpu_ms"] / result["kernel_cpu_ms"], 2)
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
