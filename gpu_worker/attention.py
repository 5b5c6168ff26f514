"""Attention over the paged KV pool, for a flat batch of rows of different lengths.

Short rows (a decode token, or a decode token plus a few draft tokens to verify) are
gathered into one padded batch and run as a single SDPA call with a mask built from each
row's length. Long rows (prompt chunks) run one SDPA call each with a causal mask
shifted by the row's cached prefix, so a long prefill never pads the short rows up to
its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExtendRow:
    q_start: int
    """Offset of the row's first query token in the flat batch."""
    q_len: int
    prefix_len: int
    """Tokens already in the pool before this chunk."""
    kv_indices: torch.Tensor
    """Pool indices of all prefix_len + q_len tokens of the row."""
    causal_mask: torch.Tensor | None
    """None when prefix_len == 0 (plain causal)."""


@dataclass
class AttentionMetadata:
    out_cache_loc: torch.Tensor
    """Pool index each new token's K/V is written to, [num_tokens]."""
    short_token_idx: torch.Tensor
    """Flat-batch index of each short row's query tokens, padded by repeating the row's
    last token, [num_short, max_q]."""
    short_q_valid: torch.Tensor
    """True where short_token_idx is a real query, [num_short, max_q]."""
    short_kv_indices: torch.Tensor
    """Pool indices per short row, padded with 0, [num_short, max_kv_len]."""
    short_mask: torch.Tensor
    """Query i of a row sees keys 0..prefix+i, [num_short, 1, max_q, max_kv_len]."""
    extend_rows: list[ExtendRow]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_head_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, dim] -> [num_tokens, heads, dim].

    Query head h reads KV head h // (heads // kv_heads) (SDPA's GQA grouping), unless
    `kv_head_map` gives each query head's KV head: a tensor-parallel rank whose heads
    straddle KV groups (parallel.py) reads gathered KV expanded to one head per query head.
    """
    out = torch.empty_like(q)

    def gather(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # [..., KVH, D]
        # index_select on the flat index is several times faster than advanced indexing on CPU.
        rows = cache.index_select(0, idx.reshape(-1)).view(*idx.shape, *cache.shape[1:])
        return rows if kv_head_map is None else rows.index_select(-2, kv_head_map)

    if meta.short_token_idx.numel():
        qs = q[meta.short_token_idx].transpose(1, 2)  # [B, H, Q, D]
        ks = gather(k_cache, meta.short_kv_indices).transpose(1, 2)  # [B, KVH, L, D]
        vs = gather(v_cache, meta.short_kv_indices).transpose(1, 2)
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.short_mask, enable_gqa=True)
        os_ = os_.transpose(1, 2)  # [B, Q, H, D]
        if meta.short_token_idx.shape[1] == 1:
            out[meta.short_token_idx[:, 0]] = os_[:, 0]
        else:
            out[meta.short_token_idx[meta.short_q_valid]] = os_[meta.short_q_valid]
    for row in meta.extend_rows:
        sl = slice(row.q_start, row.q_start + row.q_len)
        qe = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ke = gather(k_cache, row.kv_indices).transpose(0, 1).unsqueeze(0)
        ve = gather(v_cache, row.kv_indices).transpose(0, 1).unsqueeze(0)
        oe = F.scaled_dot_product_attention(
            qe, ke, ve, attn_mask=row.causal_mask, is_causal=row.causal_mask is None, enable_gqa=True
        )
        out[sl] = oe.squeeze(0).transpose(0, 1)
    return out


def shifted_causal_mask(q_len: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    """Query i (at position prefix_len + i) sees keys 0..prefix_len + i."""
    kv = torch.arange(prefix_len + q_len, device=device)
    qpos = torch.arange(q_len, device=device)[:, None] + prefix_len
    return kv[None, :] <= qpos
