"""HTTP load generator for OpenAI-compatible servers (trident, vLLM, SGLang, ...).

What it measures, per run, from streamed `/v1/completions` responses (`stream: true`,
`stream_options: {include_usage: true}`):

- time to first token (TTFT): request sent -> first chunk with text;
- inter-token latency (ITL): the gap between consecutive streamed chunks (one token per
  chunk on trident and vLLM in steady decode; a chunk that carries several tokens counts
  as one gap, as in SGLang's bench_serving);
- time per output token (TPOT): (end-to-end - TTFT) / (output tokens - 1), per request;
- end-to-end latency; each as mean, median and p99 (milliseconds);
- request, input-token and output-token throughput over the run's wall time. Token counts
  come from the server's `usage` (prompt_tokens, completion_tokens), so they are the
  server's own.

Workloads (all from one seeded RNG, so every run and every peer sees the same prompts):

- `random`: prompt and output lengths drawn uniformly from `--random-input-len` and
  `--random-output-len` ranges ("128" or "32-256"). Prompts are random words that are each
  one token of the tokenizer (`--tokenizer`, default: trident's bundled SmolLM2 GGUF), so a
  prompt of N words is N tokens; without a tokenizer (`--tokenizer none`) a built-in word
  list is used and lengths are approximate.
- `shared-prefix`: `--gsp-num-groups` groups of `--gsp-prompts-per-group` requests; each
  group shares a `--gsp-system-prompt-len`-token system prompt followed by its own
  `--gsp-question-len`-token question (requests of all groups shuffled together).
- `mixed`: the mixed workload of issue 8: 48 requests, prompts of 32-256 words, outputs of
  16-192 tokens.

Every request asks for exactly its output length: `max_tokens`, `ignore_eos: true` and
`min_tokens` (`--no-min-tokens` for servers that reject it), greedy (temperature 0).

Examples (from the repository root):

    # a running server, one run of 48 mixed requests, all at once
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --dataset mixed

    # one command: start trident (bf16) on a free port, sweep concurrency, stop it
    python benchmarks/bench_serving.py --launch "python launch.py --dtype bfloat16" \\
        --dataset random --random-input-len 64 --random-output-len 128 --num-prompts 64 \\
        --concurrency-sweep 1,8,32 --label trident-bf16 \\
        --output-json benchmarks/results/trident.json --output-png benchmarks/results/trident.png

    # a peer (vLLM) with the same workload, plotted next to trident's earlier result
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency-sweep 1,8,32 \\
        --dataset random --random-input-len 64 --random-output-len 128 --num-prompts 64 --label vllm \\
        --plot-json benchmarks/results/trident.json --output-png benchmarks/results/vs.png

matplotlib is needed only for `--output-png` (a benchmark-only dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from launched_server import REPO_ROOT, LaunchedServer
from serving_client import RequestOptions, fetch_model_name, flush_cache, run_requests, warm_up
from serving_report import per_request_table, print_summary, summarize, write_json, write_png
from serving_workload import BenchRequest, WorkloadSpec, build_workload, load_tokenizer, parse_range, workload_stats


def concurrency_levels(args: argparse.Namespace) -> list[int | None]:
    if args.concurrency_sweep:
        return [int(x) for x in args.concurrency_sweep.split(",") if x.strip()]
    return [args.max_concurrency]


async def benchmark(
    base_url: str, requests: Sequence[BenchRequest], opts: RequestOptions, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Warm up, then one run per concurrency level; the summaries (with per-request tables)."""
    await warm_up(base_url, requests, opts, args.warmup_requests)
    runs = []
    for conc in concurrency_levels(args):
        flushed = None if args.no_flush_cache else await flush_cache(base_url, opts.api_key)
        print(
            f"\nrun: {len(requests)} requests, max concurrency {conc or 'unlimited'}, "
            f"request rate {args.request_rate}, prefix cache flushed: {flushed or 'no'}",
            file=sys.stderr,
            flush=True,
        )
        load_before = os.getloadavg()[0]
        cpu_before = time.process_time()
        results, duration = await run_requests(
            base_url, requests, opts, args.request_rate, conc, args.seed, progress=not args.disable_tqdm
        )
        client_cpu_s = time.process_time() - cpu_before
        summary = summarize(results, duration)
        # The load generator shares the machine with the server under test: its own CPU says how much it took.
        summary["client_cpu_share"] = client_cpu_s / duration if duration else 0.0
        summary["cache_flushed_via"] = flushed
        summary["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]
        summary["max_concurrency"] = conc
        summary["concurrency"] = conc or len(requests)
        print_summary(f"{args.label or 'run'} @ concurrency {conc or 'unlimited'}", summary)
        summary["requests"] = per_request_table(results)
        runs.append(summary)
    return runs


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        gsp_num_groups=args.gsp_num_groups,
        gsp_prompts_per_group=args.gsp_prompts_per_group,
        gsp_system_prompt_len=args.gsp_system_prompt_len,
        gsp_question_len=args.gsp_question_len,
        gsp_output_len=args.gsp_output_len,
        seed=args.seed,
    )


def result_document(
    args: argparse.Namespace, base_url: str, model: str, requests: Sequence[BenchRequest], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "label": args.label or model,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "base_url": base_url,
        "model": model,
        "launch": args.launch,
        "launch_cwd": args.launch_cwd if args.launch else None,
        "workload": asdict(workload_spec(args)),
        "workload_stats": workload_stats(requests),
        "request_rate": args.request_rate,
        "ignore_eos": not args.no_ignore_eos,
        "min_tokens": not args.no_min_tokens,
        "runs": runs,
    }


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags, shared with compare_hf.py."""
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=["mixed", "random", "shared-prefix"], default="mixed")
    w.add_argument("--num-prompts", type=int, default=None, help="requests (default: mixed 48, random 64)")
    w.add_argument("--random-input-len", type=parse_range, default=(128, 128), help="N or MIN-MAX prompt tokens")
    w.add_argument("--random-output-len", type=parse_range, default=(128, 128), help="N or MIN-MAX output tokens")
    w.add_argument("--gsp-num-groups", type=int, default=4, help="shared-prefix: groups")
    w.add_argument("--gsp-prompts-per-group", type=int, default=8, help="shared-prefix: requests per group")
    w.add_argument("--gsp-system-prompt-len", type=int, default=512, help="shared-prefix: shared tokens")
    w.add_argument("--gsp-question-len", type=int, default=32, help="shared-prefix: per-request tokens")
    w.add_argument("--gsp-output-len", type=int, default=64, help="shared-prefix: output tokens")
    w.add_argument("--seed", type=int, default=1, help="workload and arrival RNG seed")
    w.add_argument(
        "--tokenizer",
        default="auto",
        help="a .gguf or HF directory for exact prompt lengths; 'auto': trident's default model; 'none'",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:30000", help="an OpenAI-compatible server")
    t.add_argument(
        "--launch",
        default=None,
        help='start this trident command on a free port first, e.g. "python launch.py --dtype bfloat16"',
    )
    t.add_argument("--launch-cwd", default=REPO_ROOT, help="directory --launch runs in (another checkout of trident)")
    t.add_argument("--model", default=None, help="the `model` field (default: the first of GET /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (env OPENAI_API_KEY)")
    add_workload_args(p)
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second; inf: all at once")
    r.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    r.add_argument("--concurrency-sweep", default=None, help="e.g. 1,8,32: one run per max concurrency")
    r.add_argument("--warmup-requests", type=int, default=2, help="short untimed requests first")
    r.add_argument("--no-flush-cache", action="store_true", help="keep the prefix cache between runs")
    r.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    r.add_argument("--no-min-tokens", action="store_true", help="do not send min_tokens (strict OpenAI servers)")
    o = p.add_argument_group("output")
    o.add_argument("--label", default=None, help="name of this result in the JSON and the plot")
    o.add_argument("--output-json", default=None)
    o.add_argument("--output-png", default=None)
    o.add_argument("--plot-json", nargs="*", default=[], help="earlier result JSONs to draw in the same PNG")
    o.add_argument("--disable-tqdm", action="store_true")
    return p


def run_against(base_url: str, args: argparse.Namespace, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """The whole benchmark against one server: model name, warm-up, runs; the result document."""
    model = args.model or fetch_model_name(base_url, args.api_key)
    opts = RequestOptions(
        model=model, api_key=args.api_key, ignore_eos=not args.no_ignore_eos, min_tokens=not args.no_min_tokens
    )
    runs = asyncio.run(benchmark(base_url, requests, opts, args))
    return result_document(args, base_url, model, requests, runs)


def launch_log_path(args: argparse.Namespace) -> str:
    stem = args.label or "server"
    return os.path.join(REPO_ROOT, "benchmarks", "results", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.log")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    requests = build_workload(workload_spec(args), load_tokenizer(args.tokenizer))
    print(f"workload: {workload_stats(requests)}", file=sys.stderr)
    if args.launch:
        with LaunchedServer(args.launch, launch_log_path(args), cwd=args.launch_cwd) as server:
            doc = run_against(server.base_url, args, requests)
    else:
        doc = run_against(args.base_url, args, requests)
    if args.output_json:
        write_json(doc, args.output_json)
    if args.output_png:
        others = []
        for path in args.plot_json:
            with open(path) as f:
                others.append(json.load(f))
        write_png([*others, doc], args.output_png, title=f"{args.dataset} workload")
    return 0 if all(r["failed"] == 0 for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
