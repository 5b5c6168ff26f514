"""torch.compile of the decoder layer for plain decode steps (`--compile`, `--disable-compile`).

Why: after the matmuls, an eager decode step on CPU is ~25 small ops per layer (norms,
rotary, the KV write, the gather, softmax, residuals), each its own kernel and its own
OpenMP region: ~750 per step. Inductor fuses them into four C++/OpenMP kernels per layer
around the matmuls (one of them writes the new K/V into the pool in place and gathers the
keys: the generated loops run over the batch's rows, never over the pool).

What is compiled: one decoder layer (regional compilation), not the whole model. Every
layer runs the same code on its own weights and KV tensor, so one graph serves all of them,
and it builds in a fraction of the whole model's time (a pass of the whole-model compile
grows with the square of the graph). The price is a guard check and a wrapper call per
layer, paid on every layer of every step.

When: only plain decode steps (every row one query, no prompt chunk). Prefill, mixed and
draft-verify steps run eager: their structure (chunks, masks) varies from step to step,
and a prompt step is spent in the matmuls anyway.

Layers whose sliding window differs (Gemma 3's local and global layers) get graphs of
their own: the window is a plain int of the module, which the graph specialises on.

Shapes: `dynamic=True`, so the batch size and the KV lengths are symbols: one graph for a
lone row (torch specialises sizes of 1) and one for 2+ rows per number of length groups
(1..MAX_DECODE_GROUPS, batch_state.py). `warm_up` builds all of them before the worker says
it is ready, so no request waits for a compile. Duck shaping is off: two sizes that happen
to be equal while tracing must not become a guard that they stay equal.

On CUDA the same path compiles to Triton kernels; it has not been run there. At tp > 1
the layer's all-reduce would enter the graph, which is not tested: the layers run eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from gpu_worker.model.attention import AttentionMetadata, DecodeGroup
from gpu_worker.runtime.batch_state import MAX_DECODE_GROUPS

logger = logging.getLogger(__name__)

LayerFn = Callable[..., torch.Tensor]


def run_layer(layer: torch.nn.Module, x, rotary, kv_cache, meta) -> torch.Tensor:
    """What the compiled function traces: one decoder layer."""
    return layer(x, rotary, kv_cache, meta)


def runs_compiled(meta: AttentionMetadata) -> bool:
    """A plain decode step of a shape class that warm_up built: a lone group, or groups of
    2+ rows each. torch specialises sizes of 1, so a one-row group among others would need
    a graph for each mix of such groups; those steps run eager."""
    groups = meta.decode_groups
    return meta.is_plain_decode() and (len(groups) == 1 or all(g.token_idx.shape[0] > 1 for g in groups))


def wants_compile(setting: str, tp_size: int) -> bool:
    """`on` compiles at tp 1. `auto` (the default) is off for now: beside the C++ kernels the
    gain is smaller than the run-to-run noise of served numbers (docs/benchmarks.md), while
    every start and every restart of a worker pays the warm-up."""
    return setting == "on" and tp_size == 1


def compile_layer(layer_kinds: int = 1) -> LayerFn:
    """`layer_kinds`: layers that differ in a plain int the graph specialises on (a sliding
    window or none: Gemma 3's local and global layers); each kind has its own graphs."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    graphs = layer_kinds * (MAX_DECODE_GROUPS + 1)  # warm_up's shape classes, per kind
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs)
    # Graph partitioning serves CUDA graphs; on CPU it only costs compile time.
    torch._inductor.config.graph_partition = False
    return torch.compile(run_layer, dynamic=True)


def _synthetic_meta(rows_per_group: list[int], kv_lens: list[int], device: torch.device) -> AttentionMetadata:
    """A decode step of len(rows_per_group) length groups whose every read and write lands
    on pool index 0 (page 0, the padding page: its contents never matter)."""
    batch = sum(rows_per_group)
    groups, start = [], 0
    for rows, kv_len in zip(rows_per_group, kv_lens):
        groups.append(
            DecodeGroup(
                # Not a view: the graphs are specialised on whether an input is one.
                token_idx=torch.arange(start, start + rows, device=device)[:, None].clone(),
                q_valid=torch.ones(rows, 1, dtype=torch.bool, device=device),
                kv_indices=torch.zeros(rows, kv_len, dtype=torch.int64, device=device),
                kv_lens=torch.full((rows,), kv_len, dtype=torch.int64, device=device),
                bias=torch.zeros(rows, 1, 1, 1, kv_len, device=device),
                covers_batch=len(rows_per_group) == 1,
            )
        )
        start += rows
    return AttentionMetadata(torch.zeros(batch, dtype=torch.int64, device=device), groups, [])


def warm_up(forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], object], device: torch.device) -> None:
    """Runs one synthetic decode step of each shape class, logging each compile.

    `forward(input_ids, positions, meta)` runs the model. Sizes are distinct (and not 1
    except for the lone row) so that no coincidence between them is specialised."""
    shapes = [([1], [7])] + [
        ([3 + 2 * i for i in range(n)], [11 + 5 * i for i in range(n)]) for n in range(1, MAX_DECODE_GROUPS + 1)
    ]
    total = time.monotonic()
    for i, (rows, kv_lens) in enumerate(shapes, 1):
        t0 = time.monotonic()
        meta = _synthetic_meta(rows, kv_lens, device)
        batch = sum(rows)
        ids = torch.zeros(batch, dtype=torch.int64, device=device)
        forward(ids, torch.arange(batch, device=device), meta)
        logger.info(
            "compiling decode graphs %d/%d (%d rows, %d length group(s)): %.1f s",
            i,
            len(shapes),
            batch,
            len(rows),
            time.monotonic() - t0,
        )
    logger.info("decode graphs ready in %.1f s", time.monotonic() - total)
