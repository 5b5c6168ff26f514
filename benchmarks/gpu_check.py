"""One command that proves the CUDA path: parity, syncs, throughput, tensor parallelism.

    python benchmarks/gpu_check.py                     # on a GPU: under 8 minutes on one
    python benchmarks/gpu_check.py --device cpu        # the same checks at tiny sizes (CI)
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --attention-backend triton

`--attention-backend` (default auto: triton on CUDA) picks the worker's kernels; with triton,
decode steps run through the CUDA-graph runner (gpu_worker/runtime/decode_graphs.py; on a CPU
the same runner without capture, the kernels under the Triton interpreter).

It writes one JSON (`--out`) and prints a short table. Every part runs in this process on
the worker's own code (a real `Worker`, fed descriptors as the scheduler sends them), except
tensor parallelism, which needs a process per rank and runs the real server.

(a) parity: a random-weight checkpoint of each family we serve (tests/family_models.py,
    written by transformers' own classes) against transformers on the same device: greedy
    tokens equal in float32, with the decode-graph runner on and off; in bfloat16, top-1
    agreement and the largest logit error over every position of the float32 continuation,
    against transformers in float32.
(b) syncs: steady decode steps on the overlapped path, audited three ways: the worker's
    own counters (seq_lens copies, staged transfers, read-backs), every torch call that
    crosses host and device (gpu_worker/runtime/transfer_audit.py, which counts on a CPU what a GPU
    would do), and the torch profiler (plus `torch.cuda.set_sync_debug_mode` on a GPU). The
    rule: exactly one seq_lens copy per overlapped step, and no other blocking copy.
(c) throughput: ms per decode step and tok/s at 1, 32 and 128 rows on a random-weight
    Llama-3.1-8B-shaped model built on the device (tiny on CPU), with the share of the
    memory-bandwidth limit: the bytes a step must read (weights once, each row's KV) over
    `--bandwidth-gbs` (default per device kind); with graphs on, and the same steps with the
    runner off beside them.
(d) tensor parallelism: the server at --tp-size 2 (two GPUs, or gloo on a CPU) serves the
    float32 greedy tokens of transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.bench_worker_step import SyntheticScheduler, make_worker  # noqa: E402
from gpu_worker.model.decoder import LlamaForCausalLM  # noqa: E402
from gpu_worker.runtime.kv_pool import kv_bytes_per_token  # noqa: E402
from gpu_worker.runtime.transfer_audit import TransferAudit  # noqa: E402
from gpu_worker.runtime.worker import Worker  # noqa: E402
from tests.family_models import FAMILY_CHECKPOINTS, make_family_checkpoint  # noqa: E402
from trident.wire.backend import AddedRequest, BatchDescriptor, ExtendChunk, ForwardMode, PageAppends  # noqa: E402
from trident.wire.codec import pack_int32, unpack_int32  # noqa: E402
from trident.wire.frontend import SamplingParams  # noqa: E402

BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0, "cpu": 60.0}
"""Peak memory bandwidth by device name (GB/s); `cpu` is a guess for two channels of DDR5."""

LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32}
LLAMA_31_8B |= {"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
TINY |= {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000}

TOP1_FLOOR = 0.75
"""bf16 top-1 agreement below this fails. Random weights have near-ties that bf16 flips (one
position in ten on the tiny checkpoints); a broken bf16 path agrees about once per vocabulary."""


def free_memory() -> None:
    """Returns what the workers and models just deleted held (the next part may need it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ (a) parity


def greedy_tokens(worker, prompts: list[np.ndarray], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation, the prompts batched, through the worker's steps."""
    sched = SyntheticScheduler(worker, len(prompts), len(prompts[0]), new_tokens, seed=0)
    sched.prompts = prompts
    out = [[int(t)] for t in unpack_int32(sched.prefill().next_token_ids)]
    for _ in range(new_tokens - 1):
        for row, t in zip(out, unpack_int32(sched.decode().next_token_ids)):
            row.append(int(t))
    sched.finish()
    return out


def all_position_logits(worker, seq: list[int]) -> torch.Tensor:
    """The worker model's logits at every position of `seq` (one extend step), float32 on the host."""
    state = worker.state
    added = [AddedRequest(0, 0, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))]
    pages = PageAppends.of_rows([(0, 0, list(range(1, len(seq) + 1)))])
    extends = [ExtendChunk(0, pack_int32(seq), True)]
    desc = BatchDescriptor(state.next_step_id, int(ForwardMode.EXTEND), [], added, pages, extends, len(seq))
    inputs = state.forward_inputs(state.plan_step(state.apply(desc)))
    every = torch.arange(len(seq), device=worker.device)
    with torch.no_grad():
        logits = worker.model(inputs.input_ids, inputs.positions, worker.kv_pool, inputs.meta, every)
    state.reset(state.next_step_id)
    return logits.float().cpu()


def without_graphs(worker, run, *args):
    """`run(*args)` with the worker's decode-graph runner off (every step eager and unpadded)."""
    graphs, worker.decode_graphs = worker.decode_graphs, None
    try:
        return run(*args)
    finally:
        worker.decode_graphs = graphs


def check_parity(device: str, families: list[str], workdir: str, backend: str, new_tokens: int = 12) -> dict:
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    results = {}
    for name in families:
        path = make_family_checkpoint(os.path.join(workdir, name), name)
        prompts = [rng.integers(100, 20000, 20) for _ in range(2)]  # longer than the sliding windows
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        ref.generation_config.eos_token_id = None
        want = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p.tolist()], device=device)
                out = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
                want.append(out[0, len(p) :].tolist())
            seq = prompts[0].tolist() + want[0]
            ref_logits = ref(torch.tensor([seq], device=device)).logits[0].float().cpu()
        del ref
        free_memory()
        fp32 = make_worker(path, "float32", 256, 4, device=device, attention_backend=backend)
        got = greedy_tokens(fp32, prompts, new_tokens)
        graphs = fp32.decode_graphs is not None
        got_graphs_off = without_graphs(fp32, greedy_tokens, fp32, prompts, new_tokens) if graphs else got
        del fp32
        free_memory()
        bf16 = make_worker(path, "bfloat16", 256, 4, device=device, attention_backend=backend)
        ours = all_position_logits(bf16, seq)
        del bf16
        free_memory()
        top1 = float((ours.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        results[name] = {
            "greedy_fp32_equal": got == want,
            "decode_graphs": graphs,
            "greedy_fp32_equal_graphs_off": got_graphs_off == want,
            "bf16_top1_agreement": top1,
            "bf16_max_logit_error": float((ours - ref_logits).abs().max()),
            "ref_logit_range": float(ref_logits.abs().max()),
        }
    passed = all(
        r["greedy_fp32_equal"] and r["greedy_fp32_equal_graphs_off"] and r["bf16_top1_agreement"] >= TOP1_FLOOR
        for r in results.values()
    )
    return {"passed": passed, "families": results}


# ------------------------------------------------------------------ (b) syncs


class SyncDebug:
    """On CUDA, torch's sync debug mode ("warn") for the block, its warnings counted."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.warnings: Counter[str] = Counter()

    def __enter__(self) -> SyncDebug:
        if self.cuda:
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)
            for w in self._records:
                self.warnings[str(w.message).splitlines()[0][:80]] += 1


PROFILED = ("aten::copy_", "aten::_to_copy", "aten::_local_scalar_dense", "aten::item", "aten::nonzero")
PROFILED_CUDA = ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def profiled_counts(prof, steps: int) -> dict:
    """Per step: the profiled ops above, and each memcpy kind (pageable or pinned) on CUDA."""
    counts: Counter[str] = Counter()
    for e in prof.events():
        if e.name in PROFILED or e.name in PROFILED_CUDA or e.name.startswith("Memcpy"):
            counts[e.name] += 1
    return {k: v / steps for k, v in sorted(counts.items())}


def worker_counters(worker) -> Counter:
    return Counter(
        seq_lens_d2h_copies=worker.state.seq_lens_d2h_copies,
        metadata_transfers=worker.state.staging.transfers,
        sampling_transfers=worker.sampling.staging.transfers,
        readbacks=worker.state.readback.copies,
    )


def check_syncs(device: str, path: str, backend: str, interpreted: bool) -> dict:
    # The interpreter runs each attention program in turn; the rule holds per step at any rows
    # and any number of steps, so it counts over fewer of both.
    rows, warm_up, steps = (2, 2, 2) if interpreted else (8, 4, 6)
    worker = make_worker(path, "auto", 1024, rows, device=device, attention_backend=backend)
    sched = SyntheticScheduler(worker, rows, 24, warm_up + steps + 4, seed=1)
    sched.prefill()
    for _ in range(warm_up):
        sched.decode()
    before = worker_counters(worker)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with SyncDebug(device) as sync, TransferAudit() as audit, torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            sched.decode()
    counters = {k: v / steps for k, v in (worker_counters(worker) - before).items()}
    pinned = worker.state.staging.pinned()  # the sampling staging holds nothing in a greedy step
    sched.finish()
    del worker, sched
    free_memory()
    per_step = {
        "worker_counters": counters,
        "audit": {k: v / steps for k, v in sorted(audit.calls.items())},
        "profiler": profiled_counts(prof, steps),
        "sync_debug_warnings": {k: v / steps for k, v in sync.warnings.items()},
    }
    pageable = sum(v for k, v in per_step["profiler"].items() if "Pageable" in k)
    rule = {
        "one_seq_lens_copy_per_overlapped_step": counters.get("seq_lens_d2h_copies", 0) == 1,
        "no_blocking_copy_to_device": audit.blocking_to_device == 0,
        "no_blocking_copy": audit.blocking_copies == 0,
        "no_host_read_of_a_device_tensor": audit.host_reads == 0,
        "no_pageable_memcpy": pageable == 0,
        "no_sync_debug_warning": not sync.warnings,
    }
    if device == "cuda":  # on a CPU nothing needs pinning
        rule["staging_buffers_pinned"] = pinned
    return {"passed": all(rule.values()), "rule": rule, "rows": rows, "per_step": per_step}


# ------------------------------------------------------------------ (c) throughput


class RandomWeightWorker(Worker):
    """A Worker whose model is built on the device with random weights (no checkpoint to
    read: 16 GB of Llama-3.1-8B would take minutes to write and load)."""

    def load_model(self, model_path: str, *_: object) -> LlamaForCausalLM:
        with torch.device(self.device):
            model = LlamaForCausalLM(self.cfg, self.plan, self.tp)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
        return model.to(device=self.device, dtype=self.dtype).eval()


def write_config(path: str, shape: dict) -> str:
    """A Llama-3.1 config.json of `shape` (no weights: RandomWeightWorker makes them)."""
    os.makedirs(path, exist_ok=True)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope["original_max_position_embeddings"] = 8192
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5}
    config |= {"rope_theta": 500000.0, "rope_scaling": rope, "max_position_embeddings": 131072}
    config |= {"tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config | shape, f)
    return path


def step_bytes(worker, rows: int, kv_len: float) -> float:
    """Bytes a decode step must read: every weight once (the LM head whole, the embedding
    only its rows) and each row's KV."""
    cfg, item = worker.cfg, torch.finfo(worker.dtype).bits // 8
    hd = cfg.head_dim
    attention = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    weights = (cfg.num_layers * (attention + mlp) + cfg.vocab_size * cfg.hidden_size) * item
    return weights + rows * kv_len * kv_bytes_per_token(cfg, worker.dtype, cfg.num_kv_heads)


def median_step_ms(sched, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sched.decode()  # ends reading the sampled tokens back: the step is done on the device
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def check_throughput(
    device: str, workdir: str, bandwidth_gbs: float, rows_list: list[int], backend: str, interpreted: bool
) -> dict:
    shape, prompt_len, steps = (LLAMA_31_8B, 512, 16) if device == "cuda" else (TINY, 32, 8)
    # Under the Triton interpreter a step's time says nothing about a GPU's; the steps only
    # prove that the timing runs, with the runner on and off, so the median takes fewer.
    warm_up, steps = (1, 2) if interpreted else (3, steps)
    path = write_config(os.path.join(workdir, "throughput"), shape)
    pool = max(rows_list) * (prompt_len + 2 * steps + 16)
    worker = make_worker(
        path,
        "bfloat16",
        pool,
        max(rows_list),
        worker_class=RandomWeightWorker,
        device=device,
        attention_backend=backend,
    )
    graphs = worker.decode_graphs is not None
    results = []
    for rows in rows_list:
        sched = SyntheticScheduler(worker, rows, prompt_len, 2 * steps + 4, seed=rows)
        sched.prompts = [p % shape["vocab_size"] for p in sched.prompts]
        sched.prefill()
        for _ in range(warm_up):
            sched.decode()
        ms = median_step_ms(sched, steps)
        ms_off = without_graphs(worker, median_step_ms, sched, steps) if graphs else ms
        sched.finish()
        limit_ms = step_bytes(worker, rows, prompt_len + 3 + steps) / (bandwidth_gbs * 1e9) * 1e3
        results.append(
            {
                "rows": rows,
                "ms_per_step": ms,
                "tok_s": rows / ms * 1e3,
                "bandwidth_share": limit_ms / ms,
                "ms_per_step_graphs_off": ms_off,
            }
        )
    model = {"shape": shape, "dtype": str(worker.dtype), "prompt_len": prompt_len, "bandwidth_gbs": bandwidth_gbs}
    model |= {"attention": worker.attention_backend, "decode_graphs": graphs}
    if graphs:
        model["captured_buckets"] = sorted(worker.decode_graphs.graphs)
    del worker, sched
    free_memory()
    return {"model": model, "results": results}


# ------------------------------------------------------------------ (d) tensor parallelism


def check_tp(device: str, workdir: str, backend: str, family: str = "llama3_rope") -> dict:
    """The server at --tp-size 2 in float32 against transformers' greedy tokens."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"needs two GPUs, this machine has {torch.cuda.device_count()}"}
    import httpx

    from benchmarks.launched_server import LaunchedServer
    from tests.family_models import transformers_greedy

    path = os.path.join(workdir, family)
    if not os.path.isdir(path):
        make_family_checkpoint(path, family)
    prompt = np.random.default_rng(2).integers(100, 20000, 20).tolist()
    want = transformers_greedy(path, prompt, 8)
    flags = f"--tp-size 2 --device {device} --dtype float32 --max-total-tokens 4096 --attention-backend {backend}"
    t0 = time.perf_counter()
    with LaunchedServer(
        f"{sys.executable} launch.py --model {path} {flags}", os.path.join(workdir, "tp2.log"), 300
    ) as s:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
        got = httpx.post(f"{s.base_url}/generate", json=body, timeout=300).json()["output_ids"]
    return {"passed": got == want, "family": family, "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------ the command


def default_bandwidth(device: str) -> float:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return next((gbs for kind, gbs in BANDWIDTH_GBS.items() if kind in name), BANDWIDTH_GBS["H100"])


def table(report: dict) -> str:
    name, backend = report["device_name"], report["attention_backend"]
    lines = [f"gpu_check on {name}, attention {backend} ({report['seconds']:.0f} s)"]
    parity = report["parity"]
    lines.append(f"(a) parity: {'PASS' if parity['passed'] else 'FAIL'}")
    for name, r in parity["families"].items():
        lines.append(
            f"    {name:12s} fp32 greedy {'equal' if r['greedy_fp32_equal'] else 'DIFFERS'}"
            f" (graphs off: {'equal' if r['greedy_fp32_equal_graphs_off'] else 'DIFFERS'})   "
            f"bf16 top-1 {r['bf16_top1_agreement']:.3f}   max logit error {r['bf16_max_logit_error']:.3f}"
        )
    syncs = report["syncs"]
    lines.append(f"(b) syncs: {'PASS' if syncs['passed'] else 'FAIL'} at {syncs['rows']} rows, per step:")
    for key, value in {**syncs["per_step"]["worker_counters"], **syncs["per_step"]["audit"]}.items():
        lines.append(f"    {key:40s} {value:g}")
    for key, ok in syncs["rule"].items():
        lines.append(f"    {'ok  ' if ok else 'FAIL'} {key}")
    tput = report["throughput"]
    graphs = "graphs on" if tput["model"]["decode_graphs"] else "no graph runner"
    lines.append(f"(c) throughput ({tput['model']['dtype']}, {tput['model']['bandwidth_gbs']:g} GB/s, {graphs}):")
    for r in tput["results"]:
        lines.append(
            f"    {r['rows']:4d} rows {r['ms_per_step']:9.2f} ms/step {r['tok_s']:10.1f} tok/s "
            f"{100 * r['bandwidth_share']:5.1f} % of the bandwidth limit "
            f"(runner off: {r['ms_per_step_graphs_off']:.2f} ms/step)"
        )
    tp = report["tp2"]
    lines.append(f"(d) tp 2: {tp.get('skipped') or ('PASS' if tp['passed'] else 'FAIL')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--bandwidth-gbs", type=float, default=0.0, help="memory bandwidth (default: by device name)")
    p.add_argument("--families", default=",".join(FAMILY_CHECKPOINTS))
    p.add_argument(
        "--rows",
        default=None,
        help="batch sizes of (c) (default 1,32,128; 1,2 for triton on a CPU, whose interpreter runs "
        "each program in turn)",
    )
    p.add_argument("--skip-tp", action="store_true", help="leave out (d), the one part that starts a server")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="the worker's kernels (auto: triton on CUDA); triton on a CPU needs TRITON_INTERPRET=1",
    )
    ns = p.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no GPU (use --device cpu for the CPU run)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="trident-gpu-check-")
    families = ns.families.split(",")
    bandwidth = ns.bandwidth_gbs or default_bandwidth(ns.device)
    backend = "triton" if ns.attention_backend == "auto" and ns.device == "cuda" else ns.attention_backend
    backend = "torch" if backend == "auto" else backend
    interpreted = ns.device == "cpu" and backend == "triton"
    rows = [int(r) for r in (ns.rows or ("1,2" if interpreted else "1,32,128")).split(",")]
    parts = {
        "parity": lambda: check_parity(ns.device, families, workdir, backend),
        "syncs": lambda: check_syncs(ns.device, os.path.join(workdir, families[0]), backend, interpreted),
        "throughput": lambda: check_throughput(ns.device, workdir, bandwidth, rows, backend, interpreted),
        "tp2": lambda: {"skipped": "--skip-tp"} if ns.skip_tp else check_tp(ns.device, workdir, backend),
    }
    report = {"device": ns.device, "device_name": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"}
    report["attention_backend"] = backend
    report["torch"] = torch.__version__
    for name, run in parts.items():
        started = time.perf_counter()
        report[name] = run() | {"seconds": time.perf_counter() - started}
    report["seconds"] = time.perf_counter() - t0
    report["passed"] = all(report[k].get("passed", True) is not False for k in ("parity", "syncs", "tp2"))
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))
    print(f"wrote {ns.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
