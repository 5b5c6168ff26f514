"""How the worker's C heap treats large freed blocks: keep them (set at worker start).

glibc serves every allocation above a threshold (128 KB, rising to at most 32 MB) with a
fresh mmap and unmaps it on free. A prefill step allocates and frees ~10 MB temporaries
hundreds of times (activations of 2,048 tokens: the MLP's [tokens, 2 x 1,536] bf16 output
is 12 MB), and each fresh mapping is paid again in page faults, one per 4 KB, on first
touch, which costs an elementwise op several times its work on reused memory and slows a
whole prefill noticeably (docs/benchmarks.md, "Method", has the figures).

So the worker serves everything from the heap (no mmap) and never trims it: freed memory
is reused, as a caching allocator would on a GPU. The price is that the worker keeps the
peak of its heap for its lifetime; the KV pool and weights dominate that anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

TOP_PAD_BYTES = 64 << 20
"""The heap grows by at least this much at a time: fewer brk calls during a prefill."""
TRIM_THRESHOLD_BYTES = (1 << 31) - 1
"""mallopt takes an int: 2 GiB of free heap top is never given back."""


def keep_freed_memory() -> bool:
    """Sets the policy above; False where the C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(
        mallopt(param, value)
        for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_TOP_PAD, TOP_PAD_BYTES))
    )
    if not ok:
        logger.warning("mallopt refused a setting: large temporaries may be mapped and unmapped every step")
    return ok


def release_freed_memory() -> None:
    """Gives the heap's free pages back to the system once (glibc's malloc_trim), after the
    weights are loaded: the temporaries of loading (float32 tensors of a checkpoint, a GGUF's
    repacked blocks) are freed by then, and under the policy above their pages would stay
    resident for the worker's lifetime: the loading peak would become the worker's size
    (docs/benchmarks.md, "Method")."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
