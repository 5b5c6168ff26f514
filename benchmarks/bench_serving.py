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
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_MARKER = "trident ready:"
MIXED_NUM_PROMPTS = 48
MIXED_INPUT_RANGE = (32, 256)
MIXED_OUTPUT_RANGE = (16, 192)

# Used only without a tokenizer (`--tokenizer none`): common English words, mostly one token each.
FALLBACK_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has when who will more no if out so said what up its about into "
    "than them can only other new some time could these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come since "
    "against go came right used take three house small water place light city river garden table window morning "
    "music paper story market winter summer forest animal bridge letter number school family friend question"
).split()


# --------------------------------------------------------------------------- workload


@dataclass
class BenchRequest:
    """One request of a workload: the prompt text and the exact output length to ask for."""

    prompt: str
    prompt_len: int
    """Prompt tokens by the client's tokenizer (words when there is none)."""
    output_len: int


@dataclass
class WorkloadSpec:
    """Everything that decides a workload's prompts and lengths (the RNG is seeded from `seed`)."""

    dataset: str = "mixed"
    num_prompts: int | None = None
    random_input_len: tuple[int, int] = (128, 128)
    random_output_len: tuple[int, int] = (128, 128)
    gsp_num_groups: int = 4
    gsp_prompts_per_group: int = 8
    gsp_system_prompt_len: int = 512
    gsp_question_len: int = 32
    gsp_output_len: int = 64
    seed: int = 1


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '32-256' -> (32, 256)."""
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"bad length range {text!r}: want N or MIN-MAX with 1 <= MIN <= MAX")
    return a, b


def load_tokenizer(spec: str | None) -> Any | None:
    """A Hugging Face tokenizer from a .gguf file or a model directory; 'auto' = trident's default model."""
    if spec is None or spec.lower() == "none":
        return None
    from transformers import AutoTokenizer

    path = spec
    if spec == "auto":
        sys.path.insert(0, REPO_ROOT)
        from model_source import default_model_path

        path = default_model_path()
    if path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return AutoTokenizer.from_pretrained(path)


def single_token_words(tokenizer: Any | None) -> list[str]:
    """Lower-case words that are exactly one token when preceded by a space; sorted, so the set is stable."""
    if tokenizer is None:
        return list(FALLBACK_WORDS)
    candidates = sorted(
        tok[1:]
        for tok in tokenizer.get_vocab()
        if tok.startswith("Ġ") and tok[1:].isascii() and tok[1:].isalpha() and tok[1:].islower() and len(tok) >= 4
    )
    encoded = tokenizer([" " + w for w in candidates], add_special_tokens=False)["input_ids"]
    words = [w for w, ids in zip(candidates, encoded, strict=True) if len(ids) == 1]
    return words or list(FALLBACK_WORDS)


def random_text(rng: random.Random, words: Sequence[str], n: int) -> str:
    """n words, each with a leading space (so each is one token of the tokenizer they came from)."""
    return "".join(" " + rng.choice(words) for _ in range(n))


def gen_random(
    rng: random.Random, words: Sequence[str], num: int, input_len: tuple[int, int], output_len: tuple[int, int]
) -> list[BenchRequest]:
    out = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        out.append(BenchRequest(random_text(rng, words, n_in), n_in, n_out))
    return out


def gen_shared_prefix(rng: random.Random, words: Sequence[str], spec: WorkloadSpec) -> list[BenchRequest]:
    out = []
    for _ in range(spec.gsp_num_groups):
        system = random_text(rng, words, spec.gsp_system_prompt_len)
        for _ in range(spec.gsp_prompts_per_group):
            question = random_text(rng, words, spec.gsp_question_len)
            out.append(
                BenchRequest(system + question, spec.gsp_system_prompt_len + spec.gsp_question_len, spec.gsp_output_len)
            )
    rng.shuffle(out)
    return out


def build_workload(spec: WorkloadSpec, tokenizer: Any | None) -> list[BenchRequest]:
    """The requests of a workload; identical for identical (spec, tokenizer)."""
    rng = random.Random(spec.seed)
    words = single_token_words(tokenizer)
    if spec.dataset == "mixed":
        reqs = gen_random(rng, words, spec.num_prompts or MIXED_NUM_PROMPTS, MIXED_INPUT_RANGE, MIXED_OUTPUT_RANGE)
    elif spec.dataset == "random":
        reqs = gen_random(rng, words, spec.num_prompts or 64, spec.random_input_len, spec.random_output_len)
    elif spec.dataset == "shared-prefix":
        reqs = gen_shared_prefix(rng, words, spec)
    else:
        raise ValueError(f"unknown dataset {spec.dataset!r}")
    if tokenizer is not None:  # the exact count (equal to the word count for single-token words)
        for r in reqs:
            r.prompt_len = len(tokenizer.encode(r.prompt))
    return reqs


# --------------------------------------------------------------------------- one request


@dataclass
class RequestOptions:
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    min_tokens: bool = True
    temperature: float = 0.0


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int
    """Requested output tokens."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    start: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    finished: bool = False
    """A choice carried a finish_reason."""
    error: str = ""


def request_payload(req: BenchRequest, opts: RequestOptions, max_tokens: int | None = None) -> dict[str, Any]:
    n = max_tokens or req.output_len
    body: dict[str, Any] = {
        "model": opts.model,
        "prompt": req.prompt,
        "max_tokens": n,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.min_tokens:
        body["min_tokens"] = n
    return body


def parse_sse_lines(line: str) -> dict[str, Any] | None:
    """The JSON object of one `data:` line; None for other lines and for [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


async def send_request(
    client: httpx.AsyncClient, url: str, req: BenchRequest, opts: RequestOptions, max_tokens: int | None = None
) -> RequestResult:
    """Stream one completion; record chunk arrival times and the server's usage."""
    res = RequestResult(ok=False, prompt_len=req.prompt_len, output_len=max_tokens or req.output_len)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    res.start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=request_payload(req, opts, max_tokens), headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                obj = parse_sse_lines(line)
                if obj is None:
                    continue
                if "error" in obj:
                    res.error = str(obj["error"])[:300]
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = int(obj["usage"].get("prompt_tokens", 0))
                    res.completion_tokens = int(obj["usage"].get("completion_tokens", 0))
                choices = obj.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    res.finished = True
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if res.chunks == 0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - res.start
    if res.completion_tokens == 0:  # a server without include_usage: fall back to chunks
        res.completion_tokens = res.chunks
    res.prompt_tokens = res.prompt_tokens or req.prompt_len
    res.ok = res.chunks > 0 and res.finished
    if not res.ok:
        res.error = f"stream ended after {res.chunks} text chunks without a finish_reason (server failure?)"
    return res


# --------------------------------------------------------------------------- a run


def poisson_delays(rate: float, n: int, seed: int) -> list[float]:
    """Gaps between request sends: exponential with mean 1/rate; all zero for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed ^ 0x5EED)
    return [rng.expovariate(rate) for _ in range(n)]


async def run_requests(
    base_url: str,
    requests: Sequence[BenchRequest],
    opts: RequestOptions,
    rate: float,
    max_concurrency: int | None,
    seed: int,
    progress: bool = True,
    max_tokens: int | None = None,
    timeout_s: float = 3600.0,
) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at `rate`, at most `max_concurrency` in flight); (results, wall s)."""
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=None)
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req", leave=False)

    async def one(client: httpx.AsyncClient, req: BenchRequest) -> RequestResult:
        if sem is None:
            res = await send_request(client, url, req, opts, max_tokens)
        else:
            async with sem:
                res = await send_request(client, url, req, opts, max_tokens)
        bar.update(1)
        return res

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for req, delay in zip(requests, poisson_delays(rate, len(requests), seed), strict=True):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    bar.close()
    for r in results:
        r.start -= t0  # seconds since the run began
    return results, duration


def stats_ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Throughputs and latency statistics of one run (token counts from the server's usage)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "output_len_mismatches": sum(1 for r in ok if r.completion_tokens != r.output_len),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_concurrency": sum(r.latency for r in ok) / duration,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]),
        "e2e_latency_ms": stats_ms([r.latency for r in ok]),
    }


def per_request_table(results: Sequence[RequestResult]) -> dict[str, list[float | int]]:
    return {
        "prompt_tokens": [r.prompt_tokens for r in results],
        "completion_tokens": [r.completion_tokens for r in results],
        "requested_output": [r.output_len for r in results],
        "ttft_s": [round(r.ttft, 5) for r in results],
        "latency_s": [round(r.latency, 5) for r in results],
        "start_s": [round(r.start, 5) for r in results],
    }


def print_summary(title: str, s: dict[str, Any]) -> None:
    print(f"\n{'=' * 18} {title} {'=' * 18}")
    rows = [
        ("Successful / failed requests", f"{s['completed']} / {s['failed']}"),
        ("Outputs not of the asked length", s["output_len_mismatches"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{s['input_throughput']:.1f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Mean concurrency", f"{s['mean_concurrency']:.1f}"),
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        st = s[name]
        rows.append(
            (
                f"{name[:-3].upper()} mean / median / p99 (ms)",
                f"{st['mean']:.1f} / {st['median']:.1f} / {st['p99']:.1f}",
            )
        )
    for k, v in rows:
        print(f"{k:<40}{v:>24}")
    for e in s["errors"]:
        print(f"  error: {e}")


# --------------------------------------------------------------------------- launching trident


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LaunchedServer:
    """`python launch.py ...` on a free port: wait for 'trident ready:', stop with SIGTERM then SIGKILL.

    Its stdout/stderr go to `log_path`. Use as a context manager.
    """

    def __init__(self, command: str, log_path: str, timeout_s: float = 600.0, cwd: str = REPO_ROOT) -> None:
        self.argv = shlex.split(command)
        self.cwd = cwd
        if "--port" not in self.argv:
            self.argv += ["--port", str(free_port())]
        self.port = int(self.argv[self.argv.index("--port") + 1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.ready = threading.Event()
        self._log: Any = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _pump(self, log: Any) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            log.write(line)
            log.flush()
            if line.startswith(READY_MARKER):
                self.base_url = line.split()[2].rstrip("/")
                self.ready.set()

    def start(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = self._log = open(self.log_path, "w")  # closed in stop()
        print(f"starting in {self.cwd}: {shlex.join(self.argv)} (log: {self.log_path})", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(
            self.argv, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        threading.Thread(target=self._pump, args=(log,), daemon=True).start()
        t0 = time.monotonic()
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() - t0 > self.timeout_s:
                self.stop()
                raise RuntimeError(f"server did not become ready (exit {self.proc.returncode}); see {self.log_path}")
        print(
            f"server ready in {time.monotonic() - t0:.1f} s at {self.base_url} (pid {self.proc.pid})",
            file=sys.stderr,
            flush=True,
        )

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the launcher and its children
                self.proc.wait()
        if self._log is not None:
            self._log.close()


# --------------------------------------------------------------------------- driver


def fetch_model_name(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def concurrency_levels(args: argparse.Namespace) -> list[int | None]:
    if args.concurrency_sweep:
        return [int(x) for x in args.concurrency_sweep.split(",") if x.strip()]
    return [args.max_concurrency]


async def warm_up(base_url: str, requests: Sequence[BenchRequest], opts: RequestOptions, n: int) -> None:
    if n <= 0:
        return
    warm = [requests[i % len(requests)] for i in range(n)]
    results, _ = await run_requests(base_url, warm, opts, math.inf, None, 0, progress=False, max_tokens=8)
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


async def flush_cache(base_url: str, api_key: str | None) -> str | None:
    """Empty the server's prefix cache so each run starts cold: trident/SGLang `/flush_cache`,
    vLLM `/reset_prefix_cache`; the path that answered 2xx, or None."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        for path in ("/flush_cache", "/reset_prefix_cache"):
            try:
                resp = await client.post(base_url.rstrip("/") + path, headers=headers)
            except httpx.HTTPError:
                continue
            if resp.is_success:
                return path
    return None


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
        results, duration = await run_requests(
            base_url, requests, opts, args.request_rate, conc, args.seed, progress=not args.disable_tqdm
        )
        summary = summarize(results, duration)
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


def workload_stats(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    ins, outs = [r.prompt_len for r in requests], [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(ins),
        "output_tokens": sum(outs),
        "prompt_len_min_max": [min(ins), max(ins)],
        "output_len_min_max": [min(outs), max(outs)],
    }


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


def write_json(doc: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


def print_and_write_report(report: dict[str, Any], path: str) -> None:
    """Prints a comparison's summary (everything but its per-run details) and saves it all."""
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    write_json(report, path)


def plot_series(docs: Sequence[dict[str, Any]]) -> Iterator[tuple[str, list[int], list[dict[str, Any]]]]:
    for doc in docs:
        runs = sorted(doc["runs"], key=lambda r: r["concurrency"])
        yield doc["label"], [r["concurrency"] for r in runs], runs


def write_png(docs: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Output throughput, and median TTFT / TPOT / E2E latency, against concurrency; one line per result."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no PNG written", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [
        ("output_throughput", "output tok/s", None),
        ("ttft_ms", "median TTFT (ms)", "median"),
        ("tpot_ms", "median TPOT (ms)", "median"),
        ("e2e_latency_ms", "median end-to-end (ms)", "median"),
    ]
    for label, xs, runs in plot_series(docs):
        for ax, (key, _, sub) in zip(axes, panels, strict=True):
            ys = [r[key][sub] if sub else r[key] for r in runs]
            ax.plot(xs, ys, marker="o", label=label)
    for ax, (_, ylabel, _) in zip(axes, panels, strict=True):
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


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
