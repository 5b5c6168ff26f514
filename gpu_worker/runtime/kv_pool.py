"""The KV tensors. The worker owns them; the scheduler owns which pages are whose.

Token `t` of a request lives at pool index `page_table[slot, t // page_size] * page_size
+ t % page_size`. Page 0 is never handed out by the scheduler's allocator: padded
gathers read it under a mask, so it must exist and hold finite values (a masked score's
weight is 0, and 0 x NaN is NaN): it is zeroed. Every other slot is written before it is
read, as a page freed and handed out again holds its last owner's KV, so the rest of the
pool is left as allocated: zeroing a large CPU pool would be paid on every worker start
and restart (docs/benchmarks.md, "Method"), and an untouched page costs no memory until the
first request writes it.

One tensor per layer holds K and V of a token side by side, [pool tokens, 2, kv_heads,
dim]: a step writes both with one `index_copy_`, and attention gathers both with one
`index_select` (attention.py).
"""

from __future__ import annotations

import torch

from gpu_worker.model.model_config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, num_kv_heads: int) -> int:
    """KV bytes one token costs on a rank holding `num_kv_heads` KV heads (its tensor-parallel share)."""
    return 2 * cfg.num_layers * num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        size = num_pages * page_size
        shape = (size, 2, num_kv_heads, cfg.head_dim)
        self.kv = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        for layer in self.kv:
            layer[:page_size].zero_()

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(self.kv[layer], loc, k, v)


def write_kv(kv_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes new tokens' K and V ([tokens, kv_heads, dim] each) into one layer's tensor."""
    kv_cache.index_copy_(0, loc, torch.stack((k, v), dim=1))
