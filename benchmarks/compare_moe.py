"""trident against vLLM CPU and llama.cpp on a Qwen3-30B-A3B-like mixture of experts, back to back.

    # the full benchmark (writes the checkpoint and its GGUF once into ~/.cache/trident)
    python benchmarks/compare_moe.py --output-json benchmarks/results/compare_moe.json

    # only write the files
    python benchmarks/compare_moe.py --write-only

    # a smoke test of the whole path (about a minute once the kernels are built)
    python benchmarks/compare_moe.py --shape tiny --stream-prompts 1 --concurrency 4 --output-len 8

1. The model (sparse_checkpoint.py): `--shape` (`MOE_SHAPES`: qwen3-30b-a3b, tiny), a
   Qwen3-MoE with random weights and SmolLM2's tokenizer, written once as bf16 safetensors
   (~/.cache/trident/moe-SHAPE-bf16) and as a Q8_0 `qwen3moe` GGUF of the same weights
   (~/.cache/trident/moe-SHAPE-q8_0.gguf), with the gguf package.
2. The host's memory read rate on `--roofline-threads` torch threads (roofline.py), before
   any server starts, and the bytes of weights one token reads in each file (moe_floor.py):
   the memory floor of one stream.
3. Each round, each of `--engines` in turn (they never share the CPU), the two workloads of
   compare_llamacpp.py: one stream (`--stream-prompts` requests one after another) and
   `--concurrency` requests at once, `--input-len` random prompt tokens and `--output-len`
   forced greedy output tokens each:
   - trident-bf16: launch.py on the checkpoint; trident-gguf: on the GGUF with
     `--weight-dtype gguf` (compare_llamacpp.py's run_trident);
   - vllm: vLLM CPU's OpenAI server on the checkpoint, from its own venv (compare_vllm.py's
     run_engine); if it cannot serve the model, its error is recorded in one line;
   - llamacpp: llamacpp_bench.py on the GGUF, in process, from its own venv.
   An engine whose venv is missing is skipped and named.

Output tok/s counts prefill and decode (output tokens / the workload's wall time); one
stream's "decode" figure is decode alone (1 / median TPOT; llama.cpp: its decode loop),
which the memory floor bounds. Each figure is the median over `--rounds`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import workload_spec  # noqa: E402
from compare_llamacpp import run_llamacpp, run_trident, served_figures, workloads  # noqa: E402
from compare_vllm import comma_list, run_engine  # noqa: E402
from dense_checkpoint import progress  # noqa: E402
from launched_server import REPO_ROOT  # noqa: E402
from moe_floor import checkpoint_active_bytes, gguf_active_bytes, host_read_gb_s, memory_floor_tok_s  # noqa: E402
from serving_report import write_json  # noqa: E402
from serving_workload import build_workload, load_tokenizer  # noqa: E402
from sparse_checkpoint import GGUF_QUANT, MOE_SHAPES, write_moe_checkpoint_gguf, write_random_moe_checkpoint  # noqa: E402

ENGINES = ("trident-bf16", "trident-gguf", "vllm", "llamacpp")

READS_GGUF = {"trident-bf16": False, "trident-gguf": True, "vllm": False, "llamacpp": True}
"""Which file's bytes bound each engine: the GGUF's blocks, or the bf16 checkpoint."""


def model_files(args: argparse.Namespace) -> dict[str, str]:
    """The checkpoint directory and the GGUF of `args.shape`, written where absent."""
    cache = args.export_dir or os.path.expanduser("~/.cache/trident")
    checkpoint = write_random_moe_checkpoint(args.shape, os.path.join(cache, f"moe-{args.shape}-bf16"))
    gguf = write_moe_checkpoint_gguf(checkpoint, os.path.join(cache, f"moe-{args.shape}-{GGUF_QUANT.lower()}.gguf"))
    return {"checkpoint": checkpoint, "gguf": gguf}


def missing_peer(engine: str, args: argparse.Namespace) -> str | None:
    """Why a peer engine cannot run here (its venv or package is absent), else None."""
    python, module = {"vllm": (args.vllm_python, "vllm"), "llamacpp": (args.llamacpp_python, "llama_cpp")}.get(
        engine, (None, None)
    )
    if python is None:
        return None
    if not os.path.isfile(python):
        return f"{python} does not exist"
    done = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"{python} cannot import {module}"


def last_error_line(log_path: str) -> str:
    """The last line of a server log that names an error: what it said when it gave up."""
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(empty log)"])[-1]


def run_vllm(args: argparse.Namespace, files: dict[str, str], log_dir: str) -> dict[str, Any]:
    """vLLM's tok/s per workload (and one stream's decode alone), as run_trident gives trident's."""
    tokenizer = load_tokenizer(files["checkpoint"])
    labelled = {name: (ns, build_workload(workload_spec(ns), tokenizer)) for name, ns in workloads(args).items()}
    served = {"name": args.shape, "vllm": files["checkpoint"]}
    runs = run_engine("vllm", args, served, labelled, log_dir)
    return {k: v for name, run in runs.items() for k, v in served_figures(name, run).items()}


def run_one(engine: str, args: argparse.Namespace, files: dict[str, str], log_dir: str) -> dict[str, Any]:
    if engine == "trident-bf16":
        return run_trident("bf16", args, files["checkpoint"], log_dir)
    if engine == "trident-gguf":
        return run_trident("gguf", args, files["gguf"], log_dir)
    if engine == "llamacpp":
        return run_llamacpp(args, files["gguf"])
    try:
        return run_vllm(args, files, log_dir)
    except RuntimeError as e:  # it exited or never became ready: say why, go on with the others
        logs = sorted(f for f in os.listdir(log_dir) if f.startswith("compare_vllm-vllm-"))
        reason = last_error_line(os.path.join(log_dir, logs[-1])) if logs else str(e)
        progress(f"vllm cannot serve {files['checkpoint']}: {reason}")
        return {"error": reason}


def summary(rounds: list[dict[str, dict[str, Any]]], engine: str, key: str) -> float | None:
    values = [r[engine][key] for r in rounds if isinstance(r.get(engine, {}).get(key), float | int)]
    return statistics.median(values) if values else None


def report_table(args: argparse.Namespace, rounds: list[dict[str, Any]], floors: dict[str, float]) -> str:
    """A markdown table: each engine's median tok/s, its memory floor, the fraction reached."""
    stream, batch = list(workloads(args))
    lines = [
        f"| engine | one stream tok/s | one stream decode tok/s | memory floor tok/s | fraction | {batch} tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for engine in args.engines:
        first = rounds[0].get(engine, {})
        if "skipped" in first or "error" in first:
            lines.append(f"| {engine} | {first.get('skipped') or first['error']} | | | | |")
            continue
        out, decode, many = (summary(rounds, engine, k) for k in (stream, f"{stream} decode only", batch))
        floor = floors["gguf" if READS_GGUF[engine] else "checkpoint"]
        fraction = f"{decode / floor:.2f}" if decode else "—"
        cells = [f"{x:.1f}" if x is not None else "—" for x in (out, decode, floor, many)]
        lines.append(f"| {engine} | {cells[0]} | {cells[1]} | {cells[2]} | {fraction} | {cells[3]} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--shape", choices=sorted(MOE_SHAPES), default="qwen3-30b-a3b")
    m.add_argument("--export-dir", default=None, help="where the files are written (default: ~/.cache/trident)")
    m.add_argument("--write-only", action="store_true", help="write the checkpoint and the GGUF, then stop")
    w = p.add_argument_group("workloads")
    w.add_argument("--stream-prompts", type=int, default=4, help="requests of the one-stream workload")
    w.add_argument("--concurrency", type=int, default=32, help="requests at once of the other workload")
    w.add_argument("--input-len", type=int, default=64)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--seed", type=int, default=1)
    r = p.add_argument_group("engines")
    r.add_argument("--engines", type=comma_list(ENGINES), default=list(ENGINES), help="in this order each round")
    r.add_argument("--rounds", type=int, default=1)
    r.add_argument("--dtype", default="bfloat16", help="trident's and vLLM's activation dtype")
    r.add_argument("--max-total-tokens", type=int, default=8192, help="trident's KV pool, in tokens")
    r.add_argument("--trident-args", default="--max-running-requests 64")
    r.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="the python of vLLM's own venv")
    # On CPU, vLLM's worker takes this fraction of the host's memory for weights and KV cache
    # together: the bf16 experts need more of it than compare_vllm.py's dense models.
    r.add_argument("--vllm-args", default="--max-num-seqs 64 --max-model-len 2048 --gpu-memory-utilization 0.4")
    r.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python")
    r.add_argument("--llamacpp-threads", type=int, default=2)
    r.add_argument("--roofline-threads", type=int, default=2, help="torch threads of the memory read measurement")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    files = model_files(args)
    if args.write_only:
        return 0
    active = {"checkpoint": checkpoint_active_bytes(files["checkpoint"]), "gguf": gguf_active_bytes(files["gguf"])}
    progress(f"measuring the host's memory read rate on {args.roofline_threads} threads")
    read_gb_s = host_read_gb_s(args.roofline_threads)
    floors = {name: memory_floor_tok_s(a, read_gb_s) for name, a in active.items()}
    progress(f"read {read_gb_s:.1f} GB/s; bytes a token reads: {active}; one stream's floors (tok/s): {floors}")
    log_dir = os.path.join(REPO_ROOT, "benchmarks", "results")
    os.makedirs(log_dir, exist_ok=True)
    skipped = {e: reason for e in args.engines if (reason := missing_peer(e, args))}
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        one: dict[str, Any] = {"loadavg_before": os.getloadavg()}
        for engine in args.engines:
            progress(f"round {i + 1}/{args.rounds}: {engine}")
            one[engine] = {"skipped": skipped[engine]} if engine in skipped else run_one(engine, args, files, log_dir)
        one["loadavg_after"] = os.getloadavg()
        rounds.append(one)
    table = report_table(args, rounds, floors)
    print(f"\n{table}\n(memory floor: {read_gb_s:.1f} GB/s over the weight bytes one token reads)")
    if args.output_json:
        report = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "args": vars(args),
            "files": files,
            "read_gb_s": read_gb_s,
            "active_bytes": {name: vars(a) | {"total": a.total} for name, a in active.items()},
            "floor_tok_s": floors,
            "table": table,
            "rounds": rounds,
        }
        write_json(report, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
