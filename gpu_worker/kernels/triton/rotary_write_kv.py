"""The step's new K and V into the pool, with the rotary embedding (and Qwen3's and Gemma 3's
per-head q/k norms) applied on the way: one program per token and head.

One program per token takes its query and key heads as one [heads + kv_heads, dim] block:
it rotates the query heads into the output, and the key heads, which it writes with the
values to the pool at loc[token].
A token whose loc is negative (a padding row of a CUDA-graph bucket) writes nothing, so a
padded row never touches the pool. The rounding follows decoder_layer.py's `apply_rotary`:
x * cos and rotate_half(x) * signed_sin each rounded to the dtype, then their sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_write_kv(
    QKV,
    Cos,
    SignedSin,
    KV,
    Loc,
    Q,
    QNorm,
    KNorm,
    eps,
    stride_qkv,
    stride_rope,
    stride_kv_token,
    stride_kv_kv,
    stride_kv_head,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_HEADS)[:, None]  # q heads, then k heads
    d = tl.arange(0, DIM)[None, :]
    rolled = (d + DIM // 2) % DIM
    is_q = h < HEADS
    is_k = (h >= HEADS) & (h < HEADS + KV_HEADS)
    ok = (is_q | is_k) & (d < DIM)
    src = QKV + token * stride_qkv + h * DIM
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    xr = tl.load(src + rolled, mask=ok, other=0.0).to(tl.float32)
    dtype = Q.dtype.element_ty
    if HAS_NORM:
        w = tl.where(is_q, tl.load(QNorm + d).to(tl.float32), tl.load(KNorm + d).to(tl.float32))
        wr = tl.where(is_q, tl.load(QNorm + rolled).to(tl.float32), tl.load(KNorm + rolled).to(tl.float32))
        r = tl.rsqrt(tl.sum(x * x, 1) / DIM + eps)[:, None]
        if UNIT_OFFSET:
            x = (x * r * (1.0 + w)).to(dtype).to(tl.float32)
            xr = (xr * r * (1.0 + wr)).to(dtype).to(tl.float32)
        else:
            x = ((x * r).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
            xr = ((xr * r).to(dtype).to(tl.float32) * wr).to(dtype).to(tl.float32)
    cos = tl.load(Cos + token * stride_rope + d).to(tl.float32)
    sin = tl.load(SignedSin + token * stride_rope + d).to(tl.float32)
    rotated = ((x * cos).to(dtype).to(tl.float32) + (xr * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(Q + (token * HEADS + h) * DIM + d, rotated, mask=is_q & (d < DIM))
    loc = tl.load(Loc + token)
    if loc >= 0:
        dst = KV + loc.to(tl.int64) * stride_kv_token + (h - HEADS) * stride_kv_head + d
        writes = is_k & (d < DIM)
        tl.store(dst, rotated, mask=writes)
        tl.store(dst + stride_kv_kv, tl.load(src + KV_HEADS * DIM + d, mask=writes, other=0.0), mask=writes)


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    loc: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    unit_offset: bool = False,
) -> torch.Tensor:
    """ElementwiseKernels.rotary_write_kv: the rotated q [tokens, heads, dim]; the rotated k and
    v written to kv_cache[loc] (rows with loc < 0 write nothing)."""
    tokens, dim = qkv.shape[0], kv_cache.shape[-1]
    q = qkv.new_empty(tokens, heads, dim)
    if tokens == 0:
        return q
    cos, signed_sin = cos.reshape(tokens, dim), signed_sin.reshape(tokens, dim)
    has_norm = q_norm is not None and k_norm is not None
    _rotary_write_kv[(tokens,)](
        qkv,
        cos,
        signed_sin,
        kv_cache,
        loc,
        q,
        q_norm if has_norm else cos,
        k_norm if has_norm else cos,
        eps,
        qkv.stride(0),
        cos.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        HEADS=heads,
        KV_HEADS=kv_heads,
        DIM=dim,
        BLOCK_HEADS=triton.next_power_of_2(heads + kv_heads),
        HAS_NORM=has_norm,
        UNIT_OFFSET=unit_offset,
    )
    return q
