"""Builds and loads the CPU decode-attention kernel (csrc/paged_decode_attention.cpp).

`load()` compiles the C++ file with torch's extension builder the first time (~20 s on
two cores; the result is cached under ~/.cache/torch_extensions, keyed by the source, so
later starts take well under a second), loads it, and returns the op
`torch.ops.trident.paged_decode_attention`, or None when there is no compiler (the
worker then keeps the torch path of attention.py, and says so).

The build targets the instruction set torch itself dispatches to on this CPU (AVX-512,
AVX2 or none), and the cache entry is named after it: a cache shared by machines of
different CPUs never hands one a binary it cannot run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "paged_decode_attention.cpp")
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
_loaded: DecodeKernel | None = None


def _fake(q: torch.Tensor, kv_cache: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor, scale: float):
    return torch.empty_like(q)


def wants_decode_kernel(setting: str, device: torch.device) -> bool:
    """`auto` (the default) and `kernel` use it on CPU; `torch` keeps attention.py's torch path.
    The kernel is CPU code: on CUDA the torch path runs whatever the setting."""
    return setting != "torch" and device.type == "cpu"


def load() -> DecodeKernel | None:
    """The op, built on first use in this process; None if it cannot be built."""
    global _loaded
    if _loaded is not None:
        return _loaded
    from torch.utils import cpp_extension

    isa = torch.backends.cpu.get_cpu_capability()
    t0 = time.monotonic()
    logger.info("loading the paged decode attention kernel (%s; the first build takes ~20 s)", isa)
    try:
        cpp_extension.load(
            name=f"trident_paged_decode_{isa.lower()}",
            sources=[SOURCE],
            extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", *ISA_FLAGS.get(isa, [])],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, or a failed build
        logger.warning("paged decode attention kernel unavailable (%s): decode attention runs in torch", e)
        return None
    torch.library.register_fake("trident::paged_decode_attention")(_fake)
    _loaded = torch.ops.trident.paged_decode_attention
    logger.info("paged decode attention kernel ready in %.1f s", time.monotonic() - t0)
    return _loaded
