"""Batch invariance: a row's logits are the same bits whatever else runs in its step.

A request's greedy text then depends on its own tokens only: not on the other requests of
its batches, not on how its prompt was chunked, not on whether its prefix came from the
radix cache, not on overlap or n-gram speculation, and not on a worker or scheduler
restart, after which the scheduler prefills its prompt and generated tokens again (what
was decoded one token a step is now one prompt chunk). On by default on the CPU fast path
(bf16); `--disable-batch-invariance` gives it up for the previous kernels.

What makes each reduction a row goes through independent of the batch and of the path its
tokens took:
- Linear layers and the LM head: our own kernels at every batch size, prompt chunks
  included (packed_linear.py `Bf16KernelLinear`; the GGUF kernels of quant_linear.py, with
  their per-row int8 activations; torch's weight-only int8 kernel for `--weight-dtype
  int8`). Each output is one float32 chain over k in a fixed order, rounded once. oneDNN,
  which served batches above 64 rows, picks its blocking (and so its summation order) by
  the number of rows.
- Attention: every query token, decoded, prefilled, verified as a draft or chunked, is its
  own row of the decode kernel (attention.py `QueryKeys`, csrc/paged_decode_attention.cpp):
  one thread sums its keys in position order, reading them from the pool, where prefill
  and decode wrote the same bits (rotary_write_kv); a prompt chunk's queries are summed in
  tiles that share K and V rows, in the decode loop's order (csrc/query_tile_attention.cpp).
  SDPA, which prompt chunks went through, splits keys by the chunk's length.
- Norms, rotary, activations and greedy argmax: the C++ ops, one row per task, each row
  reduced in one order. Seeded sampling draws each row's noise from its own (seed, tokens
  generated, token id) hash (sampler.py), so sampled text is batch invariant too.
- Tensor parallelism: a row-parallel layer's partial sums are all-reduced across ranks. At
  tp 2 that is one addition per element, the same whichever rank adds (a + b == b + a), so
  the output is batch invariant at tp 2 (and differs from tp 1 by the split of the sum).
  Above 2 ranks the ring all-reduce adds in an order that depends on the tensor's size, so
  there the ranks' parts are gathered and added in rank order instead (parallel.py).

What it does not cover, and so turns it off with a log line: float32 and float16 with
dense weights (the linears are oneDNN's; float32 is the exact parity path), CUDA, `--compile` (inductor fuses
the decode step's norms in its own order), `--decode-attention torch`, `--linear-weights
packed|plain`. `--weight-dtype int8` keeps it: torch's int8 kernel sums each row alone
(tests/test_int8_weights.py checks it on this CPU).
"""

from __future__ import annotations

import torch

from trident.wire.server_args import ServerArgs


def batch_invariance_off_because(
    args: ServerArgs, device: torch.device, dtype: torch.dtype, weight_dtype: str
) -> str | None:
    """Why this worker cannot be batch invariant, or None when it is."""
    if args.disable_batch_invariance:
        return "--disable-batch-invariance"
    if device.type != "cpu":
        return "the invariant kernels are CPU kernels"
    if dtype != torch.bfloat16 and weight_dtype != "gguf":
        return f"{dtype} runs oneDNN's linear layers"
    if args.compile_decode == "on":
        return "--compile fuses the decode step's norms in inductor's own order"
    if args.decode_attention == "torch":
        return "--decode-attention torch"
    if args.linear_weights != "auto":
        return f"--linear-weights {args.linear_weights} runs oneDNN's linear layers"
    return None
