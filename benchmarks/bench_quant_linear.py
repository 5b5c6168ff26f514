"""Linear layers on quantized weights (gpu_worker/layers/quant_linear.py) against the bf16 path
(packed_linear.PackedLinear: the VNNI kernel up to 64 rows, oneDNN above), in one run.

    python benchmarks/bench_quant_linear.py [--model smollm2|gemma3|both] [--rows 1,4,32,64,300]

For each linear shape of the model (SmolLM2-135M, Gemma 3 270M), random weights in the U4
layout (what Q4_0/Q4_1/Q4_K become), the I8 layout (Q8_0/Q5_0 with block 32, Q6_K with
block 16), the I5 layout (Q5_0) and the I6 layout (Q6_K), and the same weights dequantized
to bf16. Each shape gets as many distinct copies
as make ~`--stream-mb` of bf16 weights, and a timed pass calls every copy once: the weights
come from memory, as in a decode step, not from cache. Times are microseconds per call (one
copy), the best of `--repeats` passes, the variants taking turns within each repeat.
`--step` instead times one decode step's linear layers of SmolLM2 as its file ships them
(30 layers of distinct Q4_1 weights as U4, the tied Q8_0 head as I8/32) against bf16, ms.
`--file PATH.gguf` instead times the real linear layers of that file as the worker loads
them (`--weight-dtype gguf`), called in a decode step's order (each layer's q/k/v, o,
gate/up, down, then the head), `--rows` each: µs per call by kind and ms per step, the
weights coming from memory as in a step; `--threads` 1,2 alternates thread counts.
`--paths` instead times the quantized kernel's paths against each other on the same weights
(AMX-INT8 and AVX512-VNNI, each where the CPU has it; the same bits): µs per call, medians
of `--repeats` passes, the paths taking turns within each, and AMX / VNNI.
`--clock thread` times one thread's CPU time instead of the wall clock (and runs one
thread): on cores shared with other work, the ratios then hold still. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_worker.runtime.omp_policy import use_passive_omp_wait  # noqa: E402

use_passive_omp_wait()  # before torch loads, as the worker process does (its threads' wait decides --threads 1,2)
import torch  # noqa: E402

from gpu_worker.kernels.cpu_kernels import load_vnni_linear, load_widening_bf16_linear  # noqa: E402
from gpu_worker.layers.packed_linear import Bf16KernelLinear, PackedLinear  # noqa: E402
from gpu_worker.layers.quant_linear import QuantLinear  # noqa: E402

SHAPES = {
    "smollm2": {
        "q,o": (576, 576),
        "k,v": (192, 576),
        "gate,up": (1536, 576),
        "down": (576, 1536),
        "head": (49152, 576),
    },
    "gemma3": {
        "q": (1024, 640),
        "k,v": (256, 640),
        "o": (640, 1024),
        "gate,up": (2048, 640),
        "down": (640, 2048),
        "head": (262144, 640),
    },
}
"""(out, in) of each linear shape: SmolLM2-135M and Gemma 3 270M."""


def random_layers(n: int, k: int) -> dict[str, QuantLinear]:
    """One weight shape in each layout, scales that fit float16 as the GGUF formats' do."""
    scales = (torch.rand(n, k // 32) * 0.02 + 0.001).half().float()
    layers = {
        "U4": QuantLinear.from_u4(torch.randint(0, 16, (n, k), dtype=torch.uint8), scales, -8 * scales, None),
        "I8/32": QuantLinear.from_i8(torch.randint(-127, 128, (n, k), dtype=torch.int8), scales / 8, 32, None),
    }
    scales16 = torch.rand(n, k // 16) * 0.003 + 1e-4  # Q6_K's d * sc: float32 scales
    layers["I8/16"] = QuantLinear.from_i8(torch.randint(-32, 32, (n, k), dtype=torch.int8), scales16, 16, None)
    layers["I5"] = QuantLinear.from_i5(torch.randint(-16, 16, (n, k), dtype=torch.int8), scales / 2, None)
    layers["I6"] = QuantLinear.from_i6(torch.randint(-32, 32, (n, k), dtype=torch.int8), scales16, None)
    return layers


def bf16_layer(weight: torch.Tensor) -> torch.nn.Module:
    vnni = load_vnni_linear()
    if vnni is not None or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return PackedLinear(weight, None, vnni)
    return Bf16KernelLinear(weight, None, load_widening_bf16_linear())


def best_us(variants: dict[str, list[torch.nn.Module]], x: torch.Tensor, repeats: int, clock) -> dict[str, float]:
    """Each variant's best microseconds per layer call over `repeats` passes through its copies."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for label, layers in variants.items():
            t0 = clock()
            for layer in layers:
                layer(x)
            best[label] = min(best[label], (clock() - t0) / len(layers) * 1e6)
    return best


def bench_shape(name: str, n: int, k: int, rows_list: list[int], stream_mb: int, repeats: int, clock) -> list[str]:
    copies = max(1, (stream_mb << 20) // (n * k * 2))
    quant = [random_layers(n, k) for _ in range(copies)]
    variants = {kind: [layers[kind] for layers in quant] for kind in quant[0]}
    # The bf16 weights are U4's, dequantized: the same matrix in both.
    variants = {"bf16": [bf16_layer(layers["U4"].dequantize().bfloat16()) for layers in quant], **variants}
    lines = []
    for rows in rows_list:
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        us = best_us(variants, x, repeats if rows <= 64 else max(2, repeats // 4), clock)
        ratios = " | ".join(f"{us[label]:.0f} ({us['bf16'] / us[label]:.2f}x)" for label in us if label != "bf16")
        lines.append(f"| {name} {k}->{n} | {rows} | {copies} | {us['bf16']:.0f} | {ratios} |")
        print(lines[-1], flush=True)
    return lines


def bench_paths(name: str, n: int, k: int, rows_list: list[int], stream_mb: int, repeats: int, clock) -> None:
    """Each layout's µs per call on each kernel path the CPU has, medians of alternating passes."""
    copies = max(1, (stream_mb << 20) // (n * k * 2))
    quant = [random_layers(n, k) for _ in range(copies)]
    paths = [p for p in ("avx512_vnni", "amx_int8") if p in KERNEL_PATHS.get(quant[0]["U4"].kernel_path, ())]
    for kind in quant[0]:
        fns = {}
        for path in paths:
            for layers in quant:
                layers[kind].kernel_path = path
            fns[path] = [layers[kind].rows_fn() for layers in quant]
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            times: dict[str, list[float]] = {path: [] for path in paths}
            for _ in range(repeats):
                for path in paths:
                    t0 = clock()
                    for fn in fns[path]:
                        fn(x)
                    times[path].append((clock() - t0) / copies * 1e6)
            us = {path: statistics.median(t) for path, t in times.items()}
            cells = " | ".join(f"{us[path]:.1f}" for path in paths)
            ratio = f"{us['amx_int8'] / us['avx512_vnni']:.2f}" if len(paths) == 2 else "-"
            print(f"| {name} {k}->{n} | {kind} | {rows} | {cells} | {ratio} |", flush=True)


KERNEL_PATHS = {"amx_int8": ("amx_int8", "avx512_vnni"), "avx512_vnni": ("avx512_vnni",)}
"""The paths of quant_linear each best path allows beside itself (AVX2 aside)."""


def smollm2_step(rows_list: list[int], repeats: int, clock) -> None:
    shapes = SHAPES["smollm2"]
    per_layer = [shapes["q,o"]] * 2 + [shapes["k,v"]] * 2 + [shapes["gate,up"]] * 2 + [shapes["down"]]
    quant = [random_layers(n, k)["U4"] for _ in range(30) for n, k in per_layer]
    quant.append(random_layers(*shapes["head"])["I8/32"])
    variants = {"file formats": quant, "bf16": [bf16_layer(layer.dequantize().bfloat16()) for layer in quant]}
    print("| rows | file formats ms | bf16 ms | ratio |")
    print("|---|---|---|---|")
    for rows in rows_list:
        x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(repeats):
            for label, layers in variants.items():
                t0 = clock()
                for layer in layers:
                    layer(x[layer.in_features])
                best[label] = min(best[label], (clock() - t0) * 1e3)
        ours, bf16 = best["file formats"], best["bf16"]
        print(f"| {rows} | {ours:.2f} | {bf16:.2f} | {bf16 / ours:.2f}x |", flush=True)


def file_step(path: str, rows_list: list[int], thread_counts: list[int], repeats: int, clock) -> None:
    """Per-call µs of each kind of linear layer of a real GGUF, in a decode step's order."""
    from bench_worker_step import make_worker

    model = make_worker(path, "bfloat16", 512, max(rows_list), "gguf").model
    calls = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        calls += [("q/k/v", attn.qkv_proj), ("o", attn.o_proj), ("gate/up", mlp.gate_up_proj), ("down", mlp.down_proj)]
    calls.append(("head", model.embed_tokens if model.lm_head is None else model.lm_head))
    columns = [f"{t} thread(s), {r} rows: µs a call (ms a step)" for r in rows_list for t in thread_counts]
    print("| kind | layout |", " | ".join(columns), "|")
    print("|---|---|" + "---|" * (len(rows_list) * len(thread_counts)))
    times: dict[tuple[str, int, int], list[float]] = {}
    for rows in rows_list:
        inputs = [(kind, layer.rows_fn(), torch.randn(rows, layer.in_features).bfloat16()) for kind, layer in calls]
        for _ in range(repeats):
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for kind, fn, x in inputs:
                    t0 = clock()
                    fn(x)
                    times.setdefault((kind, rows, threads), []).append(clock() - t0)
    layouts: dict[str, str] = {}
    for kind, layer in calls:
        layouts.setdefault(kind, layer.extra_repr().split(", ")[1])  # layer 0's
    total = dict.fromkeys(((r, t) for r in rows_list for t in thread_counts), 0.0)
    for kind in layouts:
        cells = []
        for rows in rows_list:
            for threads in thread_counts:
                per_step = len(times[kind, rows, threads]) // repeats
                us = statistics.median(times[kind, rows, threads]) * 1e6
                total[rows, threads] += us * per_step / 1e3
                cells.append(f"{us:.0f} ({us * per_step / 1e3:.2f})")
        print(f"| {kind} | {layouts[kind]} |", " | ".join(cells), "|")
    print("| step | |", " | ".join(f"{ms:.2f} ms" for ms in total.values()), "|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "gemma3", "both"], default="both")
    p.add_argument("--rows", default="1,4,32,64,300")
    p.add_argument("--stream-mb", type=int, default=128, help="bf16 megabytes of copies per shape")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--threads", default="0", help="torch threads (0: all cores); with --file, e.g. 1,2 alternates")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall")
    p.add_argument("--step", action="store_true", help="SmolLM2's decode step as the file ships it")
    p.add_argument("--file", default=None, help="a .gguf: its real linear layers in a decode step's order")
    p.add_argument("--paths", action="store_true", help="the quantized kernel's AMX-INT8 path against its VNNI path")
    ns = p.parse_args(argv)
    clock = time.thread_time if ns.clock == "thread" else time.perf_counter
    thread_counts = [int(t) for t in ns.threads.split(",")]
    if ns.clock == "thread":
        thread_counts = [1]
    rows_list = [int(r) for r in ns.rows.split(",")]
    if ns.file:
        file_step(ns.file, rows_list, [t or torch.get_num_threads() for t in thread_counts], ns.repeats, clock)
        return 0
    if thread_counts[0]:
        torch.set_num_threads(thread_counts[0])
    probe = QuantLinear.from_u4(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), None)
    print(f"threads {torch.get_num_threads()}, {ns.clock} clock, quantized path: {probe.kernel_path or 'torch'}")
    if ns.step:
        smollm2_step(rows_list, ns.repeats, clock)
        return 0
    models = ["smollm2", "gemma3"] if ns.model == "both" else [ns.model]
    if ns.paths:
        print("| shape (in->out) | layout | rows | VNNI us | AMX us | AMX / VNNI |")
        print("|---|---|---|---|---|---|")
        for model in models:
            for name, (n, k) in SHAPES[model].items():
                bench_paths(f"{model} {name}", n, k, rows_list, ns.stream_mb, ns.repeats, clock)
        return 0
    print("| shape (in->out) | rows | copies | bf16 us | U4 us (bf16/U4) | I8/32 us | I8/16 us | I5 us | I6 us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for name, (n, k) in SHAPES[model].items():
            bench_shape(f"{model} {name}", n, k, rows_list, ns.stream_mb, ns.repeats, clock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
