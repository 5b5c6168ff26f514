"""trident on a GGUF as shipped (`--weight-dtype gguf`) and dequantized (`bf16`) against
llama.cpp on the same file, back to back in one run.

    python benchmarks/compare_llamacpp.py --model smollm2-135m --output-json benchmarks/results/llamacpp-smollm2.json
    python benchmarks/compare_llamacpp.py --model gemma-3-270m ...

Per round, for each engine in turn (they never share the CPU): one stream (`--stream-prompts`
requests one after another) and `--concurrency` sequences at once, `--input-len` random
prompt tokens and `--output-len` forced greedy output tokens each.
- trident: launch.py with `--weight-dtype` each of `--weight-dtypes`, the workloads through
  bench_serving (streamed /v1/completions through its OpenAI server), each also as decode
  alone (sequences / median TPOT); then the worker's VmRSS and VmHWM. Its KV pool is
  `--max-total-tokens` tokens, printed in bytes beside.
- llama.cpp: benchmarks/llamacpp_bench.py under `--llamacpp-python` (its own venv, built
  from the sdist for this CPU: docs/benchmarks.md), in process, the same shapes; its RSS.
Output tok/s counts prefill and decode alike (output tokens / wall time of the workload);
llama.cpp's in-process figure has no HTTP, tokenizer or scheduler in it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import run_against, workload_spec  # noqa: E402
from compare_hf import resolve_model_path  # noqa: E402
from compare_vllm import decode_tok_s, fixed_lengths  # noqa: E402
from launched_server import REPO_ROOT, LaunchedServer, child_process  # noqa: E402
from serving_report import write_json  # noqa: E402
from serving_workload import build_workload, load_tokenizer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def proc_status_kb(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def kv_pool_bytes(model_path: str, tokens: int) -> int:
    import torch

    sys.path.insert(0, REPO_ROOT)
    from gpu_worker.model.weights import load_config
    from gpu_worker.runtime.kv_pool import kv_bytes_per_token

    cfg = load_config(model_path)
    return tokens * kv_bytes_per_token(cfg, torch.bfloat16, cfg.num_kv_heads)


def workloads(args: argparse.Namespace) -> dict[str, argparse.Namespace]:
    """name -> the bench_serving namespace of that workload."""
    shapes = {
        "one stream": (args.stream_prompts, 1),
        f"{args.concurrency} x {args.output_len}": (args.concurrency,) * 2,
    }
    return {name: fixed_lengths(args, name, prompts, concurrency) for name, (prompts, concurrency) in shapes.items()}


def served_figures(name: str, run: dict[str, Any]) -> dict[str, float | None]:
    """A served workload's output tok/s, and its decode alone (sequences / median TPOT;
    None where every token after the first arrived in one streamed chunk)."""
    decode = decode_tok_s(run) if run["tpot_ms"]["median"] > 0 else None
    return {name: run["output_throughput"], f"{name} decode only": decode}


def run_trident(weight_dtype: str, args: argparse.Namespace, model_path: str, log_dir: str) -> dict[str, Any]:
    cmd = f"{shlex.quote(sys.executable)} launch.py --model {shlex.quote(model_path)} --weight-dtype {weight_dtype} "
    cmd += f"--max-total-tokens {args.max_total_tokens} {args.trident_args}"
    log = os.path.join(log_dir, f"compare_llamacpp-trident-{weight_dtype}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    tokenizer = load_tokenizer(model_path)
    result: dict[str, Any] = {}
    with LaunchedServer(cmd, log) as server:
        for name, ns in workloads(args).items():
            run = run_against(server.base_url, ns, build_workload(workload_spec(ns), tokenizer))["runs"][0]
            result |= served_figures(name, run)
            print(f"trident {weight_dtype} {name}: {run['output_throughput']:.1f} tok/s, failed {run['failed']}")
        assert server.proc is not None
        result["memory_kb"] = proc_status_kb(child_process(server.proc.pid, "trident::worker[tp0]").pid)
    return result


def run_llamacpp(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, seqs, rounds in (
        ("one stream", 1, args.stream_prompts),
        (f"{args.concurrency} x {args.output_len}", args.concurrency, 1),
    ):
        cmd = [
            args.llamacpp_python,
            os.path.join(HERE, "llamacpp_bench.py"),
            "--model",
            model_path,
            "--seqs",
            str(seqs),
            "--prompt-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--rounds",
            str(rounds),
            "--seed",
            str(args.seed),
            "--threads",
            str(args.llamacpp_threads),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        result[name] = statistics.median(r["output_tok_s"] for r in doc["runs"])
        result[f"{name} decode only"] = statistics.median(r["decode_tok_s"] for r in doc["runs"])
        result[f"{name} memory_kb"] = {"VmRSS": doc["rss_kb"], "VmHWM": doc["hwm_kb"]}
        print(f"llama.cpp {name}: {result[name]:.1f} tok/s ({result[f'{name} decode only']:.1f} decode only)")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a packaged model (smollm2-135m, gemma-3-270m) or a .gguf")
    p.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python")
    p.add_argument(
        "--llamacpp-threads",
        type=int,
        default=2,
        help="llama.cpp's threads (its workers spin at every op: on a loaded machine 1 is steadier)",
    )
    p.add_argument("--weight-dtypes", default="gguf,bf16", help="trident's --weight-dtype values to run")
    p.add_argument("--engines", default="trident,llamacpp", help="which to run, in this order each round")
    p.add_argument("--stream-prompts", type=int, default=4, help="requests of the one-stream workload")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=8192, help="trident's KV pool, in tokens")
    p.add_argument("--trident-args", default="--max-running-requests 64")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    model_path = resolve_model_path(args.model)
    log_dir = os.path.join(REPO_ROOT, "benchmarks", "results")
    os.makedirs(log_dir, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        one: dict[str, Any] = {"loadavg_before": os.getloadavg()}
        for engine in args.engines.split(","):
            if engine == "llamacpp":
                one["llama.cpp"] = run_llamacpp(args, model_path)
            else:
                for weight_dtype in args.weight_dtypes.split(","):
                    one[f"trident {weight_dtype}"] = run_trident(weight_dtype, args, model_path, log_dir)
        one["loadavg_after"] = os.getloadavg()
        rounds.append(one)
    kv = kv_pool_bytes(model_path, args.max_total_tokens)
    file_mib = os.path.getsize(model_path) / 2**20
    print(f"\ntrident's KV pool: {args.max_total_tokens} tokens = {kv / 2**20:.0f} MiB; the file: {file_mib:.0f} MiB")
    print(json.dumps(rounds, indent=1))
    if args.output_json:
        write_json(
            {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "kv_pool_bytes": kv, "rounds": rounds},
            args.output_json,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
