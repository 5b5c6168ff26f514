"""The Triton kernels of `--attention-backend triton`: the CUDA path's attention, KV write and norms.

One file per kernel: decode attention (decode_attention.py), a prompt chunk's attention
(extend_attention.py), both over one inner step (online_softmax.py), the KV write with
rotary (rotary_write_kv.py), RMSNorm fused with the residual add (rms_norm.py). They plug
in where the C++ CPU kernels do (cpu_kernels.py's `DecodeKernel` and `ElementwiseKernels`),
so decoder_layer.py and flat_decode.py run them unchanged.

They compile for a GPU, and run on CPU tensors under the Triton interpreter
(`TRITON_INTERPRET=1`, set before triton is imported): how the tests prove them on a machine
without a GPU. The interpreter rounds float32 to bfloat16 by truncation, so its bf16 results
differ from a GPU's by up to one bf16 ulp; float32 is exact or within a few float32 ulps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.kernels.cpu_kernels import DecodeKernel, ElementwiseKernels


def interpreted() -> bool:
    """Triton runs its kernels on the host (`TRITON_INTERPRET=1`): what a CPU device needs."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class TritonKernels:
    """Everything `--attention-backend triton` installs in the model."""

    decode: DecodeKernel
    extend: object
    """TritonExtendAttention: a prompt chunk over its prefix and itself (attention.py)."""
    elementwise: ElementwiseKernels


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def load_triton_kernels(device: torch.device) -> TritonKernels:
    """The kernels for `device`: a GPU, or the CPU under the interpreter (else a clear error)."""
    if device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "--attention-backend triton on --device cpu runs under the Triton interpreter: "
            "set TRITON_INTERPRET=1 (tests and gpu_check's CPU run do)"
        )
    from gpu_worker.kernels.triton.decode_attention import TritonDecodeAttention
    from gpu_worker.kernels.triton.extend_attention import TritonExtendAttention
    from gpu_worker.kernels.triton.rms_norm import add_rms_norm, rms_norm
    from gpu_worker.kernels.triton.rotary_write_kv import rotary_write_kv
    from gpu_worker.model.decoder_layer import apply_rotary

    # Under the interpreter every program runs in turn on the host, each op at a cost: fewer,
    # larger programs (two splits still exercise the merge).
    decode = TritonDecodeAttention(num_splits=2, block_n=64) if device.type == "cpu" else TritonDecodeAttention()
    elementwise = ElementwiseKernels(
        rms_norm,
        add_rms_norm,
        _silu_and_mul,
        _gelu_tanh_and_mul,
        lambda x, cos, signed_sin: apply_rotary(x, (cos, signed_sin)),  # prompt steps only: torch's ops
        rotary_write_kv,
    )
    return TritonKernels(decode, TritonExtendAttention(), elementwise)
