"""The worker alone, in this process: prefill time and decode ms/step at given batch sizes.

    python benchmarks/bench_worker_step.py --dtype bfloat16 --batch-sizes 1,32 --profile 32

It loads the model into a real `Worker` (as `gpu_worker.sim.replay` does) and feeds it
synthetic descriptors: B requests of `--prompt-len` tokens join in one extend step, then
the batch decodes `--decode-steps` tokens, gaining one page per row per step (page size
1), exactly as the scheduler would send it. No scheduler, no sockets: this is the
worker's own cost per step, the number the per-op work in gpu_worker/ moves.

`--profile B` adds a torch.profiler table of decode steps at batch B (top ops by self
CPU time). Output: one JSON line per batch size, and the table.

On a machine shared with other work, wall time per step swings with the load; with
`--threads 1` the process CPU time per step (`decode_cpu_ms_median`) is the steadier
number to compare two versions by.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_worker.runtime.malloc_policy import keep_freed_memory  # noqa: E402
from gpu_worker.runtime.omp_policy import use_passive_omp_wait  # noqa: E402

use_passive_omp_wait()  # before torch loads, as the worker process does
import torch  # noqa: E402

from gpu_worker.layers.packed_linear import PackedLinear  # noqa: E402
from trident.model_source import default_model_path  # noqa: E402
from trident.wire.backend import AddedRequest, BatchDescriptor, ExtendChunk, ForwardMode, PageAppends, StepResult  # noqa: E402
from trident.wire.child import ChildContext  # noqa: E402
from trident.wire.codec import pack_int32, unpack_int32  # noqa: E402
from trident.wire.frontend import SamplingParams  # noqa: E402
from trident.wire.server_args import ServerArgs  # noqa: E402


class SyntheticScheduler:
    """Builds the descriptors a scheduler would send for B equal greedy requests."""

    def __init__(self, worker, batch: int, prompt_len: int, max_new: int, seed: int) -> None:
        self.worker = worker
        self.batch = batch
        self.step_id = worker.state.next_step_id
        self.next_page = 1  # page 0 is the padding page
        self.lens = [0] * batch
        rng = np.random.default_rng(seed)
        self.prompts = [rng.integers(100, 20000, prompt_len) for _ in range(batch)]
        self.max_new = max_new

    def _pages(self, slot: int, n: int) -> tuple[int, int, list[int]]:
        ids = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        first = self.lens[slot]
        self.lens[slot] += n
        return slot, first, ids

    def _send(self, mode: ForwardMode, **fields) -> StepResult:
        desc = BatchDescriptor(self.step_id, int(mode), seq_lens_sum=sum(self.lens), **fields)
        self.step_id += 1
        out = self.worker.step(desc)
        assert isinstance(out, StepResult), out
        return out

    def prefill(self) -> StepResult:
        params = SamplingParams(max_new_tokens=self.max_new, temperature=0.0, ignore_eos=True)
        added = [AddedRequest(s, 0, params) for s in range(self.batch)]
        pages = PageAppends.of_rows(self._pages(s, len(p)) for s, p in enumerate(self.prompts))
        extends = [ExtendChunk(s, pack_int32(p), True) for s, p in enumerate(self.prompts)]
        return self._send(ForwardMode.EXTEND, removed_slots=[], added=added, page_appends=pages, extends=extends)

    def decode(self) -> StepResult:
        pages = PageAppends.of_rows(self._pages(s, 1) for s in range(self.batch))
        return self._send(ForwardMode.DECODE, removed_slots=[], added=[], page_appends=pages, extends=[])

    def finish(self) -> None:
        self._send(
            ForwardMode.IDLE, removed_slots=list(range(self.batch)), added=[], page_appends=PageAppends(), extends=[]
        )


def make_worker(
    model: str,
    dtype: str,
    pool_tokens: int,
    max_running: int,
    weight_dtype: str = "auto",
    compile_decode: str = "off",
    decode_attention: str = "auto",
    linear_weights: str = "auto",
    worker_class: type | None = None,
    **server_args: object,
):
    """A Worker (or `worker_class`) of these settings; `server_args`: any other ServerArgs field."""
    from gpu_worker.runtime.worker import Worker

    args = ServerArgs(
        model_path=model,
        dtype=dtype,
        weight_dtype=weight_dtype,
        compile_decode=compile_decode,
        decode_attention=decode_attention,
        linear_weights=linear_weights,
        max_total_tokens=pool_tokens,
        max_running_requests=max_running,
        run_dir=tempfile.mkdtemp(prefix="trident-bench-"),
        log_level="warning",
        **server_args,
    )
    return (worker_class or Worker)(ChildContext(args, "worker", 0))


def measure(worker, batch: int, prompt_len: int, steps: int, warmup: int) -> dict:
    sched = SyntheticScheduler(worker, batch, prompt_len, steps + warmup + 1, seed=batch)
    t0 = time.perf_counter()
    sched.prefill()
    prefill_s = time.perf_counter() - t0
    for _ in range(warmup):
        sched.decode()
    times, cpu_times, tokens = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = sched.decode()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        tokens.append(unpack_int32(out.next_token_ids)[0])
    sched.finish()
    median = statistics.median(times)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "prefill_ms": prefill_s * 1e3,
        "decode_ms_median": median * 1e3,
        "decode_ms_min": min(times) * 1e3,
        "decode_cpu_ms_median": statistics.median(cpu_times) * 1e3,
        "decode_tok_s": batch / median,
        "row0_tokens": [int(t) for t in tokens[:8]],
    }


def profile(worker, batch: int, prompt_len: int, steps: int) -> str:
    sched = SyntheticScheduler(worker, batch, prompt_len, steps + 4, seed=batch)
    sched.prefill()
    for _ in range(3):
        sched.decode()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            sched.decode()
    sched.finish()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def linear_swaps(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module | None, PackedLinear]]:
    """(parent, attribute, plain layer, packed copy) for every linear layer and the LM head
    (plain: None when the head is tied to the embedding)."""
    swaps = []
    for parent in model.layers.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear):
                bias = None if child.bias is None else child.bias.data
                swaps.append((parent, name, child, PackedLinear(child.weight.data, bias)))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    swaps.append((model, "lm_head", model.lm_head, PackedLinear(head.data, None)))
    return swaps


class Variant(NamedTuple):
    """One configuration of the worker's step, measured in turn with another (the --ab-* flags)."""

    layer_fn: Callable | None
    """The compiled decoder layer, or None for eager."""
    decode_kernel: Callable | None
    packed_weights: bool
    elementwise_ops: object | None
    vnni: object | None
    """The VNNI linear kernel given to every PackedLinear, or None (oneDNN for every batch)."""
    flat_decode: bool
    """Plain decode steps through gpu_worker/model/flat_decode.py (False: the module tree)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weight-dtype", default="auto", choices=["auto", "gguf", "bf16", "int8"])
    p.add_argument("--compile", default="off", choices=["auto", "on", "off"], help="compiled decode steps")
    p.add_argument(
        "--ab-compile",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="compile, then measure each batch size ROUNDS times eager and compiled, alternating",
    )
    p.add_argument("--decode-attention", default="auto", choices=["auto", "kernel", "torch"])
    p.add_argument(
        "--ab-attention",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="build the decode kernel, then measure each batch size ROUNDS times with torch attention and "
        "with the kernel, alternating",
    )
    p.add_argument("--linear-weights", default="auto", choices=["auto", "packed", "plain"])
    p.add_argument(
        "--disable-batch-invariance",
        action="store_true",
        help="the previous kernels (oneDNN above 64 rows, SDPA on prompt chunks); the --ab-linear and "
        "--ab-vnni comparisons are of those kernels",
    )
    p.add_argument(
        "--ab-linear",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="pack a second copy of the linear weights, then measure each batch size ROUNDS times with "
        "plain and with packed weights, alternating",
    )
    p.add_argument(
        "--ab-elementwise",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="measure each batch size ROUNDS times with the torch ops and with the C++ ops for norms, "
        "rotary and SwiGLU (cpu_kernels.ElementwiseKernels), alternating",
    )
    p.add_argument(
        "--ab-vnni",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="measure each batch size ROUNDS times with oneDNN for every linear layer and with decode "
        "batches through the VNNI kernel (csrc/vnni_linear.cpp), alternating",
    )
    p.add_argument(
        "--ab-flat-decode",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="measure each batch size ROUNDS times with decode steps through the modules and through the "
        "flat loop of gpu_worker/model/flat_decode.py, alternating",
    )
    p.add_argument(
        "--glibc-malloc",
        action="store_true",
        help="leave glibc's allocator as it is instead of the worker's policy (malloc_policy.py), for A/B",
    )
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the worker's own choice)")
    p.add_argument("--profile", type=int, default=0, help="batch size to profile (0: none)")
    p.add_argument("--profile-steps", type=int, default=10)
    ns = p.parse_args(argv)
    if not ns.glibc_malloc:
        keep_freed_memory()  # as the worker process does (before the model's allocations)
    batches = [int(b) for b in ns.batch_sizes.split(",")]
    most = max(batches + [ns.profile])
    pool = most * (ns.prompt_len + ns.decode_steps + ns.warmup_steps + 16) + 64
    t0 = time.perf_counter()
    compile_decode = "on" if ns.ab_compile else ns.compile
    decode_attention = "kernel" if ns.ab_attention else ns.decode_attention
    worker = make_worker(
        ns.model or default_model_path(),
        ns.dtype,
        pool,
        max(most, 1),
        ns.weight_dtype,
        compile_decode,
        decode_attention,
        "plain" if ns.ab_linear else ns.linear_weights,
        disable_batch_invariance=ns.disable_batch_invariance,
        cpu_threads=ns.threads,
    )
    print(
        json.dumps(
            {
                "load_s": time.perf_counter() - t0,
                "dtype": str(worker.dtype),
                "threads": torch.get_num_threads(),
                "loadavg": os.getloadavg(),
            }
        ),
        flush=True,
    )
    model = worker.model
    compiled, kernel, elementwise = model.decode_layer, model.decode_kernel, model.norm.kernels
    packed = isinstance(model.lm_head, PackedLinear)
    swaps = linear_swaps(model) if ns.ab_linear else []
    vnni_layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.vnni is not None]
    vnni = vnni_layers[0].vnni if vnni_layers else None
    default = Variant(compiled, kernel, packed, elementwise, vnni, model.flat_decode_enabled)
    ab = {
        "compile": (ns.ab_compile, default._replace(layer_fn=None), default),
        "attention": (ns.ab_attention, default._replace(decode_kernel=None), default),
        "linear": (ns.ab_linear, default._replace(packed_weights=False), default._replace(packed_weights=True)),
        "elementwise": (ns.ab_elementwise, default._replace(elementwise_ops=None), default),
        "vnni": (ns.ab_vnni, default._replace(vnni=None), default),
        "flat_decode": (ns.ab_flat_decode, default._replace(flat_decode=False), default._replace(flat_decode=True)),
    }
    chosen = [(rounds, a, b) for rounds, a, b in ab.values() if rounds]
    rounds, variants = (chosen[0][0], chosen[0][1:]) if chosen else (1, (default,))
    for b in batches:
        for _ in range(rounds):
            for v in variants:
                model.decode_layer = v.layer_fn
                model.use_decode_kernel(v.decode_kernel)
                # Without the kernel, prompt chunks go to SDPA (as --decode-attention torch turns invariance off).
                worker.state.every_query_through_kernel = worker.batch_invariant and v.decode_kernel is not None
                model.use_elementwise_kernels(v.elementwise_ops)
                for parent, name, plain_layer, packed_layer in swaps:
                    setattr(parent, name, packed_layer if v.packed_weights else plain_layer)
                for layer in vnni_layers:
                    layer.vnni = v.vnni
                model.use_flat_decode(v.flat_decode)  # after the swaps: it snapshots the modules
                result = measure(worker, b, ns.prompt_len, ns.decode_steps, ns.warmup_steps)
                result.update(
                    compiled=v.layer_fn is not None,
                    decode_kernel=v.decode_kernel is not None,
                    packed_linear=v.packed_weights,
                    elementwise_kernels=v.elementwise_ops is not None,
                    vnni_linear=v.vnni is not None,
                    flat_decode=v.flat_decode,
                    loadavg=os.getloadavg()[0],
                )
                print(json.dumps(result), flush=True)
    if ns.profile:
        print(profile(worker, ns.profile, ns.prompt_len, ns.profile_steps))
    print(json.dumps({"loadavg_after": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
