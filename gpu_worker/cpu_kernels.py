"""Builds and loads the worker's C++ CPU kernels (csrc/*.cpp) as torch ops.

- `torch.ops.trident.paged_decode_attention` (csrc/paged_decode_attention.cpp): decode
  attention reading the paged KV pool in place (`--decode-attention`);
- `torch.ops.trident.small_batch_linear` (csrc/small_batch_linear.cpp): a bf16 linear
  layer for one or two rows at the memory's speed (packed_linear.py uses it);
- `torch.ops.trident.rms_norm` (csrc/rms_norm.cpp): RMSNorm in one pass (model.py).

The first use compiles the files with torch's extension builder (~30 s on two cores; the
result is cached under ~/.cache/torch_extensions, keyed by the sources, so later starts
take well under a second). Without a compiler the loaders return None and the worker
keeps its torch paths, and says so.

The build targets the instruction set torch itself dispatches to on this CPU (AVX-512,
AVX2 or none), and the cache entry is named after it: a cache shared by machines of
different CPUs never hands one a binary it cannot run. small_batch_linear exists only in
the AVX-512 build.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = [
    os.path.join(CSRC, name) for name in ("paged_decode_attention.cpp", "small_batch_linear.cpp", "rms_norm.cpp")
]
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
SMALL_BATCH_MAX_ROWS = 2
"""small_batch_linear takes 1 or 2 rows (csrc/small_batch_linear.cpp, kMaxRows)."""

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
SmallBatchLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
RmsNormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
_built: bool | None = None
"""None: not tried in this process; False: the build failed."""


def _decode_attention_fake(q, kv_cache, kv_indices, kv_lens, scale):
    return torch.empty_like(q)


def _small_batch_linear_fake(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


def wants_decode_kernel(setting: str, device: torch.device) -> bool:
    """`auto` (the default) and `kernel` use it on CPU; `torch` keeps attention.py's torch path.
    The kernel is CPU code: on CUDA the torch path runs whatever the setting."""
    return setting != "torch" and device.type == "cpu"


def _build() -> bool:
    global _built
    if _built is not None:
        return _built
    from torch.utils import cpp_extension

    isa = torch.backends.cpu.get_cpu_capability()
    t0 = time.monotonic()
    logger.info("loading the C++ CPU kernels (%s; the first build takes ~30 s)", isa)
    try:
        cpp_extension.load(
            name=f"trident_cpu_kernels_{isa.lower()}",
            sources=SOURCES,
            extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", *ISA_FLAGS.get(isa, [])],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, or a failed build
        logger.warning("C++ CPU kernels unavailable (%s): the worker runs torch ops instead", e)
        _built = False
        return False
    torch.library.register_fake("trident::paged_decode_attention")(_decode_attention_fake)
    torch.library.register_fake("trident::small_batch_linear")(_small_batch_linear_fake)
    torch.library.register_fake("trident::rms_norm")(_rms_norm_fake)
    _built = True
    logger.info("C++ CPU kernels ready in %.1f s", time.monotonic() - t0)
    return True


def load_decode_attention() -> DecodeKernel | None:
    """The decode attention op, built on first use in this process; None if it cannot be built."""
    return torch.ops.trident.paged_decode_attention if _build() else None


def load_small_batch_linear() -> SmallBatchLinear | None:
    """The 1-2 row bf16 linear op; None without an AVX-512 build."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not _build():
        return None
    return torch.ops.trident.small_batch_linear


def load_rms_norm() -> RmsNormKernel | None:
    """The one-pass RMSNorm op; None if the kernels cannot be built."""
    return torch.ops.trident.rms_norm if _build() else None
