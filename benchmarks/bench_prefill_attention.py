"""A prompt's attention on the CPU: the query-tile path against one decode-kernel row per query.

    python benchmarks/bench_prefill_attention.py [--prompt-lens 512,1024,2000] [--heads 32x8x64] [--threads 1]

For each prompt length L: one sequence whose L keys sit at random pool indices (page size
1, as served) and L queries, one per position, causal. Both paths go through the same op,
`paged_decode_attention`: given `kv_rows` (each query's row of the token table) it takes
consecutive queries of one sequence as a tile that shares each K and V row it reads; given
the table repeated once per query it runs the decode kernel, one query at a time. The two
must agree bit for bit (the tiled path reproduces the decode kernel's order), which this
checks before timing. Timings alternate between the paths, --rounds rounds of CPU time
(process time, so a preempted thread does not count), best of each; JSON lines.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gpu_worker.kernels.cpu_kernels import load_decode_attention  # noqa: E402


def cpu_seconds(fn: Callable[[], torch.Tensor]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-lens", default="512,1024,2000")
    p.add_argument("--heads", default="32x8x64", help="HEADSxKV_HEADSxDIM (default: Llama-3.2-1B's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    kernel = load_decode_attention()
    if kernel is None:
        print("the C++ CPU kernels did not build on this machine", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim = (int(v) for v in args.heads.split("x"))
    g = torch.Generator().manual_seed(0)
    for length in (int(v) for v in args.prompt_lens.split(",")):
        pool = torch.randn(length + 8, 2, kv_heads, dim, generator=g).to(torch.bfloat16)
        table = torch.randperm(length + 8, generator=g)[:length].view(1, length)
        q = torch.randn(length, heads, dim, generator=g).to(torch.bfloat16)
        lens = torch.arange(1, length + 1)
        rows = torch.zeros(length, dtype=torch.int64)
        per_query_table = table.expand(length, length).contiguous()
        paths = {
            "tiled": functools.partial(kernel, q, pool, table, lens, dim**-0.5, 0, rows),
            "per_query": functools.partial(kernel, q, pool, per_query_table, lens, dim**-0.5, 0),
        }
        same_bits = torch.equal(paths["tiled"](), paths["per_query"]())
        best = {name: float("inf") for name in paths}
        for _ in range(args.rounds):
            for name, fn in paths.items():
                best[name] = min(best[name], cpu_seconds(fn))
        result = {
            "prompt_len": length,
            "heads": args.heads,
            "threads": args.threads,
            "tiled_ms": round(best["tiled"] * 1e3, 2),
            "per_query_ms": round(best["per_query"] * 1e3, 2),
            "per_query_over_tiled": round(best["per_query"] / best["tiled"], 2),
            "same_bits": same_bits,
        }
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
