"""Engine efficiency in paired rounds: served decode throughput ÷ the worker alone replaying the same descriptors.

Issue 8's goal is at least 0.95 with overlap on at 32+ running requests. One round:

1. trident serves the workload (`--launch` with `--record-batches` added; bench_serving's
   client and flags, no warm-up requests, so the recording holds the timed run only);
2. `python -m gpu_worker.sim.replay` drives a freshly loaded worker alone through that recording,
   checks every step samples the served tokens, and reports served and replayed tokens/s.

The two halves of a round run back to back. On a shared host whose speed drifts by tens of
percent within minutes, one recording replayed several times, or served and replayed runs
far apart, measure the drift more than the engine; pairing and taking the median over
rounds is the steadier figure. Run from the repository root, e.g.:

    python benchmarks/bench_engine_efficiency.py --rounds 3 --launch "python launch.py --dtype bfloat16" \\
        --dataset random --num-prompts 64 --random-input-len 64 --random-output-len 128 --max-concurrency 32
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import build_parser, launch_log_path, run_against, workload_spec  # noqa: E402
from launched_server import REPO_ROOT, LaunchedServer  # noqa: E402
from serving_report import write_json  # noqa: E402
from serving_workload import BenchRequest, build_workload, load_tokenizer, workload_stats  # noqa: E402


def one_round(index: int, args, requests: list[BenchRequest], work_dir: str) -> dict[str, Any]:
    """Serve with a recording, then replay it; the replay's report plus the client's view."""
    recording = os.path.join(work_dir, f"round{index}.rec")
    with LaunchedServer(f"{args.launch} --record-batches {recording}", launch_log_path(args)) as server:
        doc = run_against(server.base_url, args, requests)
    report_path = os.path.join(work_dir, f"round{index}.json")
    replay = subprocess.run(
        [sys.executable, "-m", "gpu_worker.sim.replay", recording, "--json", report_path], cwd=REPO_ROOT
    )
    if not os.path.exists(report_path):
        raise RuntimeError(f"round {index}: the replay failed (exit {replay.returncode})")
    with open(report_path) as f:
        report = json.load(f)
    run = doc["runs"][0]
    report["client_output_tokens_per_s"] = run["output_throughput"]
    report["failed_requests"] = run["failed"]
    return report


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--rounds", type=int, default=3, help="serve-then-replay pairs")
    args = p.parse_args(argv)
    if not args.launch:
        p.error("--launch is required: the served run must record its descriptors")
    args.warmup_requests = 0  # warm-up requests would enter the recording and its time span
    args.concurrency_sweep = None
    requests = build_workload(workload_spec(args), load_tokenizer(args.tokenizer))
    print(f"workload: {workload_stats(requests)}", file=sys.stderr)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="trident-efficiency-") as work_dir:
        for i in range(args.rounds):
            r = one_round(i, args, requests, work_dir)
            rounds.append(r)
            print(
                f"round {i + 1}/{args.rounds}: served {r['served_tokens_per_s']:.1f} tok/s, replayed "
                f"{r['replayed_tokens_per_s']:.1f} tok/s, efficiency {r['engine_efficiency']:.3f} "
                f"({r['steps_matched']}/{r['steps']} steps matched the served tokens)",
                file=sys.stderr,
                flush=True,
            )
    efficiencies = [r["engine_efficiency"] for r in rounds]
    summary = {
        "launch": args.launch,
        "workload": workload_stats(requests),
        "max_concurrency": args.max_concurrency,
        "rounds": rounds,
        "engine_efficiency_median": statistics.median(efficiencies),
        "engine_efficiency_min_max": [min(efficiencies), max(efficiencies)],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))
    if args.output_json:
        write_json(summary, args.output_json)
    ok = all(r["steps_mismatched"] == 0 and r["failed_requests"] == 0 for r in rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
