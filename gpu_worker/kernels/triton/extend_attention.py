"""Extend attention: a prompt chunk's queries over the row's cached prefix and themselves, causal.

The chunk's K and V are in the pool before this runs (the layer writes them first), so every
key is read from the pool through the row's token indices `kv_indices[:prefix + q_len]`: query
i (at position prefix + i) sees keys 0 .. prefix + i, or the last `window` of them. One program
takes BLOCK_M queries of one head and streams the keys they see in blocks of BLOCK_N with an
online softmax (flash attention), so K and V are read once per query block, not per query.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels.triton.dot_precision import dot_precision
from gpu_worker.kernels.triton.online_softmax import attend_key_block


@triton.jit
def _extend(
    Q,
    KV,
    KvIndices,
    Out,
    q_len,
    prefix,
    scale,
    window,
    stride_q_token,
    stride_q_head,
    stride_kv_token,
    stride_kv_kv,
    stride_kv_head,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    i_ok = i < q_len
    d_ok = d < DIM
    q_ptr = Q + i[:, None].to(tl.int64) * stride_q_token + head * stride_q_head + d[None, :]
    q = tl.load(q_ptr, mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    position = prefix + i  # of each query; it sees keys <= position
    last_seen = tl.minimum(prefix + (block + 1) * BLOCK_M, prefix + q_len)
    lo = tl.where(window > 0, tl.maximum(prefix + block * BLOCK_M - window + 1, 0), 0)
    lo = lo // BLOCK_N * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, last_seen, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < last_seen
        seen = n_ok[None, :] & (n[None, :] <= position[:, None])
        seen = seen & ((window <= 0) | (n[None, :] > position[:, None] - window))
        m, total, acc = attend_key_block(
            q,
            m,
            total,
            acc,
            KV,
            KvIndices,
            n,
            n_ok,
            seen,
            d,
            d_ok,
            kv_head,
            scale,
            stride_kv_token,
            stride_kv_kv,
            stride_kv_head,
            DOT_PRECISION,
        )

    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    out_ptr = Out + i[:, None].to(tl.int64) * stride_out_token + head * stride_out_head + d[None, :]
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=i_ok[:, None] & d_ok[None, :])


class TritonExtendAttention:
    """(q [q_len, heads, dim], kv_cache, kv_indices [prefix + q_len], prefix, scale, window) ->
    out [q_len, heads, dim]; query h reads KV head h // (heads // kv_heads)."""

    def __init__(self, block_m: int = 32, block_n: int = 32) -> None:
        self.block_m = block_m
        self.block_n = block_n

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_indices: torch.Tensor,
        prefix: int,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        q_len, heads, dim = q.shape
        out = q.new_empty(q.shape)
        grid = (triton.cdiv(q_len, self.block_m), heads)
        _extend[grid](
            q,
            kv_cache,
            kv_indices,
            out,
            q_len,
            prefix,
            scale,
            window,
            q.stride(0),
            q.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            out.stride(0),
            out.stride(1),
            GROUP=heads // kv_cache.shape[2],
            DIM=dim,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_D=triton.next_power_of_2(dim),
            DOT_PRECISION=dot_precision(q.dtype),
        )
        return out
