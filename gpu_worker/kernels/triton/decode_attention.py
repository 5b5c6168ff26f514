"""Decode attention over the paged KV pool: one query per row, each row read at its own length.

The pool is [tokens, 2, kv_heads, dim] (kv_pool.py); a row's keys are `kv_indices[r, :kv_lens[r]]`
(or row `kv_rows[r]` of the table: the CUDA-graph runner passes the persistent token table and
each row's slot). The work of a row is split over the sequence into NUM_SPLITS parts (split-K,
as SGLang's and vLLM's Triton decode kernels do), so that a few long rows still fill the GPU:

    stage 1, grid (rows, kv_heads, splits): the GROUP query heads of one KV head over one
             part of the row's keys -> a partial output and its log-sum-exp;
    stage 2, grid (rows, kv_heads): the parts merged by their log-sum-exp.

Every part's bounds are computed in the kernel from kv_lens, so the grid depends on the rows
only: a captured graph stays valid as rows grow. A row with kv_lens 0 (a padding row of a
graph bucket) reads nothing and yields zeros. A sliding window of w keys reads only the last
w. The query heads of a KV head are one block (at least 16, what tl.dot needs): each key is
loaded once for all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels.triton.dot_precision import dot_precision
from gpu_worker.kernels.triton.online_softmax import attend_key_block


@triton.jit
def _decode_split(
    Q,
    KV,
    Table,
    TableRow,
    KvLens,
    PartOut,
    PartLse,
    scale,
    window,
    stride_q_row,
    stride_q_head,
    stride_kv_token,
    stride_kv_kv,
    stride_kv_head,
    stride_table,
    HAS_TABLE_ROW: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(KvLens + row).to(tl.int32)
    table_row = tl.load(TableRow + row).to(tl.int64) if HAS_TABLE_ROW else row.to(tl.int64)
    first = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    per_split = tl.cdiv(kv_len - first, NUM_SPLITS)
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < GROUP
    d_ok = d < DIM
    heads = kv_head * GROUP + h
    q_ptr = Q + row.to(tl.int64) * stride_q_row + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr, mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    tokens = Table + table_row * stride_table
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        m, total, acc = attend_key_block(
            q,
            m,
            total,
            acc,
            KV,
            tokens,
            n,
            n_ok,
            n_ok[None, :],
            d,
            d_ok,
            kv_head,
            scale,
            stride_kv_token,
            stride_kv_kv,
            stride_kv_head,
            DOT_PRECISION,
        )

    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
    part = (row * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
    tl.store(PartOut + part[:, None] * BLOCK_D + d[None, :], out, mask=h_ok[:, None])
    tl.store(PartLse + part, lse, mask=h_ok)


@triton.jit
def _decode_merge(
    PartOut,
    PartLse,
    Out,
    stride_out_row,
    stride_out_head,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < GROUP
    heads = kv_head * GROUP + h
    base = (row * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(PartLse + base + split, mask=h_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)  # every part empty: the weights are all 0
    norm = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        weight = tl.exp(tl.load(PartLse + base + split, mask=h_ok, other=float("-inf")) - top)
        part = tl.load(PartOut + (base + split)[:, None] * BLOCK_D + d[None, :], mask=h_ok[:, None], other=0.0)
        acc += part * weight[:, None]
        norm += weight
    out = acc / tl.where(norm == 0.0, 1.0, norm)[:, None]
    out_ptr = Out + row.to(tl.int64) * stride_out_row + heads[:, None] * stride_out_head + d[None, :]
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=h_ok[:, None] & (d < DIM)[None, :])


class TritonDecodeAttention:
    """A `DecodeKernel` (cpu_kernels.py): (q, kv_cache, kv_indices, kv_lens, scale, window[,
    kv_rows]) -> out [rows, heads, dim]."""

    def __init__(self, num_splits: int = 8, block_n: int = 32) -> None:
        self.num_splits = num_splits
        """Parts of a row's keys computed apart (a power of two); fixed, so graphs stay valid."""
        self.block_n = block_n

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        window: int = 0,
        kv_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, heads, dim = q.shape
        kv_heads = kv_cache.shape[2]
        group = heads // kv_heads
        block_d = triton.next_power_of_2(dim)
        block_h = max(16, triton.next_power_of_2(group))  # tl.dot's least M
        parts = q.new_empty(rows * heads * self.num_splits, block_d, dtype=torch.float32)
        lse = q.new_empty(rows * heads * self.num_splits, dtype=torch.float32)
        out = q.new_empty(q.shape)
        if rows == 0:
            return out
        _decode_split[(rows, kv_heads, self.num_splits)](
            q,
            kv_cache,
            kv_indices,
            kv_lens if kv_rows is None else kv_rows,  # no rows: an unread placeholder
            kv_lens,
            parts,
            lse,
            scale,
            window,
            q.stride(0),
            q.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_indices.stride(0),
            HAS_TABLE_ROW=kv_rows is not None,
            GROUP=group,
            DIM=dim,
            BLOCK_H=block_h,
            BLOCK_N=self.block_n,
            BLOCK_D=block_d,
            DOT_PRECISION=dot_precision(q.dtype),
            NUM_SPLITS=self.num_splits,
        )
        _decode_merge[(rows, kv_heads)](
            parts,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            GROUP=group,
            DIM=dim,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            NUM_SPLITS=self.num_splits,
        )
        return out
