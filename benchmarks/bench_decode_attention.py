"""Decode attention alone, per layer: the torch path against the C++ kernel.

    python benchmarks/bench_decode_attention.py [--shapes 32x256,32x512,64x300,1x512]

For each shape ROWSxKEYS (row lengths drawn from KEYS/2..KEYS, one row of exactly KEYS),
in bfloat16 and float32: a pool of 60,000 tokens with SmolLM2's heads (9 query heads over
3 KV heads, dim 64), rows whose keys sit at random pool indices (page size 1, as served),
and the milliseconds of one layer's decode attention through `paged_attention` with the
torch path and with the kernel (median of --repeats timings), and each path's largest
error against float64 attention.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gpu_worker.attention import AttentionMetadata, DecodeGroup, paged_attention  # noqa: E402
from gpu_worker.cpu_kernels import load_decode_attention as load  # noqa: E402

POOL_TOKENS, HEADS, KV_HEADS, DIM = 60_000, 9, 3, 64


def decode_step(rows: int, keys: int, dtype: torch.dtype, gen: torch.Generator):
    """A plain decode step's q, pool and metadata (bias and gather index as the worker builds them)."""
    pool = torch.randn(POOL_TOKENS, 2, KV_HEADS, DIM, generator=gen).to(dtype)
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
    q = torch.randn(rows, HEADS, DIM, generator=gen).to(dtype)
    return q, pool, meta


def reference(q: torch.Tensor, pool: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        kv = pool[group.kv_indices[r, : group.kv_lens[r]]].double().repeat_interleave(HEADS // KV_HEADS, dim=2)
        scores = torch.einsum("hd,khd->hk", q[r].double(), kv[:, 0]) / DIM**0.5
        out[r] = torch.einsum("hk,khd->hd", scores.softmax(-1), kv[:, 1])
    return out


def time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32x256,32x512,64x300,1x512", help="ROWSxKEYS, comma-separated")
    p.add_argument("--repeats", type=int, default=30)
    ns = p.parse_args(argv)
    kernel = load()
    if kernel is None:
        print("error: the kernel did not build", file=sys.stderr)
        return 2
    heads = torch.arange(KV_HEADS)
    for shape in ns.shapes.split(","):
        rows, keys = (int(x) for x in shape.split("x"))
        for dtype in (torch.bfloat16, torch.float32):
            q, pool, meta = decode_step(rows, keys, dtype, torch.Generator().manual_seed(rows * keys))
            meta.prepare_gather(KV_HEADS, heads)
            want = reference(q, pool, meta.decode_groups[0])
            result = {"rows": rows, "keys": keys, "dtype": str(dtype).removeprefix("torch.")}
            for name, op in (("torch", None), ("kernel", kernel)):
                run = functools.partial(paged_attention, q, q, q, pool, meta, None, op)  # no prompt rows: k, v unread
                result[f"{name}_ms"] = round(time_ms(run, ns.repeats), 4)
                result[f"{name}_max_error"] = float((run().double() - want).abs().max())
            result["speedup"] = round(result["torch_ms"] / result["kernel_ms"], 2)
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
