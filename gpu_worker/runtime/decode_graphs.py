"""Decode steps at batch-size buckets from inputs at fixed addresses, replayed as CUDA graphs.

A plain decode step (every row one query, no prompt chunk, no draft) of n rows runs at the
smallest bucket b >= n (1, 2, 4, ..., 256 up to `--cuda-graph-max-bs`). Its inputs are
fields at fixed addresses, reserved once in the step's staging (host_staging.py) and sized
for the largest bucket; a step writes its n rows there and pads the rest:

    field        rows 0 .. n-1              rows n .. b-1 (padding)
    slots        each row's slot            0: a table row that is never read
    positions    each row's position        0
    out_loc      where its new K/V go       -1: the KV write skips the row
    kv_lens      its keys, itself included  0: attention reads no key, yields zeros
    input_ids    last_token[slots], gathered on the device after the flush

Attention reads each row's keys from the device token table (batch_state.py), whose shape
and address never change, through its slot, with the Triton decode kernel; so nothing a
step reads moves, and nothing's shape depends on the rows' lengths. On CUDA each bucket's
forward, from these fields to its b rows of logits, is captured once at start-up and
replayed; elsewhere the same code runs the forward eagerly (how the CPU tests check the
padding and the fixed addresses). The logits of the n real rows are returned: padding rows
never reach sampling. The seq_lens publish and the token read-back are the worker loop's,
unchanged.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from gpu_worker.model.attention import AttentionMetadata, DecodeGroup
from gpu_worker.model.decoder import LlamaForCausalLM
from gpu_worker.runtime.batch_state import BatchState, StepPlan
from gpu_worker.runtime.kv_pool import KVPool

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_buckets(max_bs: int) -> list[int]:
    """The default buckets below max_bs, and max_bs itself."""
    return ([b for b in BUCKETS if b < max_bs] + [max_bs]) if max_bs > 0 else []


class DecodeGraphs:
    """The runner: `serves(plan)`, then `run(plan)` -> logits of the plan's rows."""

    def __init__(self, model: LlamaForCausalLM, kv_pool: KVPool, state: BatchState, max_bs: int) -> None:
        assert model.decode_kernel is not None, "the runner's attention is a kernel reading the token table"
        self.model = model
        self.kv_pool = kv_pool
        self.state = state
        self.buckets = graph_buckets(max_bs)
        largest = self.buckets[-1]
        self.token_table = state.keep_token_table()
        staging = state.staging
        self.slots, self.positions, self.out_loc, self.kv_lens = staging.reserve(torch.int64, [largest] * 4)
        for field, fill in ((self.slots, 0), (self.positions, 0), (self.out_loc, -1), (self.kv_lens, 0)):
            staging.stage_fixed(field, np.zeros(0, dtype=np.int64), fill)
        staging.flush()
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=state.device)
        self.rows = torch.arange(largest, device=state.device)
        """logits_indices of a bucket: each of its rows."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        """Each captured bucket's output, rewritten by every replay."""

    def serves(self, plan: StepPlan) -> bool:
        """A plain decode step of at most the largest bucket's rows."""
        rows = len(plan.computing_slots)
        plain = not plan.extend_rows and not plan.drafts and not plan.pooled_rows
        return plain and rows <= self.buckets[-1] and bool((plan.q_lens == 1).all())

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Stages the step into the fixed fields (one flush), replays (or runs) its bucket, and
        returns the logits of the real rows, [rows, vocab]."""
        state, staging = self.state, self.state.staging
        staging.begin_step()
        slots = plan.computing_slots.astype(np.int64)
        positions = state.row_lens_host[slots]
        staging.stage_fixed(self.slots, slots, 0)
        staging.stage_fixed(self.positions, positions, 0)
        staging.stage_fixed(self.out_loc, state.pool_index(slots, positions), -1)
        staging.stage_fixed(self.kv_lens, positions + 1, 0)
        update_token_table = state.stage_token_table_updates()
        staging.flush()
        if update_token_table is not None:
            update_token_table()
        torch.index_select(state.last_token, 0, self.slots.device, out=self.input_ids)
        rows, bucket = len(slots), self.bucket(len(slots))
        graph = self.graphs.get(bucket)
        if graph is None:
            return self.forward(bucket)[:rows]
        graph.replay()
        return self.logits[bucket][:rows]

    def forward(self, bucket: int) -> torch.Tensor:
        """The model over the fixed fields' first `bucket` rows -> [bucket, vocab] logits."""
        group = DecodeGroup(
            token_idx=self.rows[:bucket, None],
            q_valid=torch.ones(bucket, 1, dtype=torch.bool, device=self.rows.device),
            kv_indices=self.token_table,
            kv_lens=self.kv_lens.device[:bucket],
            bias=torch.zeros(bucket, 1, 1, 1, 0, device=self.rows.device),
            covers_batch=True,
            kv_rows=self.slots.device[:bucket],
        )
        meta = AttentionMetadata(self.out_loc.device[:bucket], [group], [])
        ids, positions = self.input_ids[:bucket], self.positions.device[:bucket]
        return self.model(ids, positions, self.kv_pool, meta, self.rows[:bucket])

    def capture(self) -> None:
        """Captures every bucket's forward (CUDA only), the largest first so the smaller ones
        reuse its memory pool; the fields hold padding (no key read, no KV written)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        pool = None
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                for _ in range(2):  # compiles the kernels and settles the allocator
                    self.forward(bucket)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[bucket] = self.forward(bucket)
                self.graphs[bucket] = graph
                pool = graph.pool()
        torch.cuda.current_stream().wait_stream(stream)
        logger.info("captured decode graphs at %s rows", ",".join(map(str, self.buckets)))
