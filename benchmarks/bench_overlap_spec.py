"""Overlap scheduling and n-gram speculative decoding, measured as ratios in one run.

    python benchmarks/bench_overlap_spec.py --dtype bfloat16 --concurrency 32 --output-len 128

For each configuration it starts trident (launch.py), runs the same streaming workload
through bench_serving's client, and reads the scheduler's counters before and after:

- decode throughput with overlap on vs off (the ratio);
- the fraction of the worker's time spent waiting for its next descriptor while it had
  running rows (`worker_idle_s / (worker_busy_s + worker_idle_s)`);
- on a repetitive workload (copying and lightly editing a given text), speculative
  decoding's mean accepted length (1 + accepted drafts per verifying row) and speedup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launched_server import LaunchedServer  # noqa: E402
from serving_client import RequestOptions, run_requests  # noqa: E402
from serving_report import print_and_write_report, summarize  # noqa: E402
from serving_workload import BenchRequest, WorkloadSpec, build_workload, load_tokenizer  # noqa: E402

PASSAGE = (
    "def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result\n"
)


def repetitive_workload(n: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Code to copy with a small edit: the continuation mostly repeats the prompt."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        name = rng.choice(["values", "items", "data", "xs"]) + str(i)
        body = PASSAGE.replace("values", name)
        prompt = f"{body}\n# The same function, copied exactly:\n{body[:40]}"
        reqs.append(BenchRequest(prompt, len(prompt.split()), output_len))
    return reqs


def stats(base_url: str) -> dict[str, Any]:
    return httpx.get(base_url + "/server_info", timeout=30).json()["scheduler_stats"]


def run_config(label: str, launch: str, requests: list[BenchRequest], concurrency: int, log_dir: str) -> dict:
    with LaunchedServer(launch, os.path.join(log_dir, f"{label}.log")) as server:
        # ignore_eos alone fixes the output length; min_tokens would rule out drafting.
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        opts = RequestOptions(model=model, min_tokens=False)
        asyncio.run(run_requests(server.base_url, requests[:4], opts, float("inf"), 4, 0, progress=False))  # warm
        before = stats(server.base_url)
        results, duration = asyncio.run(
            run_requests(server.base_url, requests, opts, float("inf"), concurrency, 0, progress=True)
        )
        after = stats(server.base_url)
    summary = summarize(results, duration)
    busy = after["worker_busy_s"] - before["worker_busy_s"]
    idle = after["worker_idle_s"] - before["worker_idle_s"]
    rows = after["spec_verify_rows"] - before["spec_verify_rows"]
    accepted = after["spec_accepted_drafts"] - before["spec_accepted_drafts"]
    out = {
        "label": label,
        "launch": launch,
        "duration_s": duration,
        "output_tok_s": summary["output_throughput"],
        "worker_wait_fraction": idle / (busy + idle) if busy + idle else 0.0,
        "mean_accepted_length": 1 + accepted / rows if rows else None,
        "descriptor_bytes_last": after["descriptor_bytes"],
        "failed": summary["failed"],
    }
    print(json.dumps(out), flush=True)
    return out


def comparison_parser(description: str, output_json: str) -> argparse.ArgumentParser:
    """The flags every one-run comparison of launch configurations takes."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--extra", default="", help="more launch.py flags for every configuration")
    p.add_argument("--output-json", default=output_json)
    return p


def fixed_length_workload(ns: argparse.Namespace) -> list[BenchRequest]:
    spec = WorkloadSpec(
        dataset="random",
        num_prompts=ns.num_prompts,
        random_input_len=(ns.input_len, ns.input_len),
        random_output_len=(ns.output_len, ns.output_len),
    )
    return build_workload(spec, load_tokenizer("auto"))


def log_dir_of(ns: argparse.Namespace) -> str:
    log_dir = os.path.join(os.path.dirname(os.path.abspath(ns.output_json)), "logs")
    os.makedirs(log_dir, exist_ok=True)
    return log_dir


def main(argv: list[str] | None = None) -> int:
    ns = comparison_parser(__doc__, "benchmarks/results/overlap_spec.json").parse_args(argv)
    log_dir = log_dir_of(ns)
    base = f"python launch.py --dtype {ns.dtype} --max-total-tokens 131072 --max-running-requests 64 {ns.extra}"
    plain = fixed_length_workload(ns)
    repetitive = repetitive_workload(ns.num_prompts // 2, ns.output_len, seed=1)
    runs = [
        run_config("overlap_on", base, plain, ns.concurrency, log_dir),
        run_config("overlap_off", base + " --disable-overlap", plain, ns.concurrency, log_dir),
        run_config("repetitive_spec_off", base, repetitive, ns.concurrency, log_dir),
        run_config(
            "repetitive_spec_ngram",
            base + " --speculative-algorithm ngram --speculative-num-draft-tokens 4",
            repetitive,
            ns.concurrency,
            log_dir,
        ),
    ]
    by = {r["label"]: r for r in runs}
    report = {
        "runs": runs,
        "overlap_speedup": by["overlap_on"]["output_tok_s"] / by["overlap_off"]["output_tok_s"],
        "spec_speedup": by["repetitive_spec_ngram"]["output_tok_s"] / by["repetitive_spec_off"]["output_tok_s"],
        "loadavg": os.getloadavg(),
    }
    print_and_write_report(report, ns.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
