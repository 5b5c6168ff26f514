"""Tensor vs data parallelism on this machine, measured as ratios in one run.

    python benchmarks/bench_parallel.py --dtype bfloat16 --concurrency 32 --output-len 128

Starts trident three times on the default SmolLM2 (tp 1; tp 2; dp 2 with round-robin
routing), runs the same streaming workload through bench_serving's client against each
(after a short warm-up), and reports output throughput and each configuration's ratio to
tp 1. With two cores, tp 2 splits every matmul in two and pays a gloo all-reduce per layer;
dp 2 runs two whole models side by side, each on one core: neither can beat one process
that already uses both cores for its matmuls, which is what this records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overlap_spec import run_config  # noqa: E402
from bench_serving import WorkloadSpec, build_workload, load_tokenizer  # noqa: E402

CONFIGS = [("tp1", ""), ("tp2", "--tp-size 2"), ("dp2", "--dp-size 2")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--extra", default="", help="more launch.py flags for every configuration")
    p.add_argument("--output-json", default="benchmarks/results/parallel.json")
    ns = p.parse_args(argv)
    log_dir = os.path.join(os.path.dirname(os.path.abspath(ns.output_json)), "logs")
    os.makedirs(log_dir, exist_ok=True)
    base = f"python launch.py --dtype {ns.dtype} --max-total-tokens 65536 --max-running-requests 64 {ns.extra}"
    spec = WorkloadSpec(dataset="random", num_prompts=ns.num_prompts, random_input_len=(ns.input_len, ns.input_len),
                        random_output_len=(ns.output_len, ns.output_len))
    requests = build_workload(spec, load_tokenizer("auto"))
    runs = [run_config(label, f"{base} {flags}", requests, ns.concurrency, log_dir) for label, flags in CONFIGS]
    tp1 = runs[0]["output_tok_s"]
    report = {
        "runs": runs,
        "ratio_to_tp1": {r["label"]: r["output_tok_s"] / tp1 for r in runs},
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    with open(ns.output_json, "w") as f:
        json.dump(report, f, indent=2)
    return 0



if __name__ == "__main__":
    sys.exit(main())
