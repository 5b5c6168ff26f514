"""Memory backed by 2 MB pages for weights that decode steps stream from end to end.

Why: a 1-row decode step reads every weight once, at the memory's pace, and in 4 KB pages it
also walks the page tables once every 4 KB. With Linux THP in `madvise` mode a plain
allocation never gets 2 MB pages, and a large head such as Gemma 3's then reads far below
the memory's pace (docs/benchmarks.md, "Kernels"). llama.cpp maps the file, whose page cache
can be huge pages.

How: anonymous private mappings of `CHUNK_BYTES`, marked MADV_HUGEPAGE before their first
touch, so the kernel backs them with 2 MB pages where it can (else 4 KB ones: correct, as
before). Tensors are carved from the current chunk one after another, so small weights share
huge pages rather than each rounding up to one; a chunk is unmapped when the last tensor in
it is gone (torch.frombuffer keeps the mapping alive). Elsewhere than Linux: plain memory.
"""

from __future__ import annotations

import math
import mmap
import threading

import torch

HUGE_PAGE_BYTES = 2 << 20
CHUNK_BYTES = 64 << 20
"""A chunk's size: touched pages only are resident, so the unused end of the last one costs
address space, not memory."""
ALIGNMENT = 64
"""Every tensor starts on a cache line."""

_lock = threading.Lock()
_chunk: torch.Tensor | None = None
_used = 0


def _new_chunk(size: int) -> torch.Tensor | None:
    """A uint8 tensor over a fresh mapping of `size` bytes starting on a 2 MB boundary."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start : start + size]


def huge_page_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised contiguous uint8 tensor of `shape` in 2 MB-page memory where the OS
    gives it (else ordinary memory)."""
    global _chunk, _used
    size = math.prod(shape)
    with _lock:
        if _chunk is None or _used + size > _chunk.numel():
            _chunk = _new_chunk(max(CHUNK_BYTES, -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES))
            _used = 0
            if _chunk is None:
                return torch.empty(shape, dtype=torch.uint8)
        out = _chunk[_used : _used + size].view(shape)
        _used += -(-size // ALIGNMENT) * ALIGNMENT
    return out


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in 2 MB-page memory: for packed weights a step streams from end to end,
    which in 4 KB pages also walk the page tables every 4 KB."""
    out = huge_page_empty((t.numel() * t.element_size(),)).view(t.dtype).view(t.shape)
    return out.copy_(t)
