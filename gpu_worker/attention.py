"""Attention over the paged KV pool, for a flat batch of rows of different lengths.

Rows that decode (one query token) are gathered into one padded batch and run as a
single SDPA call with a length mask. Rows that extend (a prompt chunk) run one SDPA
call each with a causal mask shifted by the row's cached prefix, so a long prefill
never pads the decode rows up to its length.
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
    decode_token_idx: torch.Tensor
    """Positions in the flat batch of the decode rows' query tokens, [num_decode]."""
    decode_kv_indices: torch.Tensor
    """Pool indices per decode row, padded with 0, [num_decode, max_kv_len]."""
    decode_mask: torch.Tensor
    """True where a decode row's padded index is real, [num_decode, 1, 1, max_kv_len]."""
    extend_rows: list[ExtendRow]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [num_tokens, heads, dim] -> [num_tokens, heads, dim]."""
    out = torch.empty_like(q)
    if meta.decode_token_idx.numel():
        qd = q[meta.decode_token_idx].unsqueeze(2)  # [B, H, 1, D]
        kd = k_cache[meta.decode_kv_indices].transpose(1, 2)  # [B, KVH, L, D]
        vd = v_cache[meta.decode_kv_indices].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True)
        out[meta.decode_token_idx] = od.squeeze(2)
    for row in meta.extend_rows:
        sl = slice(row.q_start, row.q_start + row.q_len)
        qe = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ke = k_cache[row.kv_indices].transpose(0, 1).unsqueeze(0)
        ve = v_cache[row.kv_indices].transpose(0, 1).unsqueeze(0)
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
