"""Builds and loads the worker's C++ CPU kernels (csrc/*.cpp) as torch ops.

- `torch.ops.trident.paged_decode_attention` (csrc/paged_decode_attention.cpp): decode
  attention reading the paged KV pool in place (`--decode-attention`); given kv_rows (a
  prompt chunk's queries), it takes tiles of consecutive queries (csrc/query_tile_attention.cpp);
- `torch.ops.trident.vnni_linear` (csrc/vnni_linear.cpp): a bf16 linear layer for decode
  batches on weights packed for AVX512-BF16 (packed_linear.py uses it);
- `torch.ops.trident.amx_linear` (csrc/amx_linear.cpp): a bf16 linear layer for every batch
  size on AMX tiles, where the CPU has AMX-BF16 (its tile pieces in csrc/amx_tiles.h);
- `torch.ops.trident.fused_moe` (csrc/fused_moe.cpp): a mixture-of-experts layer's routed
  experts in one op, on AMX tiles, AVX512-BF16 or plain C++ (its block sums in
  csrc/moe_block_sums.h; layers/fused_moe.py packs for it), and `.fused_moe_gguf`
  (csrc/fused_moe_gguf.cpp) the same on a GGUF's quantized experts, on quant_linear's tiles
  (layers/fused_moe_gguf.py packs for it);
- the elementwise steps of a layer, one op each (decoder_layer.py, `ElementwiseKernels`):
  `torch.ops.trident.rms_norm` and `.add_rms_norm` (csrc/rms_norm.cpp: RMSNorm in one
  pass, after the residual add; LLaMA's x*w or Gemma's x*(1+w)), `.silu_and_mul` and
  `.gelu_tanh_and_mul` (SwiGLU, GeGLU), `.rotary` and `.rotary_write_kv`
  (csrc/layer_elementwise.cpp);
- `torch.ops.trident.greedy_argmax` (csrc/greedy_argmax.cpp): each row's greedy token from
  bf16 logits (sampler.py, `SamplingTable.argmax`);
- `torch.ops.trident.quant_linear` and `.quant_linear_rows` (csrc/quant_linear.cpp): a linear
  layer on 4- and 8-bit quantized weights (GGUF's formats, repacked by quant_linear.py), and
  its weight's rows (the embedding lookup of a tied LM head).

The first use compiles the files with torch's extension builder (~30 s on two cores; the
result is cached under ~/.cache/trident/cpu_kernels (XDG_CACHE_HOME), so later starts take
well under a second, from a checkout or an installed wheel alike). On a CPU the kernels are
made for (AVX2, AVX-512) a failed build is an error at start-up; only `--decode-attention
torch` (require_kernels) turns it into a warning and the worker's torch paths. Elsewhere
the loaders return None.

The build targets the instruction set torch itself dispatches to on this CPU (AVX-512,
AVX2 or none), and the cache entry is named after it: a cache shared by machines of
different CPUs never hands one a binary it cannot run. vnni_linear runs only on an AVX-512
build on a CPU with AVX512-BF16 (its code is compiled for that ISA, and asked for only
when the CPU has it).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = [
    os.path.join(CSRC, name)
    for name in (
        "paged_decode_attention.cpp",
        "query_tile_attention.cpp",
        "vnni_linear.cpp",
        "amx_linear.cpp",
        "fused_moe.cpp",
        "fused_moe_gguf.cpp",
        "widening_bf16_linear.cpp",
        "rms_norm.cpp",
        "layer_elementwise.cpp",
        "greedy_argmax.cpp",
        "quant_linear.cpp",
    )
]
# The csrc/*.h headers are included by the sources: ninja's dependency files rebuild on their edits.
COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
"""-fno-trapping-math lets loops calling floorf vectorise (exp_nonpositive in csrc/kernel_common.h;
without it GCC keeps them scalar); -ffp-contract=off rounds a product before a sum, as
torch's separate ops do (the rotary's float32 bits)."""
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

DecodeKernel = Callable[..., torch.Tensor]
"""(q, kv_cache, kv_indices, kv_lens, scale, window[, kv_rows]) -> out; window 0: every key of
the row; kv_rows: each query row's row of kv_indices (default: its own)."""


@dataclass(frozen=True)
class Bf16LinearKernel:
    """A bf16 linear of our own on weights packed for it: the AMX one (csrc/amx_linear.cpp),
    the AVX512-BF16 one (csrc/vnni_linear.cpp) or the AVX2 one (csrc/widening_bf16_linear.cpp)."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    """weight [n, k] bf16 -> its packed copy, made once at load (k even for the VNNI kernel)."""
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
    """(x [rows, k], packed, bias or None, n) -> x @ weight.T + bias, [rows, n] bf16."""


@dataclass(frozen=True)
class ElementwiseKernels:
    """The C++ ops for the elementwise steps of a decoder layer; decoder_layer.py runs them
    in eager steps (compiled graphs fuse the torch ops themselves)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
    """(x, weight, eps, unit_offset) -> RMSNorm(x), in the reference's rounding order;
    unit_offset: scaled by (1 + weight) in float32 (Gemma)."""
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]]
    """(x, delta, weight, eps, unit_offset) -> (x + delta, RMSNorm(x + delta))."""
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    """gate_up [rows, 2 * inter] -> silu(gate) * up [rows, inter]."""
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor]
    """gate_up [rows, 2 * inter] -> gelu_tanh(gate) * up [rows, inter] (GeGLU)."""
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(x [tokens, heads, dim], cos, signed_sin [tokens, 1, dim]) -> the rotated x, contiguous."""
    rotary_write_kv: Callable[..., torch.Tensor]
    """(qkv [tokens, (heads + 2 kv_heads) dim], cos, signed_sin, kv_cache, loc, heads, kv_heads[,
    q_norm, k_norm, eps, unit_offset]) -> the rotated q [tokens, heads, dim]; the rotated k
    and v written to kv_cache[loc]; with the norm weights, each q and k head RMS-normalised
    first (Qwen3, Gemma 3)."""


_built: bool | None = None
"""None: not tried in this process; False: the build failed."""
_required = True
"""A failed build on an AVX2 or AVX-512 CPU raises KernelBuildError (require_kernels)."""


def _decode_attention_fake(q, kv_cache, kv_indices, kv_lens, scale, window=0, kv_rows=None):
    return torch.empty_like(q)


def _vnni_pack_weight_fake(weight):
    return weight.new_empty((weight.shape[0] + 31) // 32, weight.shape[1] // 2, 64)


def _bf16_linear_fake(x, packed_weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


def _amx_pack_weight_fake(weight):
    return weight.new_empty((weight.shape[0] + 31) // 32, (weight.shape[1] + 31) // 32, 2, 16, 32)


def _fused_moe_pack_fake(weights):
    experts, n, k = weights.shape
    return weights.new_empty(experts, (n + 31) // 32, (k + 31) // 32, 2, 16, 32)


def _fused_moe_fake(x, topk_ids, topk_weights, gate_up, down, path="auto"):
    return torch.empty_like(x)


def _fused_moe_gguf_fake(
    x,
    topk_ids,
    topk_weights,
    gate_up,
    gate_up_layout,
    gate_up_block,
    gate_up_half_scales,
    down,
    down_layout,
    down_block,
    down_half_scales,
    path="auto",
):
    return torch.empty_like(x)


def _widening_pack_weight_fake(weight):
    return weight.new_empty((weight.shape[0] + 15) // 16, weight.shape[1], 16)


def _quant_linear_fake(x, packed, bias, out_features, layout, block, half_scales, path="auto"):
    return x.new_empty(x.shape[0], out_features)


def _quant_linear_rows_fake(packed, ids, out_features, layout, block, half_scales, dtype):
    return packed.new_empty(ids.numel(), packed.shape[1] * block, dtype=dtype)


def _greedy_argmax_fake(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def _rms_norm_fake(x, weight, eps, unit_offset=False):
    return torch.empty_like(x)


def _add_rms_norm_fake(x, delta, weight, eps, unit_offset=False):
    return torch.empty_like(x), torch.empty_like(x)


def _gated_activation_fake(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def _rotary_fake(x, cos, signed_sin):
    return x.new_empty(x.shape)


def _rotary_write_kv_fake(
    qkv, cos, signed_sin, kv_cache, loc, heads, kv_heads, q_norm=None, k_norm=None, eps=0.0, unit_offset=False
):
    return qkv.new_empty(qkv.shape[0], heads, kv_cache.shape[-1])


def wants_decode_kernel(setting: str, device: torch.device) -> bool:
    """`auto` (the default) and `kernel` use it on CPU; `torch` keeps attention.py's torch path.
    The kernel is CPU code: on CUDA the torch path runs whatever the setting."""
    return setting != "torch" and device.type == "cpu"


class KernelBuildError(RuntimeError):
    """The C++ kernels failed to build on a CPU they are made for: a start-up error."""


def require_kernels(required: bool) -> None:
    """Whether a failed build is an error (the default) or falls back to torch ops with a
    warning; the worker passes False only for `--decode-attention torch`, the opt-out."""
    global _required
    _required = required


def kernel_cache_dir(isa: str) -> str:
    """The build directory in the user's cache (never site-packages), one per torch version,
    ISA and version of the sources: a checkout and an installed wheel of the same sources share
    it, and two checkouts of different sources (branches, worktrees) never rebuild over each
    other's binary while the other is loading it."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    entry = f"torch{torch.__version__}-{isa.lower()}-{_sources_digest()}"
    return os.path.join(cache_home, "trident", "cpu_kernels", entry)


def _sources_digest() -> str:
    """A short hash of every file in csrc/, names and contents."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(CSRC)):
        digest.update(name.encode())
        with open(os.path.join(CSRC, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def _copy_sources(build_dir: str) -> list[str]:
    """The sources copied into the build directory where their contents differ (atomically),
    so ninja sees the same paths whichever copy of the package asked for the build."""
    src = os.path.join(build_dir, "src")
    os.makedirs(src, exist_ok=True)
    for name in os.listdir(CSRC):
        with open(os.path.join(CSRC, name), "rb") as f:
            content = f.read()
        target = os.path.join(src, name)
        if os.path.exists(target):
            with open(target, "rb") as f:
                if f.read() == content:
                    continue
        fd, tmp = tempfile.mkstemp(dir=src)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.replace(tmp, target)
    return [os.path.join(src, os.path.basename(path)) for path in SOURCES]


def _put_our_ninja_first_on_path() -> None:
    """torch builds with whichever `ninja` PATH finds first. Ours is the `ninja` package's (a
    dependency): a system ninja of another version reads the shared build directory's log as
    foreign and rebuilds every kernel, and the next start under the package's ninja rebuilds
    them all again (a checkout and an unactivated venv of the wheel see different PATHs).
    The venv's own bin/ is the fallback: it holds ninja when installed there."""
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for bin_dir in candidates:
        if shutil.which("ninja", path=bin_dir):
            path = os.environ.get("PATH", "")
            if path.split(os.pathsep)[0] != bin_dir:
                os.environ["PATH"] = bin_dir + os.pathsep + path
            return


@contextmanager
def _exclusive_build(build_dir: str) -> Iterator[None]:
    """One process at a time builds or loads from `build_dir`, under an flock that the OS
    releases when its holder dies. torch's own build lock is a file (`lock`) that a builder
    killed mid-build leaves behind, after which every later start waits for it forever; with
    every builder under the flock, such a file found by its holder is stale, and removed."""
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "build.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a kernel build that was killed", stale)
            os.remove(stale)
        yield


def _build() -> bool:
    global _built
    if _built is not None:
        return _built
    from torch.utils import cpp_extension

    isa = torch.backends.cpu.get_cpu_capability()
    cflags = [*COMMON_FLAGS, *ISA_FLAGS.get(isa, [])]
    t0 = time.monotonic()
    try:
        build_dir = kernel_cache_dir(isa)
        logger.info("loading the C++ CPU kernels (%s, %s; the first build takes ~30 s)", isa, build_dir)
        _put_our_ninja_first_on_path()
        with _exclusive_build(build_dir):
            sources = _copy_sources(build_dir)
            cpp_extension.load(
                name=f"trident_cpu_kernels_{isa.lower()}",
                sources=sources,
                extra_include_paths=[os.path.dirname(sources[0])],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                build_directory=build_dir,
                is_python_module=False,
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:  # no compiler, a failed build
        if _required and isa in ISA_FLAGS:
            why = (str(e).strip().splitlines() or [repr(e)])[-1]
            raise KernelBuildError(
                f"the C++ CPU kernels failed to build ({why}); "
                "install a C++ compiler with OpenMP (g++) and ninja, or pass --decode-attention torch to run "
                "torch ops instead"
            ) from e
        logger.warning("C++ CPU kernels unavailable (%s): the worker runs torch ops instead", e)
        _built = False
        return False
    torch.library.register_fake("trident::paged_decode_attention")(_decode_attention_fake)
    torch.library.register_fake("trident::vnni_pack_weight")(_vnni_pack_weight_fake)
    torch.library.register_fake("trident::vnni_linear")(_bf16_linear_fake)
    torch.library.register_fake("trident::amx_pack_weight")(_amx_pack_weight_fake)
    torch.library.register_fake("trident::amx_linear")(_bf16_linear_fake)
    torch.library.register_fake("trident::fused_moe_pack")(_fused_moe_pack_fake)
    torch.library.register_fake("trident::fused_moe")(_fused_moe_fake)
    torch.library.register_fake("trident::fused_moe_gguf")(_fused_moe_gguf_fake)
    torch.library.register_fake("trident::widening_pack_weight")(_widening_pack_weight_fake)
    torch.library.register_fake("trident::widening_bf16_linear")(_bf16_linear_fake)
    torch.library.register_fake("trident::greedy_argmax")(_greedy_argmax_fake)
    torch.library.register_fake("trident::quant_linear")(_quant_linear_fake)
    torch.library.register_fake("trident::quant_linear_rows")(_quant_linear_rows_fake)
    torch.library.register_fake("trident::rms_norm")(_rms_norm_fake)
    torch.library.register_fake("trident::add_rms_norm")(_add_rms_norm_fake)
    torch.library.register_fake("trident::silu_and_mul")(_gated_activation_fake)
    torch.library.register_fake("trident::gelu_tanh_and_mul")(_gated_activation_fake)
    torch.library.register_fake("trident::rotary")(_rotary_fake)
    torch.library.register_fake("trident::rotary_write_kv")(_rotary_write_kv_fake)
    _built = True
    logger.info("C++ CPU kernels ready in %.1f s", time.monotonic() - t0)
    return True


def load_decode_attention() -> DecodeKernel | None:
    """The decode attention op, built on first use in this process; None if it cannot be built."""
    return torch.ops.trident.paged_decode_attention if _build() else None


def _avx512_build() -> bool:
    """The kernels are built for AVX-512, the build the AVX-512-only ops exist in."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and _build()


def load_vnni_linear() -> Bf16LinearKernel | None:
    """The packed-weight bf16 linear; None without an AVX-512 build or a CPU with AVX512-BF16."""
    if not _avx512_build():
        return None
    ops = torch.ops.trident
    return Bf16LinearKernel(ops.vnni_pack_weight, ops.vnni_linear) if ops.cpu_has_avx512_bf16() else None


def load_amx_linear() -> Bf16LinearKernel | None:
    """The bf16 linear on AMX tiles; None where the kernels cannot be built or the CPU has no
    AMX-BF16 (or the OS does not grant this process the tile state)."""
    if not _build():
        return None
    ops = torch.ops.trident
    return Bf16LinearKernel(ops.amx_pack_weight, ops.amx_linear) if ops.cpu_has_amx_bf16() else None


def load_fused_moe() -> str:
    """The path torch.ops.trident.fused_moe takes on this CPU ("amx", "avx512_bf16" or
    "portable"), or "" where the kernels cannot be built."""
    return torch.ops.trident.fused_moe_best_path() if _build() else ""


def load_widening_bf16_linear() -> Bf16LinearKernel | None:
    """The bf16 linear on widened weights; None if the kernels cannot be built or the CPU has
    no AVX2 and FMA."""
    if not _build():
        return None
    ops = torch.ops.trident
    return Bf16LinearKernel(ops.widening_pack_weight, ops.widening_bf16_linear) if ops.cpu_has_avx2_fma() else None


def load_greedy_argmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """bf16 logits [rows, vocab] -> each row's argmax (int64); None if the kernels cannot be built."""
    return torch.ops.trident.greedy_argmax if _build() else None


def load_quant_linear() -> str:
    """The path torch.ops.trident.quant_linear takes on this CPU ("amx_int8", "avx512_vnni" or
    "avx2"), or "" where the kernels cannot be built or the CPU has none of them."""
    return torch.ops.trident.quant_linear_best_path() if _build() else ""


def load_elementwise_kernels() -> ElementwiseKernels | None:
    """The layer's elementwise ops; None if the kernels cannot be built."""
    if not _build():
        return None
    ops = torch.ops.trident
    return ElementwiseKernels(
        ops.rms_norm, ops.add_rms_norm, ops.silu_and_mul, ops.gelu_tanh_and_mul, ops.rotary, ops.rotary_write_kv
    )
