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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overlap_spec import comparison_parser, fixed_length_workload, log_dir_of, run_config  # noqa: E402
from serving_report import print_and_write_report  # noqa: E402

CONFIGS = [("tp1", ""), ("tp2", "--tp-size 2"), ("dp2", "--dp-size 2")]


def main(argv: list[str] | None = None) -> int:
    ns = comparison_parser(__doc__, "benchmarks/results/parallel.json").parse_args(argv)
    log_dir = log_dir_of(ns)
    base = f"python launch.py --dtype {ns.dtype} --max-total-tokens 65536 --max-running-requests 64 {ns.extra}"
    requests = fixed_length_workload(ns)
    runs = [run_config(label, f"{base} {flags}", requests, ns.concurrency, log_dir) for label, flags in CONFIGS]
    tp1 = runs[0]["output_tok_s"]
    report = {
        "runs": runs,
        "ratio_to_tp1": {r["label"]: r["output_tok_s"] / tp1 for r in runs},
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    print_and_write_report(report, ns.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
