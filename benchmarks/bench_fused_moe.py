"""One mixture-of-experts layer's routed experts on CPU: the fused op (layers/fused_moe.py) against a
torch loop over experts (index_select, then bf16 matmuls, as transformers' MoE blocks run), and
both against the memory floor.

    python benchmarks/bench_fused_moe.py [--tokens 1,8,32,64] [--repeats 3] [--gguf Q8_0]

With --gguf FORMAT the experts are random weights in that GGUF format (Q8_0, Q4_0, Q4_K, Q5_0,
Q6_K): the fused op for quantized experts (layers/fused_moe_gguf.py) against the per-expert path
it replaces (moe_experts.py's loop over each expert's QuantLinear layers), activations in bf16.

The default shape is a Qwen3-30B-A3B-like layer scaled down: hidden 2048, 128 experts, top-8,
expert MLP 768 (one layer's experts: ~1.2 GB in bf16, held twice: as the loop's tensors and
packed for the op). Each timed call gets a fresh random routing (distinct experts per token) and
runs after a read of a buffer larger than the last-level cache, so that the experts' weights come
from memory, as they do in a model whose layers together far exceed the cache.

Memory floor of a call: the bytes of the experts its routing touches (each read once) over the
host's read bandwidth, measured in the same run (roofline.py's sum over a large tensor). The
table gives median milliseconds per layer and the fraction of the floor each reaches (floor /
time). On a shared host the figures are indicative only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from roofline import memory_read_gb_s  # noqa: E402

from gpu_worker.kernels.cpu_kernels import load_elementwise_kernels, load_fused_moe, load_quant_linear  # noqa: E402
from gpu_worker.layers.fused_moe import FusedMoE  # noqa: E402
from gpu_worker.layers.fused_moe_gguf import FusedQuantMoE  # noqa: E402
from gpu_worker.layers.gguf_layers import quant_linear  # noqa: E402
from gpu_worker.layers.moe_experts import MoeExperts  # noqa: E402
from tests.test_fused_moe_gguf import random_quant_weights  # noqa: E402

BF16_BYTES = 2
GGUF_FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q5_0", "Q6_K")
CACHE_FLUSH_BYTES = 512 << 20
"""Read before each timed call: more than the last-level cache of the hosts this runs on."""


def torch_loop(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Each expert with tokens: gather them, gate_up, silu * up, down, weighted into a float32 sum."""
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x.index_select(0, tokens), gate_up[e]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tokens, y.float() * weights[tokens, slots, None])
    return out.bfloat16()


Layer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bf16_layers(experts: int, hidden: int, inter: int) -> tuple[Layer, Layer, int]:
    """(the fused op, the torch loop, bytes of one expert) on random bf16 weights."""
    gate_up = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter) / inter**0.5).bfloat16()
    fused = FusedMoE.from_weights(gate_up, down)
    return fused, lambda x, ids, weights: torch_loop(x, ids, weights, gate_up, down), 3 * hidden * inter * BF16_BYTES


def gguf_layers(fmt: str, experts: int, hidden: int, inter: int) -> tuple[Layer, Layer, int]:
    """(the fused op for quantized experts, the per-expert path, bytes of one expert) on random
    weights in `fmt`."""
    rng = np.random.default_rng(0)
    gate_up = [random_quant_weights(fmt, 2 * inter, hidden, rng) for _ in range(experts)]
    down = [random_quant_weights(fmt, hidden, inter, rng) for _ in range(experts)]
    fused = FusedQuantMoE.from_weights(gate_up, down)
    per_expert = MoeExperts(experts, hidden, inter)
    for expert, gate_up_w, down_w in zip(per_expert, gate_up, down, strict=True):
        expert.gate_up_proj, expert.down_proj = quant_linear(gate_up_w, None), quant_linear(down_w, None)
        expert.kernels = load_elementwise_kernels()
    expert_bytes = (fused.gate_up.packed.numel() + fused.down.packed.numel()) // experts
    return fused, per_expert, expert_bytes


def random_routing(tokens: int, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)]).int()
    return ids, torch.softmax(torch.randn(tokens, k), dim=-1)


def timed_cold(flush: torch.Tensor, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> float:
    """Seconds of one call of fn(*args), after reading `flush` out of the caches' way."""
    flush.sum()
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=768, help="each expert's MLP width")
    p.add_argument("--tokens", default="1,8,32,64")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per variant and token count")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--gguf", choices=GGUF_FORMATS, help="experts in this GGUF format, against the per-expert path")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    path = load_quant_linear() if ns.gguf else load_fused_moe()
    if not path:
        print("the C++ CPU kernels did not build here: no fused op to measure", file=sys.stderr)
        return 1
    hidden, experts, k, inter = ns.hidden, ns.experts, ns.top_k, ns.intermediate
    if ns.gguf:
        fused, loop, expert_bytes = gguf_layers(ns.gguf, experts, hidden, inter)
    else:
        fused, loop, expert_bytes = bf16_layers(experts, hidden, inter)
    bandwidth = memory_read_gb_s() * 1e9
    flush = torch.ones(CACHE_FLUSH_BYTES // 4, dtype=torch.float32)
    print(
        f"{ns.gguf or 'bf16'} weights, fused path {path}, {torch.get_num_threads()} threads, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {experts} experts top-{k}, hidden {hidden}, expert MLP {inter}"
    )
    print("| tokens | experts read | fused ms | loop ms | loop / fused | floor ms | fused of floor | loop of floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in [int(t) for t in ns.tokens.split(",")]:
        x = torch.randn(tokens, hidden).bfloat16()
        fused(x, *random_routing(tokens, experts, k))  # warm-up: threads, allocator
        samples: dict[str, list[float]] = {"fused": [], "loop": [], "floor": []}
        active: list[int] = []
        for _ in range(ns.repeats):
            ids, weights = random_routing(tokens, experts, k)
            active.append(ids.unique().numel())
            samples["floor"].append(active[-1] * expert_bytes / bandwidth)
            samples["fused"].append(timed_cold(flush, fused, x, ids, weights))
            samples["loop"].append(timed_cold(flush, loop, x, ids, weights))
        ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        print(
            f"| {tokens} | {statistics.median(active):.0f} | {ms['fused']:.2f} | {ms['loop']:.2f} | "
            f"{ms['loop'] / ms['fused']:.2f} | {ms['floor']:.2f} | {ms['floor'] / ms['fused']:.2f} | "
            f"{ms['floor'] / ms['loop']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
