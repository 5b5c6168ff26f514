"""trident's served throughput against Hugging Face transformers static batching, same workload, one run.

What it measures: output tokens per second of wall time for the same requests (same prompts,
same output lengths: the workload comes from bench_serving.build_workload with the same seed)

1. served by trident: it starts `launch.py` on a free port (`--dtype` as given), sends the
   workload through bench_serving (streamed /v1/completions, ignore_eos, min_tokens = max_tokens,
   all requests at once unless `--max-concurrency`), and stops the server;
2. through `transformers` `generate()` in static batches of `--hf-batch-size` (16) in request
   order, left padding, greedy, `min_new_tokens = max_new_tokens` = the largest output asked for
   in the batch (what a user of `generate()` would do); only the requested tokens count as
   useful output, the rest of each row is padding waste. Same dtype, same torch threads, model
   loaded from the same GGUF with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`.

It reports both throughputs and trident / HF (issue 8's goal: at least 3x on the mixed workload).
trident is stopped before HF runs, so the two never share the CPU.

Run from the repository root, e.g.:

    python benchmarks/compare_hf.py --dtype bfloat16 --dataset mixed \\
        --output-json benchmarks/results/compare_hf_bf16.json
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import add_workload_args, build_parser, run_against, workload_spec  # noqa: E402
from launched_server import REPO_ROOT, LaunchedServer  # noqa: E402
from serving_report import write_json  # noqa: E402
from serving_workload import BenchRequest, build_workload, load_tokenizer, workload_stats  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class HFResult:
    load_s: float
    duration_s: float
    useful_output_tokens: int
    generated_tokens: int
    """Rows x max_new_tokens, padding waste included."""
    batch_seconds: list[float]
    request_latency_s: list[float]
    """Each request's finish time if all were submitted at t=0 (its batch's end)."""

    @property
    def output_throughput(self) -> float:
        return self.useful_output_tokens / self.duration_s


def resolve_model_path(model: str | None) -> str:
    """A packaged model's GGUF (trident's default when None), or the path as given."""
    sys.path.insert(0, REPO_ROOT)
    from trident.model_source import DEFAULT_MODEL, PACKAGED_MODELS, packaged_model_path

    name = model or DEFAULT_MODEL
    return packaged_model_path(name) if name in PACKAGED_MODELS else name


def load_hf_model(model_path: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(model_path))
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def batches(requests: Sequence[BenchRequest], size: int) -> list[list[BenchRequest]]:
    return [list(requests[i : i + size]) for i in range(0, len(requests), size)]


def generate_batch(model: Any, tokenizer: Any, batch: Sequence[BenchRequest], max_new: int | None = None) -> int:
    """One static batch through generate(); the number of new tokens per row (checked equal for all)."""
    enc = tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True)
    n = max_new or max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    produced = int(out.shape[1] - enc["input_ids"].shape[1])
    if produced != n:
        raise RuntimeError(f"generate() produced {produced} new tokens per row, expected {n}")
    return produced


def run_hf(
    model_path: str, dtype: torch.dtype, tokenizer: Any, requests: Sequence[BenchRequest], batch_size: int
) -> HFResult:
    """Load the model, warm up on a tiny batch, then time every static batch."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    t0 = time.perf_counter()
    model = load_hf_model(model_path, dtype)
    load_s = time.perf_counter() - t0
    print(f"  HF model loaded in {load_s:.1f} s; warming up", file=sys.stderr, flush=True)
    generate_batch(model, tokenizer, requests[:2], max_new=4)
    groups = batches(requests, batch_size)
    batch_seconds: list[float] = []
    latencies: list[float] = []
    useful = generated = 0
    start = time.perf_counter()
    for i, batch in enumerate(groups):
        t = time.perf_counter()
        n = generate_batch(model, tokenizer, batch)
        batch_seconds.append(time.perf_counter() - t)
        useful += sum(r.output_len for r in batch)
        generated += n * len(batch)
        latencies += [time.perf_counter() - start] * len(batch)
        print(
            f"  HF batch {i + 1}/{len(groups)}: {len(batch)} rows x {n} new tokens in {batch_seconds[-1]:.1f} s "
            f"({sum(r.output_len for r in batch) / batch_seconds[-1]:.1f} useful tok/s)",
            file=sys.stderr,
            flush=True,
        )
    return HFResult(load_s, time.perf_counter() - start, useful, generated, batch_seconds, latencies)


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench_serving's options for the trident run: its defaults, this run's workload and load."""
    ns = build_parser().parse_args([])
    for key, value in vars(args).items():
        if hasattr(ns, key):
            setattr(ns, key, value)
    ns.label = f"trident-{args.dtype}"
    ns.concurrency_sweep = None
    return ns


def run_trident(args: argparse.Namespace, model_path: str, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    cmd = f"{shlex.quote(sys.executable)} launch.py --model {shlex.quote(model_path)} --dtype {args.dtype} "
    cmd += args.trident_args
    log = os.path.join(REPO_ROOT, "benchmarks", "results", f"compare_hf-trident-{time.strftime('%Y%m%d-%H%M%S')}.log")
    ns = bench_args(args)
    ns.launch, ns.launch_cwd = cmd, args.trident_root
    with LaunchedServer(cmd, log, cwd=args.trident_root) as server:
        return run_against(server.base_url, ns, requests)


def hf_summary(hf: HFResult, batch_size: int) -> dict[str, Any]:
    return {
        "batch_size": batch_size,
        "load_s": hf.load_s,
        "duration_s": hf.duration_s,
        "useful_output_tokens": hf.useful_output_tokens,
        "generated_tokens": hf.generated_tokens,
        "padding_waste": 1 - hf.useful_output_tokens / hf.generated_tokens,
        "output_throughput": hf.output_throughput,
        "generated_throughput": hf.generated_tokens / hf.duration_s,
        "batch_seconds": hf.batch_seconds,
        "e2e_latency_mean_s": statistics.fmean(hf.request_latency_s),
        "e2e_latency_median_s": statistics.median(hf.request_latency_s),
    }


def print_report(served: dict[str, Any], hf: dict[str, Any], dtype: str) -> float:
    ratio = served["output_throughput"] / hf["output_throughput"]
    print(f"\n{'=' * 20} trident vs HF transformers ({dtype}) {'=' * 20}")
    print(f"{'':32}{'trident':>14}{'HF static':>14}")
    print(f"{'output tok/s (requested tokens)':32}{served['output_throughput']:>14.1f}{hf['output_throughput']:>14.1f}")
    print(f"{'wall time (s)':32}{served['duration_s']:>14.2f}{hf['duration_s']:>14.2f}")
    print(f"{'output tokens counted':32}{served['total_output_tokens']:>14}{hf['useful_output_tokens']:>14}")
    print(
        f"{'median end-to-end latency (s)':32}{served['e2e_latency_ms']['median'] / 1000:>14.2f}"
        f"{hf['e2e_latency_median_s']:>14.2f}"
    )
    print(f"HF padding waste: {hf['padding_waste']:.0%} of generated tokens; trident failures: {served['failed']}")
    print(f"ratio trident / HF: {ratio:.2f}x (issue 8 goal on the mixed workload: >= 3x)")
    return ratio


def build_compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_workload_args(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="for trident and HF alike")
    p.add_argument(
        "--model",
        "--model-path",
        dest="model_path",
        default=None,
        help="a packaged model (smollm2-135m, gemma-3-270m), a .gguf or an HF directory (default: smollm2-135m)",
    )
    p.add_argument("--trident-root", default=REPO_ROOT, help="the trident checkout whose launch.py is started")
    p.add_argument("--trident-args", default="", help="extra launch.py flags, e.g. '--disable-overlap'")
    p.add_argument("--max-concurrency", type=int, default=None, help="for the trident run (default: all at once)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="for the trident run")
    p.add_argument("--warmup-requests", type=int, default=2, help="untimed short requests to trident first")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads for HF (0: torch's default)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_compare_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model_path)
    tokenizer = load_tokenizer(args.tokenizer if args.tokenizer != "auto" else model_path)
    requests = build_workload(workload_spec(args), tokenizer)
    print(f"workload: {workload_stats(requests)}", file=sys.stderr)
    print(f"[1/2] trident ({args.dtype}) from {args.trident_root}", file=sys.stderr, flush=True)
    doc = run_trident(args, model_path, requests)
    served = doc["runs"][0]
    print(
        f"[2/2] HF transformers generate() ({args.dtype}, batches of {args.hf_batch_size}, "
        f"{torch.get_num_threads()} threads)",
        file=sys.stderr,
        flush=True,
    )
    hf = hf_summary(run_hf(model_path, DTYPES[args.dtype], tokenizer, requests, args.hf_batch_size), args.hf_batch_size)
    ratio = print_report(served, hf, args.dtype)
    if args.output_json:
        write_json(
            {
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "dtype": args.dtype,
                "model_path": model_path,
                "torch_threads": torch.get_num_threads(),
                "ratio_trident_over_hf": ratio,
                "trident": doc,
                "hf": hf,
            },
            args.output_json,
        )
    return 0 if served["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
