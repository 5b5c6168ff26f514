"""The cost of batch invariance (on by default) against the previous kernels, in one run.

    python benchmarks/bench_batch_invariance.py --rounds 2

Alternates a default server and one with `--disable-batch-invariance` (oneDNN's linears
above 64 rows, SDPA on prompt chunks), round by round, on three workloads:

- decode-heavy: 64 requests of 64 prompt and 128 output tokens, 32 in flight (32 x 128);
- mixed: bench_serving's `mixed` dataset (48 requests at once, prompts of 32-256 tokens,
  outputs of 16-192);
- prefill-heavy: 16 requests of 1,000 prompt and 16 output tokens, 8 in flight.

Reports each run's output tok/s and, per workload, invariant / previous as the ratio of the
medians over rounds (the cost is 1 minus it), and plots the runs (`--output-png`).
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overlap_spec import comparison_parser, log_dir_of, run_config  # noqa: E402
from serving_report import print_and_write_report  # noqa: E402
from serving_workload import WorkloadSpec, build_workload, load_tokenizer  # noqa: E402

WORKLOADS = {
    # name: (spec, requests in flight)
    "decode_32x128": (
        WorkloadSpec(dataset="random", num_prompts=64, random_input_len=(64, 64), random_output_len=(128, 128)),
        32,
    ),
    "mixed": (WorkloadSpec(dataset="mixed"), 48),
    "prefill_1000x16": (
        WorkloadSpec(dataset="random", num_prompts=16, random_input_len=(1000, 1000), random_output_len=(16, 16)),
        8,
    ),
}
CONFIGS = {"invariant": "", "previous": " --disable-batch-invariance"}


def main(argv: list[str] | None = None) -> int:
    p = comparison_parser(__doc__, "benchmarks/results/batch_invariance.json")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-png", default="benchmarks/results/batch_invariance.png")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ", ".join(WORKLOADS))
    ns = p.parse_args(argv)
    log_dir = log_dir_of(ns)
    tokenizer = load_tokenizer("auto")
    base = f"python launch.py --dtype {ns.dtype} --max-total-tokens 131072 --max-running-requests 64 {ns.extra}"
    runs = []
    for name in ns.workloads.split(","):
        spec, in_flight = WORKLOADS[name]
        requests = build_workload(spec, tokenizer)
        for round_ in range(ns.rounds):
            order = list(CONFIGS) if round_ % 2 == 0 else list(reversed(CONFIGS))
            for config in order:
                run = run_config(f"{name}_{config}_{round_}", base + CONFIGS[config], requests, in_flight, log_dir)
                runs.append({**run, "workload": name, "config": config, "round": round_})
    ratios = {}
    for name in ns.workloads.split(","):
        median = {
            config: statistics.median(
                r["output_tok_s"] for r in runs if r["workload"] == name and r["config"] == config
            )
            for config in CONFIGS
        }
        ratios[name] = {**median, "invariant_over_previous": median["invariant"] / median["previous"]}
    report = {"runs": runs, "ratios": ratios, "loadavg": os.getloadavg()}
    print_and_write_report(report, ns.output_json)
    write_png(runs, ns.output_png)
    return 0


def write_png(runs: list[dict], path: str) -> None:
    """Each run's output tok/s, by workload, invariant beside previous (one dot per round)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no PNG written", file=sys.stderr)
        return
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.6), squeeze=False)
    for ax, name in zip(axes[0], workloads, strict=True):
        for x, config in enumerate(CONFIGS):
            ys = [r["output_tok_s"] for r in runs if r["workload"] == name and r["config"] == config]
            ax.bar(x, statistics.median(ys), color="C0" if config == "invariant" else "C7", alpha=0.6)
            ax.scatter([x] * len(ys), ys, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(CONFIGS)), list(CONFIGS))
        ax.set_title(name)
        ax.set_ylabel("output tok/s")
    fig.suptitle("batch invariance (default) vs --disable-batch-invariance, one run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
