"""The inner step both attention kernels share (decode_attention.py, extend_attention.py): one
block of keys and values from the paged pool into a block of queries' running softmax.

Flash attention's online softmax: each query keeps its running maximum score `m`, the sum of
its weights `total` and the weighted sum of values `acc`, all scaled to that maximum; a new
block rescales them by exp(m - m_new) and adds its own. A query that has seen no key yet
(every score -inf) keeps m at -inf and its weights at 0, rather than exp(-inf - -inf) = NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_key_block(
    q,
    m,
    total,
    acc,
    KV,
    Tokens,
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
    DOT_PRECISION: tl.constexpr,
):
    """q [M, BLOCK_D] (float32) over the keys `Tokens[n]` (n_ok: inside the row) of KV head
    `kv_head`; `seen` [M or 1, BLOCK_N] says which of them each query sees. Returns the
    updated (m, total, acc)."""
    token = tl.load(Tokens + n, mask=n_ok, other=0).to(tl.int64)
    kv_ptr = KV + token[:, None] * stride_kv_token + kv_head * stride_kv_head + d[None, :]
    kv_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(kv_ptr, mask=kv_ok, other=0.0).to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key seen yet
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    v = tl.load(kv_ptr + stride_kv_kv, mask=kv_ok, other=0.0).to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    total = total * alpha + tl.sum(p, 1)
    return m_new, total, acc
